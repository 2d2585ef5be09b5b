"""What admission holds back for the requests already running, and whom a full pool gives back first.

Admitting on free blocks is a bet that the running requests will not need them soon. Two ways to place the bet,
chosen by ``new_token_ratio`` (torch-free, like the scheduler):

* ``None`` (the default), a block of headroom: each running request holds back one block beyond its table, the
  one its next tokens will need; a newcomer is charged the blocks of its first chunk. When memory runs out all the
  same, a running request is preempted (vLLM's rule, in the scheduler): the latest admitted goes first.
* a float, SGLang's reservation (its ``PrefillAdder``): each running request holds back the blocks for the rest of
  its prompt and ``new_token_ratio`` of the output it may still produce; a newcomer is charged its whole prompt and
  all of that output, counted in full in the step that admits it. Before a step, if the step's tokens do not fit,
  requests are retracted (SGLang's ``retract_decode``): the fewest output tokens first, then the longest prompt,
  until the rest fit with ``RETRACT_DECODE_STEPS`` tokens of room each; the ratio then becomes what the survivors
  show, their outputs so far plus that room over all they may produce. Every step that retracts nothing lowers
  the ratio by ``new_token_ratio_decay`` down to ``min_new_token_ratio``: admission grows bolder while memory holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:  # only for type hints
    from .config import EngineConfig

CLIP_MAX_NEW_TOKENS = 4096  # the most output a request is charged for (SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION)
RETRACT_DECODE_STEPS = 20  # after a retraction, the tokens of room each remaining request must have (SGLang's)
REFUSALS = ("blocks", "token_budget", "max_num_seqs", "preempted")  # why a step admitted no more


@dataclass(slots=True)
class Admission:
    """The admission rule and its counters: ``new_token_ratio`` (None: a block of headroom) and why requests wait."""

    new_token_ratio: float | None
    min_new_token_ratio: float
    new_token_ratio_decay: float
    max_num_seqs: int
    max_model_len: int
    block_size: int
    refusals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))  # steps a request waited

    @classmethod
    def from_config(cls, config: EngineConfig) -> Admission:
        return cls(config.new_token_ratio, config.min_new_token_ratio, config.new_token_ratio_decay,
                   config.max_num_seqs, config.max_model_len, config.block_size)

    @property
    def reserves(self) -> bool:
        return self.new_token_ratio is not None

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_new_tokens(self, seq: Sequence) -> int:
        """The output tokens the request may still produce, clipped as SGLang clips them."""
        limit = self.max_model_len - seq.num_prompt_tokens
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens)
        return max(0, min(limit - seq.num_output_tokens, CLIP_MAX_NEW_TOKENS))

    # --8<-- [start:held_back]
    def held_back(self, seq: Sequence, num_blocks: int, ratio: float | None = None) -> int:
        """Blocks a running request holding ``num_blocks`` keeps from newcomers."""
        if not self.reserves:
            return 1  # the block its next tokens will need
        ratio = self.new_token_ratio if ratio is None else ratio
        future = seq.num_tokens + int(ratio * self.max_new_tokens(seq))  # the rest of its prompt, and its outputs
        return max(0, self.blocks(future) - num_blocks)

    def charge(self, seq: Sequence, num_new: int, num_blocks: int) -> int:
        """Blocks a newcomer holding ``num_blocks`` (its cached prefix) needs to be admitted with ``num_new`` tokens."""
        if not self.reserves:
            return max(0, self.blocks(seq.num_computed_tokens + num_new) - num_blocks)  # its first chunk
        return self.held_back(seq, num_blocks, ratio=1.0)  # its whole prompt and every output token it may produce
    # --8<-- [end:held_back]

    # --8<-- [start:refusal]
    def refused(self, budget: int, preempted: bool, num_running: int) -> bool:
        """No waiting request may join this step, whatever its size (the reason counted)."""
        reason = "preempted" if preempted else "token_budget" if budget == 0 else None
        if reason is None and num_running >= self.max_num_seqs:
            reason = "max_num_seqs"
        if reason is not None:  # after a preemption memory is short: a newcomer would only push someone out again
            self.refusals[reason] += 1
        return reason is not None

    def held(self, running: list[Sequence], admitted: set[Sequence], tables: dict[str, list[int]]) -> int:
        """Blocks the ``running`` requests hold back from newcomers, those ``admitted`` in this step in full."""
        return sum(self.held_back(s, len(tables[s.request_id]), 1.0 if s in admitted else None) for s in running)

    def no_room(self, seq: Sequence, num_new: int, running: list[Sequence], admitted: set[Sequence],
                tables: dict[str, list[int]], available: int) -> bool:
        """What the request is charged exceeds the ``available`` blocks that the ``running`` requests (those that may
        still grow) do not hold back; those ``admitted`` in this step hold back their whole charge. Counted."""
        held = self.held(running, admitted, tables)
        if self.charge(seq, num_new, len(tables.get(seq.request_id, ()))) <= available - held:
            return False
        self.refusals["blocks"] += 1
        return True
    # --8<-- [end:refusal]

    # --8<-- [start:retraction]
    def victim(self, seqs: list[Sequence]) -> Sequence:
        """SGLang's order: the fewest output tokens first, then the longest prompt (less work lost, more room won)."""
        return min(seqs, key=lambda s: (s.num_output_tokens, -s.num_prompt_tokens))

    def shortfall(self, queue: list[Sequence], budget: int, room: int, tables: dict[str, list[int]],
                  available: int) -> int:
        """Blocks missing for the queue's tokens of this step, each request with ``room`` tokens more (at most what
        it may still produce)."""
        needed = 0
        for seq in queue:
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= num_new
            end = min(seq.num_computed_tokens + num_new + room, seq.num_tokens + self.max_new_tokens(seq))
            needed += max(0, self.blocks(end) - len(tables.get(seq.request_id, ())))
        return needed - available

    def after_step(self, survivors: list[Sequence], retracted: bool) -> None:
        """Raise the ratio to what the survivors of a retraction show; otherwise let it decay toward its minimum."""
        if not self.reserves:
            return
        if retracted:
            produced = sum(s.num_output_tokens for s in survivors) + RETRACT_DECODE_STEPS * len(survivors)
            possible = sum(s.num_output_tokens + self.max_new_tokens(s) for s in survivors)
            self.new_token_ratio = min(1.0, produced / max(1, possible))
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
    # --8<-- [end:retraction]
