"""How one request wants its tokens chosen and when it wants to stop (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules, checked when constructed.

    * ``temperature=0`` means greedy: always the most likely token.
    * ``top_k=-1`` keeps the whole vocabulary (vLLM's convention); ``0`` is refused
      so that "no limit" has exactly one spelling.
    * ``top_p=1.0`` keeps the whole distribution.
    * ``max_tokens=None`` generates until a stop or the model's context is full.
    * ``seed`` gives the request its own random generator: the same seed gives the
      same tokens whatever else runs alongside it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable it")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (or None for 'until the context is full'), got {self.max_tokens!r}"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
