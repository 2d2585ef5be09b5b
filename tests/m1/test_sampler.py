"""m1, step 7: the sampler, on hand-made logits.

Greedy rows (``temperature=0``, or below ``SAMPLING_EPS``) take the argmax. Sampled rows
divide their logits by the temperature, keep the top-k, then the smallest head of the
ranking whose mass reaches top-p, on what top-k kept (transformers' TopKLogitsWarper and
TopPLogitsWarper, in that order), and draw with the exponential race ``argmax(probs /
noise)``, the noise ``Exponential(1)`` from a generator seeded with ``noise_seed(seed,
position)`` alone, the position being the number of tokens the sequence has.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from milestones.m1.detokenizer import IncrementalDetokenizer
from milestones.m1.sampler import Sampler, noise_seed
from milestones.m1.sequence import Sequence
from milestones.serving.sampling_params import SamplingParams

from .closeness import EXACT, Tolerance, expect_close

PROBS = Tolerance(1e-7, rtol=1e-5)  # probabilities in float32: a softmax over another set of -inf moves the last bits
VOCAB = 1000


def seq(seed: int = 0, prompt_len: int = 1, **params) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    return Sequence("r", None, prompt, SamplingParams(**params), seed=seed,
                    detokenizer=IncrementalDetokenizer(None, prompt, []))


def expected_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The noise of the token at ``position``: a generator seeded with noise_seed(seed, position), nothing else."""
    generator = torch.Generator().manual_seed(noise_seed(seed, position))
    return torch.empty(vocab).exponential_(generator=generator)


def transformers_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's probabilities after transformers' top-k, then top-p, warpers (-1 and 1.0: that warper is off)."""
    scores = logits[None]
    if top_k != -1:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


ROWS = [  # sampled rows, each with its own rules
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.7},
    {"temperature": 0.5, "top_k": 50, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 2 * VOCAB, "top_p": 0.95},  # a top_k beyond the vocabulary keeps every token
]


def described(params: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in params.items())


def test_filtered_probs_match_transformers_top_k_then_top_p():
    logits = 3 * torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [seq(**params) for params in ROWS]
    probs = Sampler(torch.device("cpu")).filtered_probs(logits, seqs)
    for row, params in enumerate(ROWS):
        top_k, top_p = params.get("top_k", -1), params.get("top_p", 1.0)
        expect_close(f"filtered_probs, row {row} ({described(params)})", probs[row],
                     transformers_probs(logits[row], top_k, top_p), PROBS, source="transformers' warpers")


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.6, 2), (0.85, 3)])
def test_top_p_keeps_the_token_that_crosses_it(top_p, kept):
    """A token is kept while the tokens ranked above it hold less than top_p: the one that crosses top_p is kept."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    expected = torch.zeros(4)
    expected[:kept] = probs[:kept] / probs[:kept].sum()
    got = Sampler(torch.device("cpu")).filtered_probs(probs.log()[None], [seq(top_p=top_p)])[0]
    expect_close(f"filtered_probs of probabilities {probs.tolist()} with top_p={top_p} (the {kept} likeliest kept)",
                 got, expected, PROBS, source="the rule")


def test_top_p_applies_to_what_top_k_kept():
    """top_k=2 leaves [2/3, 1/3]: the first token alone reaches top_p=0.6 (in the whole distribution it would not)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    got = Sampler(torch.device("cpu")).filtered_probs(probs.log()[None], [seq(top_k=2, top_p=0.6)])[0]
    expect_close(f"filtered_probs of probabilities {probs.tolist()} with top_k=2, top_p=0.6", got,
                 torch.tensor([1.0, 0.0, 0.0, 0.0]), PROBS, source="the rule")


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_rows_take_the_argmax_whatever_their_noise(temperature):
    """Rows 0, 2, 4 are greedy among sampled rows, on flat logits where a draw would rarely pick the argmax."""
    logits = 0.1 * torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    seqs = [seq(seed=row, temperature=temperature if row % 2 == 0 else 1.0) for row in range(6)]
    tokens = picks(Sampler(torch.device("cpu")), logits, seqs)
    for row in range(0, 6, 2):
        assert tokens[row] == int(logits[row].argmax()), (
            f"row {row} has temperature={temperature} (greedy: below SAMPLING_EPS, SamplingParams.greedy): it must "
            f"take the argmax {int(logits[row].argmax())}, the sampler gave {tokens[row]}"
        )


@pytest.mark.parametrize("seed, position", [(0, 1), (5, 1), (5, 7), (2**40 + 3, 3), (-(2**63), 2)])
def test_the_noise_is_seeded_by_the_seed_and_the_position_alone(seed, position):
    s = seq(seed=seed, prompt_len=position)
    sampler = Sampler(torch.device("cpu"))
    for attempt in ("drawn", "drawn again (nothing carried over from the first draw)"):
        expect_close(f"exponential_noise of a request with seed {seed} and {position} tokens, {attempt}",
                     sampler.exponential_noise(s, VOCAB), expected_noise(seed, position, VOCAB), EXACT,
                     source=f"a generator seeded with noise_seed({seed}, {position})")


def test_sampled_rows_race_their_probabilities_against_their_own_noise():
    """Each row's token is exactly argmax(probs / noise): its logits / temperature, filtered, raced with its noise."""
    logits = 2 * torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(2))
    seqs = [seq(seed=100 + row, prompt_len=3 + 4 * row, **params) for row, params in enumerate(ROWS)]
    tokens = picks(Sampler(torch.device("cpu")), logits, seqs)
    for row, (params, s) in enumerate(zip(ROWS, seqs)):
        probs = transformers_probs(logits[row] / params["temperature"], params.get("top_k", -1),
                                   params.get("top_p", 1.0))
        expected = int((probs / expected_noise(s.seed, s.num_tokens, VOCAB)).argmax())
        assert tokens[row] == expected, (
            f"row {row} ({described(params)}, seed {s.seed}, {s.num_tokens} tokens so far): the exponential race "
            f"argmax(probs / noise) picks {expected}, the sampler gave {tokens[row]}; check the temperature, the "
            "filter and the noise (the tests above check filtered_probs and exponential_noise alone)"
        )


