"""The OpenAI wire format: a request body checked and parsed, and the answer shaped as OpenAI's, whole or streamed.

No engine here: ``milestones.serve`` turns a ``Job`` into an engine request and feeds
the engine's outputs to an ``Answer``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from milestones.serving.sampling_params import MAX_LOGPROBS, InvalidParam, SamplingParams, StructuredOutputsParams

# OpenAI's parameters this server honours (`user`, `store` and `metadata` are bookkeeping, accepted and unused); any
# other is refused, rather than silently ignored, unless it holds the value that asks for nothing (NO_OPS).
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "ignore_eos", "user", "store", "metadata", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "response_format"}
# logprobs: how many of the likeliest tokens to return; echo: the prompt first (with its log-probabilities, if asked)
COMPLETION_KEYS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}  # a flag, and how many

# Options this server does not implement, and the values of each that ask for nothing: clients (LangChain, lm-eval,
# guidellm) send them on every request. Any other value is refused with the values that are accepted.
# --8<-- [start:no_ops]
NO_OPS = {
    "best_of": (1,),
    "echo": (False,),  # in a chat; a completion echoes
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
}
ALWAYS_NO_OP = {"parallel_tool_calls", "service_tier"}  # meaningless without tools / a choice of service tiers
# --8<-- [end:no_ops]


class BadRequest(ValueError):
    """Input the server refuses (HTTP 400); its message says what to change, ``param`` which parameter (or None)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(BadRequest):
    """A model this server does not serve (HTTP 404, code ``model_not_found``, as OpenAI answers)."""


@dataclass(slots=True)
class Job:
    """One parsed request: what to generate and how to answer."""

    prompts: list[str | list[int] | ChatPrompt]  # one choice each; a chat's templated later, by a tokenizer
    params: Any  # the milestone's SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    echo: bool = False  # a completion's text and log-probabilities start with its prompt's


def parse_request(body: object, chat: bool, model_name: str) -> Job:
    """A request body checked and turned into a Job; BadRequest (HTTP 400) says what to change."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}  # null means "the default", as in OpenAI
    honoured = CHAT_KEYS if chat else COMPLETION_KEYS
    unknown = sorted(set(body) - honoured - set(NO_OPS) - ALWAYS_NO_OP)
    if unknown:
        raise BadRequest(f"unsupported parameter(s) {', '.join(unknown)}: remove them", unknown[0])
    for key in sorted(set(body) & set(NO_OPS) - honoured):
        if not any(_same(body[key], value) for value in NO_OPS[key]):
            allowed = " or ".join(json.dumps(value) for value in NO_OPS[key])
            raise BadRequest(f"{key} {json.dumps(body[key])} is not supported by this server: send {allowed} "
                             "(or leave it out)", key)
    if body.get("model", model_name) != model_name:
        raise ModelNotFound(f"model {body['model']!r} is not served here; this server serves {model_name!r}", "model")
    stream, options = body.get("stream", False), body.get("stream_options", {})
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("stream must be true or false, and stream_options an object such as {\"include_usage\": true}",
                         "stream" if not isinstance(stream, bool) else "stream_options")
    if chat:
        prompts = [chat_prompt(body.get("messages"))]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompts = completion_prompts(body.get("prompt"))
        max_tokens = body.get("max_tokens", 16)
    sampling = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "n")  # repetition_penalty: vLLM's extension
    settings = {key: body[key] for key in sampling if key in body}
    settings["logprobs"] = requested_logprobs(body, chat)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r}", "echo")
    if echo and settings["logprobs"] is not None:  # lm-eval's loglikelihood: the prompt's tokens scored
        settings["prompt_logprobs"] = settings["logprobs"]
    try:
        settings["structured_outputs"] = structured_outputs(body.get("response_format"))
        params = SamplingParams(max_tokens=max_tokens, **settings)
    except BadRequest:  # response_format's own refusal, which names it already
        raise
    except InvalidParam as err:
        raise BadRequest(str(err), openai_param(err.param, chat, body)) from None
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err)) from None
    return Job(prompts, params, stream, bool(options.get("include_usage")) and stream, chat, echo)


def openai_param(name: str, chat: bool, body: object) -> str:
    """The request's own name for a parameter the engine refused (OpenAI's ``param``)."""
    if chat and name == "prompt":
        return "messages"
    if chat and name == "max_tokens" and isinstance(body, dict) and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return {"structured_outputs": "response_format", "choice": "response_format",
            "prompt_logprobs": "logprobs"}.get(name, name)  # prompt_logprobs: echo's, asked for by logprobs


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many of the likeliest tokens to return with each token's log-probability (None: no log-probabilities).

    A completion asks with ``logprobs: k``; a chat with ``logprobs: true`` and ``top_logprobs: k`` (0 if left out).
    """
    flag, top = body.get("logprobs", False), body.get("top_logprobs")
    if not chat:
        return None if flag is False else flag  # the engine checks the number
    if not isinstance(flag, bool):
        raise BadRequest(f"logprobs must be true or false in a chat (top_logprobs says how many), got {flag!r}",
                         "logprobs")
    if top not in (None, 0) and not flag:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise BadRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (how many of the likeliest tokens to "
                         f"return besides the chosen one), got {top!r}", "top_logprobs")
    return (0 if top is None else top) if flag else None


def structured_outputs(response_format: object) -> StructuredOutputsParams | None:
    """OpenAI's response_format as the engine's StructuredOutputsParams (None: plain text)."""
    if response_format is None or response_format == {"type": "text"}:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        schema = response_format["json_schema"].get("schema")
        if isinstance(schema, dict):
            return StructuredOutputsParams(json=schema)
    raise BadRequest('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                     '"json_schema": {"name": ..., "schema": {...}}}', "response_format")


def _same(given: object, value: object) -> bool:
    """JSON equality: 0 and 0.0 are one number, but false is not 0."""
    if isinstance(given, bool) or isinstance(value, bool):
        return given is value
    return given == value


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """A completion's prompt as a list of prompts, one choice each: a string, token ids, or a batch of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompt):
        return list(prompt)  # a batch: a choice per prompt, in order (lm-eval sends token ids this way)
    raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either (a choice each)",
                     "prompt")


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


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation whose shape is checked; called with a tokenizer, it runs the model's chat template and gives
    the token ids ready for the assistant's answer (later, on a thread of the server's that tokenizes; the
    template's errors are still a 400)."""

    messages: list[dict]

    @property
    def chars(self) -> int:
        """The characters of its messages: the template adds a few per turn, never removes any."""
        return sum(len(m["content"]) for m in self.messages)

    def __call__(self, tokenizer: Any) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (roles that must alternate, ...)
            raise BadRequest(f"the chat template refused the conversation: {err}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(messages: object) -> ChatPrompt:
    """The conversation's messages checked and turned into text turns (see ChatPrompt)."""
    return ChatPrompt([{"role": m["role"], "content": text_content(m, i)}
                       for i, m in enumerate(_message_list(messages))])


def _message_list(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': '...'} objects", "messages")
    return messages


def text_content(message: dict, index: int) -> str:
    """A message's content as text: a string, a list of text parts (joined by newlines, as vLLM does), or an
    assistant's null (a turn that only called tools)."""
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{index}] has a content part of type {kind!r}: this server reads text "
                                 "only; send parts such as {'type': 'text', 'text': '...'}", "messages")
        return "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': '...'} objects (content: a "
                         f"string or a list of text parts); messages[{index}] has content {content!r}", "messages")
    return content
