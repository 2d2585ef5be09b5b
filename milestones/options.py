"""Engine options checked from a table: a line per option, saying what its value must be.

Not a lesson: every milestone adds options, and with a table each one costs its
milestone a line (``"async_scheduling": FLAG``), not another ``if``. Checks that relate
two options (a budget at least the batch size) stay in ``EngineConfig.resolve``. An option
made of options (m7's ``speculative_config``) is a dataclass of its own, read by ``nested``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TypeVar


@dataclass(frozen=True, slots=True)
class Kind:
    """What an option's value must be: the test, and the words the error uses for it."""

    accepts: Callable[[object], bool]
    description: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FLAG = Kind(lambda v: isinstance(v, bool), "True or False")
FLAG_OR_AUTO = Kind(lambda v: isinstance(v, bool) or v == "auto", "True, False or 'auto'")
INTEGER = Kind(_is_int, "an integer")
POSITIVE = Kind(lambda v: _is_int(v) and v >= 1, "a positive integer")
POSITIVE_OR_NONE = Kind(lambda v: v is None or (_is_int(v) and v >= 1), "a positive integer, or None")
PATH_OR_NONE = Kind(lambda v: v is None or isinstance(v, (str, os.PathLike)), "a path (a string), or None")


def one_of(*choices: str) -> Kind:
    return Kind(lambda v: isinstance(v, str) and v in choices, " or ".join(repr(c) for c in choices))


def check(config: object, table: dict[str, Kind]) -> None:
    """Raise a ValueError naming the first option whose value its kind does not accept."""
    for name, kind in table.items():
        value = getattr(config, name)
        if not kind.accepts(value):
            raise ValueError(f"{name} must be {kind.description}, got {value!r}")


Config = TypeVar("Config")


def nested(cls: type[Config], given: object, table: dict[str, Kind], name: str) -> Config:
    """The dataclass ``cls`` from a dict of its fields (or one already made, checked again), each value checked by
    ``table``; the errors name the option ``name``."""
    if isinstance(given, cls):
        given = asdict(given)
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    if not isinstance(given, dict) or not set(given) <= set(names) or not set(required) <= set(given):
        raise ValueError(f"{name} takes the keys {', '.join(names)} ({' and '.join(required)} required), "
                         f"got {sorted(given) if isinstance(given, dict) else given!r}")
    config = cls(**given)
    try:
        check(config, table)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    return config
