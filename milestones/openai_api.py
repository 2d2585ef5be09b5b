"""The OpenAI wire format: a request body checked and parsed, and the answer shaped as OpenAI's, whole or streamed.

No engine here: ``milestones.serve`` turns a ``Job`` into an engine request and feeds
the engine's outputs to an ``Answer``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# OpenAI's parameters this server honours (`user` is metadata, accepted and unused); any other is refused, rather
# than silently ignored.
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "ignore_eos", "user"}
COMPLETION_KEYS = COMMON | {"prompt"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}


class BadRequest(ValueError):
    """Input the server refuses (HTTP 400); its message says what to change."""


@dataclass(slots=True)
class Job:
    """One parsed request: what to generate and how to answer."""

    prompt: str | list[int] | Callable[[], list[int]]  # a chat's is templated on the engine thread
    params: Any  # the milestone's SamplingParams
    stream: bool
    include_usage: bool
    chat: bool


def parse_request(body: object, chat: bool, model_name: str, tokenizer: Any, sampling_params: type) -> Job:
    """A request body checked and turned into a Job; BadRequest (HTTP 400) says what to change."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_KEYS if chat else COMPLETION_KEYS))
    if unknown:
        raise BadRequest(f"unsupported parameter(s) {', '.join(unknown)}: remove them")
    body = {key: value for key, value in body.items() if value is not None}  # null means "the default", as in OpenAI
    if body.get("model", model_name) != model_name:
        raise BadRequest(f"model {body['model']!r} is not served here; this server serves {model_name!r}")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1: send one request per completion")
    stream, options = body.get("stream", False), body.get("stream_options", {})
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("stream must be true or false, and stream_options an object such as {\"include_usage\": true}")
    if chat:
        prompt = chat_prompt(tokenizer, body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)):
            raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)")
        max_tokens = body.get("max_tokens", 16)
    sampling = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop")
    settings = {key: body[key] for key in sampling if key in body}
    try:
        params = sampling_params(max_tokens=max_tokens, **settings)
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err)) from None
    return Job(prompt, params, stream, bool(options.get("include_usage")), chat)


class Answer:
    """A request's answer in OpenAI's shape, built up from the engine's outputs: whole, or as stream chunks."""

    def __init__(self, job: Job, request_id: str, model: str) -> None:
        self.job, self.model = job, model
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.text, self.finish_reason, self.finished = "", None, False
        self.prompt_tokens = self.completion_tokens = 0
        self.sent_role = False

    def update(self, output: Any) -> dict | None:
        """Take the engine's latest output; the stream chunk it adds (None if it adds nothing)."""
        completion = output.outputs[0]
        delta, self.text = completion.text[len(self.text):], completion.text
        self.prompt_tokens, self.completion_tokens = len(output.prompt_token_ids), len(completion.token_ids)
        self.finished, self.finish_reason = output.finished, completion.finish_reason
        if not delta and not self.finished:
            return None
        if self.job.chat:
            message = {"content": delta} if self.sent_role else {"role": "assistant", "content": delta}
            self.sent_role = True
            choice = {"index": 0, "delta": message, "finish_reason": self.finish_reason}
            return self._envelope("chat.completion.chunk", choice)
        choice = {"index": 0, "text": delta, "finish_reason": self.finish_reason, "logprobs": None}
        return self._envelope("text_completion", choice)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def usage_chunk(self) -> dict | None:
        if not self.job.include_usage:
            return None
        kind = "chat.completion.chunk" if self.job.chat else "text_completion"
        return {**self._envelope(kind, None), "choices": [], "usage": self.usage()}

    def whole(self) -> dict:
        if self.job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": self.finish_reason}
            return {**self._envelope("chat.completion", choice), "usage": self.usage()}
        choice = {"index": 0, "text": self.text, "finish_reason": self.finish_reason, "logprobs": None}
        return {**self._envelope("text_completion", choice), "usage": self.usage()}

    def _envelope(self, kind: str, choice: dict | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}


def chat_prompt(tokenizer: Any, messages: object) -> Callable[[], list[int]]:
    """The conversation through the model's chat template, as token ids ready for the assistant's answer.

    The shape is checked now; the template and the tokenizer run later, on the engine's
    thread, the only one that uses the tokenizer (its errors are still a 400).
    """
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': '...'} objects")

    def token_ids() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (roles that must alternate, ...)
            raise BadRequest(f"the chat template refused the conversation: {err}") from None
        return tokenizer.encode(text, add_special_tokens=False)

    return token_ids
