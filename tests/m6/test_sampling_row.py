"""What sampling reads of a request when its step is launched: with penalties, the output so far, futures included."""

from __future__ import annotations

from milestones.m6.detokenizer import IncrementalDetokenizer
from milestones.m6.sequence import Sequence
from milestones.m6.step import SamplingRow
from milestones.serving.sampling_params import SamplingParams


def launched(params: SamplingParams) -> Sequence:
    """A request with prompt [5, 6], outputs 7 and 8 known, and a third output still on the device (future id -3)."""
    seq = Sequence("r", None, [5, 6], params, seed=1, detokenizer=IncrementalDetokenizer(None, [5, 6], []))
    seq.token_ids += [7, 8, -3]
    seq.num_pending_tokens = 1
    return seq


def test_a_penalty_reads_the_token_still_on_the_device():
    row = SamplingRow.of(launched(SamplingParams(frequency_penalty=1.0)))
    assert row.prompt_token_ids == [5, 6]
    assert row.output_token_ids == (7, 8, -3), (
        f"the history is {row.output_token_ids}: the token the previous step is computing counts too (m5 would have "
        "it by now); its future id stays in the copy, and the sampler resolves it on the device")


def test_without_penalties_nothing_is_copied():
    assert SamplingRow.of(launched(SamplingParams())).output_token_ids == ()