def test_the_temperature_divides_the_logits_before_top_p():
    """logits [ln 3, 0]: as they are, token 0 holds 0.75 and top_p=0.7 keeps it alone; divided by temperature 2 it
    holds 0.63 and top-p keeps both tokens. Forty rows, each with its own seed: some draw token 1."""
    logits = torch.tensor([math.log(3), 0.0]).repeat(40, 1)
    seqs = [seq(seed=row, temperature=2.0, top_p=0.7) for row in range(40)]
    tokens = picks(Sampler(torch.device("cpu")), logits, seqs)
    probs = transformers_probs(logits[0] / 2.0, -1, 0.7)  # [0.63, 0.37]: both kept
    expected = [int((probs / expected_noise(s.seed, s.num_tokens, 2)).argmax()) for s in seqs]
    assert tokens == expected, (
        f"40 rows of logits [ln 3, 0] with temperature=2.0, top_p=0.7 drew token 1 {tokens.count(1)} times, the "
        f"race over the logits divided by the temperature, then filtered, {expected.count(1)} times: divide by the "
        "temperature before filtered_probs (top-p keeps token 0 alone at temperature 1, both tokens at 2)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on a CPU every tensor is on the CPU")
def test_the_noise_is_drawn_on_the_samplers_device():
    noise = Sampler(torch.device("cuda")).exponential_noise(seq(seed=1, prompt_len=2), VOCAB)
    assert noise.device.type == "cuda", (
        f"exponential_noise made its noise on {noise.device}, not the sampler's device cuda: "
        "`torch.empty(vocab, device=self.device)`")


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def picks(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The sampler's token per row; it must return them as one tensor of token ids, a row each."""
    tokens = sampler(logits, seqs)
    assert isinstance(tokens, torch.Tensor) and tokens.shape == (len(seqs),) and not tokens.is_floating_point(), (
        f"the sampler must return a tensor of {len(seqs)} token ids, got {tokens!r:.200}")
    return tokens.tolist()


def draw(n: int, **params) -> torch.Tensor:
    """n tokens of one sequence, each appended before the next is drawn (the noise depends on the position)."""
    sampler, s = Sampler(torch.device("cpu")), seq(**params)
    for _ in range(n):
        s.token_ids.append(picks(sampler, LOGITS, [s])[0])
    return torch.tensor(s.output_token_ids)


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    tokens = picks(Sampler(torch.device("cpu")), logits, [seq(temperature=0), seq(temperature=0)])
    assert tokens == [1, 0], f"greedy rows of {logits.tolist()} must give their argmax [1, 0], got {tokens}"


def test_sampling_follows_the_softmax():
    counts = torch.bincount(draw(4000, temperature=1.0), minlength=5).float() / 4000
    expected = LOGITS[0].softmax(-1)
    # 4000 draws: a frequency's standard deviation is at most 0.008, so 0.03 is nearly 4 of them
    expect_close("the frequency of each token in 4000 draws", counts, expected, Tolerance(0.03),
                 source="softmax(logits)")


def test_top_k_and_top_p_cut_the_tail():
    probs = LOGITS[0].softmax(-1)  # [0.53, 0.20, 0.12, 0.07, 0.03]
    for params, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.6}, {0, 1}), ({"top_p": 0.3}, {0})]:
        seen = set(draw(300, **params).tolist())
        assert seen == allowed, f"300 draws with {described(params)} from {probs.tolist()} gave {seen}, not {allowed}"


def test_low_temperature_sharpens():
    seen = set(draw(200, temperature=0.05).tolist())
    assert seen == {0}, f"temperature=0.05 turns logits {LOGITS[0].tolist()} into near-certainty of 0, drew {seen}"


def test_seed_fixes_the_stream_and_rows_do_not_interact():
    a = draw(50, seed=5)
    assert torch.equal(a, draw(50, seed=5)), "the same seed drew two different streams"
    assert not torch.equal(a, draw(50, seed=6)), "seeds 5 and 6 drew the same 50 tokens"
    sampler, s1, s2 = Sampler(torch.device("cpu")), seq(seed=5), seq(seed=9)
    for _ in range(50):
        for s, token in zip([s1, s2], picks(sampler, LOGITS.repeat(2, 1), [s1, s2])):
            s.token_ids.append(token)
    assert s1.output_token_ids == a.tolist(), "seed 5 drew other tokens beside a request with seed 9 than alone"


def test_the_noise_depends_only_on_seed_and_position():
    """No random state is carried from one draw to the next: drawing again (after a failed step, say) repeats."""
    s = seq(seed=5)
    first = Sampler(torch.device("cpu")).exponential_noise(s, 1000)
    s.token_ids.append(0)
    assert not torch.equal(Sampler(torch.device("cpu")).exponential_noise(s, 1000), first), (
        "the noise of the next position equals this one's: seed it with noise_seed(seq.seed, seq.num_tokens)"
    )
    assert noise_seed(5, 0) != noise_seed(5, 1) and noise_seed(5, 0) != noise_seed(5 + 2**32, 0)
