"""The options of m7's speculative decoding, checked: ``SpeculativeConfig`` and its table, with vLLM's keys.

Not a lesson, like ``milestones.options``: the keys are read on the m7 page, and a dict of them is checked here,
once, for m7 and every milestone after it. What the engine does with them (guessing, checking, the lookahead) is
the lesson, in ``milestones/m7``.
"""

from __future__ import annotations

from dataclasses import dataclass

from milestones import options


# --8<-- [start:speculative_config]
@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """How a request's next tokens are guessed, and how many a step (vLLM's names)."""

    method: str  # "ngram": prompt lookup over the request's own tokens; "draft_model": a smaller model's picks
    num_speculative_tokens: int  # k: the most tokens guessed for a request in a step, all checked in one forward
    prompt_lookup_min: int = 2  # ngram: the shortest run of latest tokens looked up
    prompt_lookup_max: int = 4  # ngram: the longest, tried first
    model: str | None = None  # draft_model: the draft (a name or folder, as LLM's model), with the target's tokenizer
    acceptance: str = "exact"  # "exact": a guess counts if it is the pick m6 makes (m6's tokens); "rejection": the
    # standard rule, kept with probability p(guess): the same distribution as m6, other tokens when sampling
    disable_by_batch_size: int | None = None  # a step of at least this many requests guesses nothing (None: any
    # step guesses): in a busy step every row is real arithmetic, and a wrong guess wastes nearly a token's cost

    @classmethod
    def from_dict(cls, given: dict | SpeculativeConfig) -> SpeculativeConfig:
        """Checked through its options table, then the checks that relate two of its options."""
        config = options.nested(cls, given, SPECULATIVE_OPTIONS, "speculative_config")
        if (config.method == "draft_model") != (config.model is not None):
            raise ValueError("speculative_config: 'model' names the draft, and only method 'draft_model' has one, "
                             f"which it needs; got method {config.method!r} with model {config.model!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


SPECULATIVE_OPTIONS = {
    "method": options.one_of("ngram", "draft_model"),
    "num_speculative_tokens": options.POSITIVE,
    "prompt_lookup_min": options.POSITIVE,
    "prompt_lookup_max": options.POSITIVE,
    "model": options.PATH_OR_NONE,
    "acceptance": options.one_of("exact", "rejection"),
    "disable_by_batch_size": options.POSITIVE_OR_NONE,
}
# --8<-- [end:speculative_config]

SPECULATIVE_CONFIG = options.Kind(lambda v: v is None or isinstance(v, (dict, SpeculativeConfig)),
                                  "a dict such as {'method': 'ngram', 'num_speculative_tokens': 3}, or None")
