"""Errors in OpenAI's shape: the refusals the server raises, and the answer each one gets.

A refusal is raised where the fault is found (the body, its parse, the engine's queue) and
answered in one place, ``refusal``, so every route gives the same status, headers and
``param`` for the same fault.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from milestones.engine_loop import ServerBusy
from milestones.serving.sampling_params import InvalidParam

RETRY_AFTER_SECONDS = 1  # a 503's Retry-After: a busy server frees places as requests finish, within seconds


class BadRequest(ValueError):
    """Input the server refuses (HTTP 400); its message says what to change, ``param`` which parameter (or None)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(BadRequest):
    """A model this server does not serve (HTTP 404, code ``model_not_found``, as OpenAI answers)."""


class BodyTooLarge(Exception):
    """The request body is over ``Limits.max_body_bytes`` (HTTP 413)."""


class BodyTimeout(Exception):
    """The client stopped sending its body for ``Limits.body_timeout`` seconds (HTTP 408)."""


def openai_param(name: str, chat: bool, body: object) -> str:
    """The request's own name for a parameter the engine refused (OpenAI's ``param``)."""
    if chat and name == "prompt":
        return "messages"
    if chat and name == "max_tokens" and isinstance(body, dict) and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return {"structured_outputs": "response_format", "choice": "response_format",
            "prompt_logprobs": "logprobs"}.get(name, name)  # prompt_logprobs: echo's, asked for by logprobs


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape: message, type, param (the request's parameter at fault, or None) and code (a name
    such as ``model_not_found``, or None)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def refusal(err: Exception, chat: bool = False, body: object = None) -> JSONResponse:
    """The answer to a request the server could not take, by the reason; an error of the engine's that names a
    parameter names it as the request (a chat's or a completion's ``body``) spelled it."""
    if isinstance(err, json.JSONDecodeError):
        return error(400, f"the body is not valid JSON: {err}")
    if isinstance(err, (BodyTooLarge, BodyTimeout)):  # the rest of the body is not read: the connection ends here
        response = error(413 if isinstance(err, BodyTooLarge) else 408, str(err))
        response.headers["Connection"] = "close"
        return response
    if isinstance(err, ModelNotFound):
        return error(404, str(err), "model_not_found", "model")
    if isinstance(err, ValueError):  # BadRequest, or the engine refusing the request (too long, bad tokens, ...)
        param = openai_param(err.param, chat, body) if isinstance(err, InvalidParam) else getattr(err, "param", None)
        return error(400, str(err), param=param)  # param: the parameter to change, when one is at fault
    if isinstance(err, ServerBusy):
        response = error(503, str(err))
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response
    return error(500, f"the engine could not take the request: {err!r}")  # not the client's fault
