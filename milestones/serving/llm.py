"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)``, written once for every milestone.

Each milestone binds it to its own engine in its ``__init__.py`` (``class LLM(serving.LLM)`` naming its
``LLMEngine`` and ``EngineConfig``), so the front end never imports a milestone.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar

from tqdm.auto import tqdm

from milestones.recorder import Recorder

from .outputs import RequestOutput
from .prompts import Prompt, as_token_ids
from .sampling_params import SamplingParams


class LLM:
    """Load a model once, then generate for lists of prompts.

    ``LLM()`` loads the bundled SmolLM2-135M-Instruct on CUDA/bf16 if available,
    else CPU/fp32. Further keyword arguments use vLLM's names (``max_model_len``,
    ``seed``, ...): the fields of the milestone's ``EngineConfig``.
    """

    engine_class: ClassVar[type]  # the milestone's LLMEngine, set by the milestone's subclass
    config_class: ClassVar[type]  # and its EngineConfig

    def __init__(self, model: str | None = None, *, device=None, dtype=None, record_file: str | Path | None = None,
                 **kwargs) -> None:
        """``record_file``: keep every step's schedule and bookkeeping for the replay page (milestones/recorder.py),
        written there after each ``generate`` and on ``close``."""
        accepted = {f.name for f in fields(self.config_class)}
        unknown = set(kwargs) - accepted
        if unknown:
            raise TypeError(f"unknown LLM option(s) {sorted(unknown)}; accepted: {sorted(accepted)}")
        if record_file is not None:  # refused now, not after a generate whose outputs the failing write would lose
            folder = Path(record_file).parent
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise ValueError(f"record_file={str(record_file)!r}: its folder {str(folder)!r} does not exist or "
                                 "cannot be written; pick a path in a writable folder")
        self.engine: Any = self.engine_class(self.config_class(model=model, device=device, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self.record_file = record_file
        try:
            self.recorder = Recorder(self.engine) if record_file is not None else None
        except ValueError:
            self.engine.close()  # its workers, if it has any
            raise

    def close(self) -> None:
        """Release what the engine holds (from m6 on: its forward worker, and the trace if one was asked for), and
        write the recording if one was asked for. ``with LLM() as llm:`` does it on leaving the block."""
        self.engine.close()
        self._write_recording()

    def _write_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.write(self.record_file)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --8<-- [start:generate]
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        Whatever goes wrong (a bad prompt, a failing step, Ctrl-C), the requests of this
        call are aborted before the error reaches the caller: the engine is left as found.
        """
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            params = sampling_params
        else:
            params = [SamplingParams() if sampling_params is None else sampling_params] * len(prompts)
        request_ids = []
        with self.engine.lock:  # other threads' calls wait until this one is done
            try:
                for index, (prompt, p) in enumerate(zip(prompts, params)):
                    try:
                        request_ids.append(self.engine.add_request(prompt, p))
                    except ValueError as err:
                        raise ValueError(f"prompt {index}: {err}") from None
                return self._run(request_ids, use_tqdm and len(prompts) > 1)
            except BaseException:
                for request_id in request_ids:
                    self.engine.abort_request(request_id)
                raise
    # --8<-- [end:generate]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        token_ids = []
        for conversation in _as_conversations(messages):
            try:
                text = self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception as err:  # the template's own checks (roles that must alternate, ...)
                raise ValueError(f"the chat template refused the conversation: {err}") from None
            token_ids.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(token_ids, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        """Step the engine until every one of these requests has finished."""
        wanted, finished = set(request_ids), {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            while len(finished) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        self._write_recording()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: object) -> list:
    """One prompt (a string or token ids) or a list of them, as a list of prompts."""
    if hasattr(prompts, "tolist"):  # a NumPy array: one row of token ids, or one row per prompt
        prompts = prompts.tolist()
    if isinstance(prompts, str) or as_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got {prompts!r:.80}")
    return list(prompts)


def _as_conversations(messages: object) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them, each message checked."""
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        conversations = messages
    elif isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        conversations = [messages]
    else:
        raise ValueError("chat takes a conversation, a list of {'role': ..., 'content': ...} dicts, or a list of "
                         f"conversations; got {messages!r:.80}")
    for c, conversation in enumerate(conversations):
        for m, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise ValueError(f"conversation {c}, message {m}: a message must be a dict, got {message!r:.80}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise ValueError(f"conversation {c}, message {m}: it needs a string {key!r}, "
                                     f"got {message.get(key)!r:.80}")
                try:
                    message[key].encode("utf-8")
                except UnicodeEncodeError as err:
                    raise ValueError(f"conversation {c}, message {m}: its {key!r} is not valid text ({err.reason} "
                                     f"at character {err.start}); remove or replace it") from None
    return conversations
