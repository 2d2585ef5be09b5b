"""OpenAI's answer to a request: a choice per prompt and sample, with its text and log-probabilities, and the usage.

Fed the engine's outputs by ``milestones.server.streaming``; nothing here knows of HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from milestones.server.request import Job


class Answer:
    """A request's answer in OpenAI's shape, built up from the engine's outputs: whole, or as stream chunks."""

    def __init__(self, job: Job, request_id: str, model: str, index: int = 0, token_texts: Sequence[str] = (),
                 echo_text: str = "", sample: int = 0) -> None:
        self.job, self.model, self.index = job, model, index  # index: the choice (prompt p's sample s: p * n + s)
        self.sample = sample  # which of the request's n completions this choice reads
        self.echo_text = echo_text  # the prompt's text, which an echoing completion's text starts with
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.text, self.finish_reason, self.finished = "", None, False
        self.prompt_tokens = self.completion_tokens = 0
        self.started = False  # the first chunk is sent (a chat's names the role; an echo's holds the prompt)
        self.token_texts = token_texts  # each token id's text: log-probabilities name tokens by their text
        self.logprobs: list[tuple[int, dict | None]] = []  # (token id, {token id: Logprob}) of every token so far
        self.echoed: list[tuple[int, dict | None]] = []  # echo: the prompt's, the first token's None, before them
        self.sent_logprobs = 0  # how many of them the stream has sent

    def update(self, output: Any) -> dict | None:
        """Take the engine's latest output; the stream chunk it adds (None if it adds nothing)."""
        if self.finished:  # n > 1: this sample has ended while others go on
            return None
        completion = output.outputs[self.sample]
        delta, self.text = completion.text[len(self.text):], completion.text
        self.prompt_tokens, self.completion_tokens = len(output.prompt_token_ids), len(completion.token_ids)
        self.finish_reason = completion.finish_reason
        self.finished = self.finish_reason is not None  # this sample's end (the request's, when n is 1)
        if output.prompt_logprobs is not None and not self.echoed:
            self.echoed = list(zip(output.prompt_token_ids, output.prompt_logprobs))
        if completion.logprobs is not None:
            self.logprobs = self.echoed + list(zip(completion.token_ids, completion.logprobs))
        if not delta and not self.finished:
            return None  # a token whose text is held back (a possible stop string): its log-probability waits too
        if not self.started and self.job.echo:  # the first chunk of an echoing completion starts with the prompt
            delta = self.echo_text + delta
        fresh, self.sent_logprobs = self._logprobs(self.sent_logprobs), len(self.logprobs)
        if self.job.chat:
            message = {"content": delta} if self.started else {"role": "assistant", "content": delta}
            self.started = True
            choice = {"index": self.index, "delta": message, "logprobs": fresh, "finish_reason": self.finish_reason}
            return self._envelope("chat.completion.chunk", choice)
        self.started = True
        choice = {"index": self.index, "text": delta, "finish_reason": self.finish_reason, "logprobs": fresh}
        return self._envelope("text_completion", choice)

    def choice(self) -> dict:
        """This choice of the whole answer."""
        if self.job.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": self.text},
                    "logprobs": self._logprobs(0), "finish_reason": self.finish_reason}
        return {"index": self.index, "text": self.echo_text + self.text, "finish_reason": self.finish_reason,
                "logprobs": self._logprobs(0)}

    # --8<-- [start:logprobs]
    def _logprobs(self, start: int) -> dict | None:
        """The log-probabilities of the tokens from ``start`` on, in OpenAI's shape: a chat's list of tokens, each
        with its k likeliest; a completion's parallel lists (the legacy shape lm-eval reads), which start with the
        prompt's tokens when it echoes (the first has None: nothing before it predicts it)."""
        if self.job.params.logprobs is None:
            return None
        texts, tokens = self.token_texts, self.logprobs[start:]
        if self.job.chat:
            def entry(token: int, logprob: Any) -> dict:
                return {"token": texts[token], "logprob": logprob.logprob, "bytes": list(texts[token].encode())}

            likeliest = self.job.params.logprobs
            return {"content": [{**entry(token, found[token]), "top_logprobs": [
                entry(other, logprob) for other, logprob in sorted(found.items(), key=lambda item: item[1].rank)
                if logprob.rank <= likeliest]} for token, found in tokens]}
        strings = [texts[token] for token, _ in tokens]
        before = sum(len(texts[token]) for token, _ in self.logprobs[:start])
        return {"tokens": strings,
                "token_logprobs": [None if found is None else found[token].logprob for token, found in tokens],
                "top_logprobs": [None if found is None else {texts[other]: p.logprob for other, p in found.items()}
                                 for _, found in tokens],
                "text_offset": list(accumulate((len(text) for text in strings), initial=before))[:-1]}
    # --8<-- [end:logprobs]

    def _envelope(self, kind: str, choice: dict | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}


def usage(answers: list[Answer]) -> dict:
    """Tokens over every choice of a request, as OpenAI counts them: a prompt once, however many samples it has."""
    prompt = sum(a.prompt_tokens for a in answers if a.sample == 0)
    completion = sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole(answers: list[Answer]) -> dict:
    """The answer in one body: a choice per prompt, in order."""
    first = answers[0]
    kind = "chat.completion" if first.job.chat else "text_completion"
    return {**first._envelope(kind, None), "choices": [a.choice() for a in answers], "usage": usage(answers)}


def usage_chunk(answers: list[Answer]) -> dict | None:
    """The stream's last chunk, with the usage, when the client asked for it (``stream_options.include_usage``)."""
    first = answers[0]
    if not first.job.include_usage:
        return None
    kind = "chat.completion.chunk" if first.job.chat else "text_completion"
    return {**first._envelope(kind, None), "usage": usage(answers)}
