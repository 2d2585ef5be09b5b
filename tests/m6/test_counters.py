"""m6's counters keep one order, stated once and checked by ``Sequence.check_integrity``: processed <= computed <
num_tokens, and the known tokens (num_tokens - num_pending_tokens) at most max_model_len. m7 adds the draft's."""

from __future__ import annotations

import pytest

from milestones.m6 import SamplingParams
from milestones.m6.detokenizer import IncrementalDetokenizer
from milestones.m6.sequence import Sequence, SequenceStatus
from milestones.m7 import sequence as m7_sequence

MAX_MODEL_LEN = 16


def running(cls=Sequence, generated=(9,)):
    """A running request whose step in flight samples one token (its future id ends token_ids)."""
    prompt = [5, 6, 7]
    seq = cls("r", None, prompt, SamplingParams(max_tokens=None), 0, IncrementalDetokenizer(None, prompt, []))
    seq.status = type(seq.status).RUNNING
    seq.token_ids += [*generated, -1]
    seq.num_pending_tokens = 1
    seq.num_computed_tokens = seq.num_processed_tokens = seq.num_tokens - 1
    return seq


def test_counters_in_their_order_pass():
    seq = running()
    seq.num_processed_tokens -= 2  # a processed step behind the launched ones: still in order
    seq.check_integrity(SequenceStatus.RUNNING, MAX_MODEL_LEN)


@pytest.mark.parametrize("counter, value", [
    ("num_processed_tokens", 5),  # processed past computed
    ("num_computed_tokens", 5),  # computed reaching num_tokens
    ("num_processed_tokens", -1),
])
def test_counters_out_of_order_are_named(counter, value):
    seq = running()
    setattr(seq, counter, value)
    with pytest.raises(AssertionError, match=r"processed \S+ <= computed \S+ < num_tokens 5 .* must hold"):
        seq.check_integrity(SequenceStatus.RUNNING, MAX_MODEL_LEN)


def test_known_tokens_beyond_max_model_len_are_named():
    seq = running(generated=range(9, 22))  # 3 + 13 known tokens, one pending: 16 known, at the limit
    seq.check_integrity(SequenceStatus.RUNNING, MAX_MODEL_LEN)
    with pytest.raises(AssertionError, match=r"known 16 \(num_tokens - num_pending_tokens\) <= max_model_len 15"):
        seq.check_integrity(SequenceStatus.RUNNING, MAX_MODEL_LEN - 1)


def test_m7_keeps_the_draft_behind_the_known_tokens():
    seq = running(m7_sequence.Sequence)
    seq.spec.num_drafted_tokens = seq.num_tokens - 2  # the draft wrote every known token but the last
    seq.check_integrity(m7_sequence.SequenceStatus.RUNNING, MAX_MODEL_LEN)
    seq.spec.num_drafted_tokens = seq.num_tokens - 1  # a token not known yet: the future id's slot
    with pytest.raises(AssertionError, match="the draft model's keys and values reach a token not known yet"):
        seq.check_integrity(m7_sequence.SequenceStatus.RUNNING, MAX_MODEL_LEN)
