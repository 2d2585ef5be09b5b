"""The sampler on hand-made logits: greedy, top-k, top-p, and that sampling follows the distribution."""

from __future__ import annotations

import torch

from milestones.m1.detokenizer import IncrementalDetokenizer
from milestones.m1.sampler import Sampler, noise_seed
from milestones.m1.sampling_params import SamplingParams
from milestones.m1.sequence import Sequence


def seq(seed=0, **params) -> Sequence:
    return Sequence(
        "r", None, [1], SamplingParams(**params), seed=seed, detokenizer=IncrementalDetokenizer(None, [1], [])
    )


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def draw(n: int, **params) -> torch.Tensor:
    """n tokens of one sequence, each appended before the next is drawn (the noise depends on the position)."""
    sampler, s = Sampler(torch.device("cpu")), seq(**params)
    for _ in range(n):
        s.token_ids.append(sampler(LOGITS, [s])[0].token_id)
    return torch.tensor(s.output_token_ids)


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    picks = Sampler(torch.device("cpu"))(logits, [seq(temperature=0), seq(temperature=0)])
    assert [pick.token_id for pick in picks] == [1, 0]


def test_sampling_follows_the_softmax():
    counts = torch.bincount(draw(4000, temperature=1.0), minlength=5).float() / 4000
    expected = LOGITS[0].softmax(-1)
    assert (counts - expected).abs().max() < 0.03, (counts, expected)


def test_top_k_and_top_p_cut_the_tail():
    assert set(draw(300, top_k=2).tolist()) == {0, 1}
    probs = LOGITS[0].softmax(-1)  # [0.53, 0.20, 0.12, 0.07, 0.03]
    assert set(draw(300, top_p=0.6).tolist()) == {0, 1}, probs
    assert set(draw(100, top_p=0.3).tolist()) == {0}


def test_low_temperature_sharpens():
    assert set(draw(200, temperature=0.05).tolist()) == {0}


def test_seed_fixes_the_stream_and_rows_do_not_interact():
    a = draw(50, seed=5)
    assert torch.equal(a, draw(50, seed=5))
    assert not torch.equal(a, draw(50, seed=6))
    sampler, s1, s2 = Sampler(torch.device("cpu")), seq(seed=5), seq(seed=9)
    for _ in range(50):
        for s, pick in zip([s1, s2], sampler(LOGITS.repeat(2, 1), [s1, s2])):
            s.token_ids.append(pick.token_id)
    assert torch.equal(torch.tensor(s1.output_token_ids), a)


def test_the_noise_depends_only_on_seed_and_position():
    """No random state is carried from one draw to the next: drawing again (after a failed step, say) repeats."""
    s = seq(seed=5)
    first = Sampler(torch.device("cpu")).exponential_noise(s, 1000)
    assert torch.equal(Sampler(torch.device("cpu")).exponential_noise(s, 1000), first)
    s.token_ids.append(0)
    assert not torch.equal(Sampler(torch.device("cpu")).exponential_noise(s, 1000), first)
    assert noise_seed(5, 0) != noise_seed(5, 1) and noise_seed(5, 0) != noise_seed(5 + 2**32, 0)
