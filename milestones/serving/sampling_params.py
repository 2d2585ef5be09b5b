"""How one request wants its tokens chosen and when it wants to stop (vLLM's names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from numbers import Integral, Real

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM: dividing logits by them overflows
SEED_RANGE = (-(2**63), 2**64)  # what a 64-bit random generator can be seeded with
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs


class InvalidParam(ValueError):
    """A sampling parameter refused; ``param`` names it, so that a server can say which one (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules, checked when constructed (``InvalidParam`` names the one refused) and
    immutable afterwards.

    * ``temperature=0`` means greedy: always the most likely token.
    * ``top_k=-1`` keeps the whole vocabulary (vLLM's convention); ``0`` is refused
      so that "no limit" has exactly one spelling.
    * ``top_p=1.0`` keeps the whole distribution.
    * ``max_tokens=None`` generates until a stop or the model's context is full.
    * ``seed`` fixes the request's random numbers: the same seed gives the same
      tokens whatever else runs alongside it.
    * ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2]) lower the
      logit of every token generated so far: once, and once per time it occurred.
      ``repetition_penalty`` (> 0; 1.0 is off) divides a positive logit of every token
      of the prompt or the output by it, and multiplies a negative one.
    * ``logprobs=k`` returns, for every generated token, its log-probability and the
      k likeliest tokens' (0: the chosen token's alone), under the model's own logits.
    * ``prompt_logprobs=k`` returns the same for every token of the prompt, from the
      second on (the first has nothing before it to predict it). Such a request
      computes its whole prompt: it takes nothing from a prefix cache (m4 on).
    * ``n`` samples of the prompt come back as ``n`` completions of one output; with a
      seed, sample i is what the request alone would give with ``seed + i``.
    * ``structured_outputs`` holds the output to a format (``StructuredOutputsParams``, or
      a dict of its arguments): at every step, tokens that would break it are masked
      before sampling.

    Frozen, so a request cannot be changed under the engine after it was checked:
    ``dataclasses.replace(params, top_k=50)`` makes a changed copy, checked again.
    NumPy numbers are accepted and stored as Python ones.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()  # a string or any list of strings is accepted, and stored as a tuple
    stop_token_ids: tuple[int, ...] = ()  # any list or array of integers is accepted, and stored as a tuple
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Frozen: normalised values are stored with object.__setattr__, once, here.
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _set(self, name, _as_real(name, getattr(self, name)))
        _set(self, "top_k", _as_int("top_k", self.top_k))
        _set(self, "n", _as_int("n", self.n))
        if isinstance(self.structured_outputs, dict):  # {"regex": ...} is accepted, and stored as what it says
            unknown = set(self.structured_outputs) - {"json", "json_object", "regex", "choice"}
            if unknown:
                raise InvalidParam("structured_outputs", "structured_outputs takes json, json_object, regex or choice, "
                                   f"not {sorted(unknown)}")
            _set(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):  # None is meaningful for these
            value = getattr(self, name)
            _set(self, name, None if value is None else _as_int(name, value))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _set(self, "stop", _as_tuple("stop", stop, "a string or a list of strings"))
        _set(self, "stop_token_ids", tuple(
            _as_int("stop_token_ids", t) for t in _as_tuple("stop_token_ids", self.stop_token_ids, "a list of integers")
        ))
        self._check()

    def _check(self) -> None:
        if not self.temperature >= 0:
            raise InvalidParam("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable it")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParam("structured_outputs", "structured_outputs must be a StructuredOutputsParams or a dict "
                               "of its arguments (json, json_object, regex or choice), "
                               f"got {self.structured_outputs!r:.60}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise InvalidParam("ignore_eos", "ignore_eos=True cannot go with structured_outputs: a structured output "
                               "ends where its format does, with the end-of-sequence token")
        if self.n < 1:
            raise InvalidParam("n", f"n must be an integer >= 1 (how many samples of the prompt), got {self.n!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", "max_tokens must be an integer >= 1 (or None for 'until the context is "
                               f"full'), got {self.max_tokens!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidParam("stop", f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids",
                               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParam("ignore_eos", f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise InvalidParam("seed", f"seed must fit in 64 bits, in [-2**63, 2**64), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidParam(name, f"{name} must be in [-2, 2] (0 is off), got {getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise InvalidParam("repetition_penalty",
                               f"repetition_penalty must be > 0 (1.0 is off), got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidParam(name, f"{name} must be None or in [0, {MAX_LOGPROBS}] (how many of the likeliest "
                                   f"tokens to return besides the chosen one), got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """The format a request's output must take (vLLM's names), exactly one of: a JSON schema (``json``, as text or a
    dict), any JSON object (``json_object=True``), a regular expression (``regex``), or one of a list of strings
    (``choice``)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            _set(self, "json", json.dumps(self.json))  # text, its properties in their order: what the compiler reads
        if self.choice is not None:
            _set(self, "choice", _as_tuple("choice", self.choice, "a list of strings"))
        given = [self.json is not None, self.json_object is not False, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise InvalidParam("structured_outputs", "structured_outputs takes exactly one of json (a schema), "
                               f"json_object=True, regex or choice; got {self!r:.100}")
        if self.json is not None and not isinstance(self.json, str):
            raise InvalidParam("structured_outputs",
                               f"json must be a JSON schema, as a dict or as text, got {self.json!r:.60}")
        if not isinstance(self.json_object, bool):
            raise InvalidParam("structured_outputs", f"json_object must be True or False, got {self.json_object!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidParam("structured_outputs", f"regex must be a non-empty string, got {self.regex!r:.60}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidParam("structured_outputs",
                               f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.60}")


def checked_params(params: object) -> SamplingParams:
    """A request's rules as the engine takes them: None means the defaults; anything but a SamplingParams is refused."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params


def _set(params: SamplingParams | StructuredOutputsParams, name: str, value: object) -> None:
    """Store a normalised value in the frozen dataclass (only while it is being constructed)."""
    object.__setattr__(params, name, value)


def _as_real(name: str, value: object) -> float:
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if math.isfinite(number):
            return number
    raise InvalidParam(name, f"{name} must be a finite number, got {value!r:.40}")


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_tuple(name: str, value: object, expected: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or getattr(value, "ndim", 1) == 0:
        raise InvalidParam(name, f"{name} must be {expected}, got {value!r}")
    return tuple(value)
