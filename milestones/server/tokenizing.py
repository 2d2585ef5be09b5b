"""Prompts turned into token ids off the engine's thread, bounded like the engine's queue."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from milestones.engine_loop import Prompt, ServerBusy
from milestones.server.chat import ChatPrompt
from milestones.server.errors import BadRequest
from milestones.serving.prompts import tokenize_prompt


class Tokenizing:
    """Prompts to token ids on threads of their own, not the engine's: a long prompt or conversation then delays its
    own request only. Each thread has its own copy of the tokenizer (a fast tokenizer is not safe to share between
    threads), and text too long to fit ``max_model_len`` is refused before any of it is tokenized."""

    WORKERS = 4

    def __init__(self, llm: Any, max_waiting: int) -> None:
        self.source, self.engine = llm.tokenizer, llm.engine
        self.max_waiting, self.waiting = max_waiting, 0  # prompts queued or being tokenized: bounded, like the engine
        self.pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="tokenize")
        self.local = threading.local()
        # No token covers more characters than the longest string in the vocabulary, so a text longer than that many
        # times max_model_len has more tokens than max_model_len: refused without tokenizing it.
        self.max_chars = max(map(len, llm.tokenizer.get_vocab())) * self.engine.config.max_model_len

    async def __call__(self, prompt: str | list[int] | ChatPrompt) -> Prompt:
        limit = self.engine.config.max_model_len
        if isinstance(prompt, list):
            if len(prompt) >= limit:  # checked here, not id by id on the engine's thread
                raise BadRequest(f"prompt has {len(prompt)} tokens but max_model_len is {limit}: shorten the prompt "
                                 "(it must leave room for one generated token)", "prompt")
        elif (size := prompt.chars if isinstance(prompt, ChatPrompt) else len(prompt)) > self.max_chars:
            raise BadRequest(f"the prompt is {size:,} characters, more than any {limit} tokens (max_model_len) can "
                             "hold: shorten it", "messages" if isinstance(prompt, ChatPrompt) else "prompt")
        if self.waiting >= self.max_waiting:
            raise ServerBusy(f"{self.waiting} prompts are waiting to be tokenized: retry later")
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._token_ids, prompt)
        finally:
            self.waiting -= 1

    def _token_ids(self, prompt: str | list[int] | ChatPrompt) -> list[int]:
        if not hasattr(self.local, "tokenizer"):
            self.local.tokenizer = copy.deepcopy(self.source)
        if isinstance(prompt, ChatPrompt):
            return prompt(self.local.tokenizer)
        return tokenize_prompt(self.local.tokenizer, prompt, self.engine.model_config.vocab_size)
