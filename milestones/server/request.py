"""A request body checked and parsed into a ``Job``: its prompts, and the milestone's ``SamplingParams``.

No engine here: ``milestones.server.app`` reads the body, turns a ``Job`` into engine
requests, and answers with ``milestones.server.answer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from milestones.server.chat import ChatPrompt, chat_prompt
from milestones.server.errors import BadRequest, ModelNotFound, openai_param
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
