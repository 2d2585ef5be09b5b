"""m7's second acceptance rule, ``"acceptance": "rejection"``: the model's distribution kept, not m6's tokens.

The rule itself is checked statistically: with fixed seeds, a vocabulary of five tokens and
20,000 rows, the tokens it gives must follow the target's probabilities p (a chi-square test),
whatever distribution q the guesses were drawn from. Drawing from p instead of the residual
max(p - q, 0) after a rejection gives p(x) twice a chance at a rejected guess's neighbours and
fails it (the mutation catalogue plants exactly that). In the engine, greedy requests still
give m6's tokens: with a certain pick, keeping a guess with probability p(guess) is matching it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from milestones import m6, m7
from milestones.m7.proposer import NgramProposer
from milestones.m7.sampler import rejection_sample
from milestones.model_store import first_layers_copy
from tests.chain import assert_same_outputs, mixed_workload, run
from tests.m7.test_vs_m6 import LIMITS, NGRAM, OracleProposer

P = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])  # the target's probabilities
ROWS = 20_000
CHI2_CRITICAL = 18.47  # 4 degrees of freedom, a 0.1% chance of failing a correct rule


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def judged(q: torch.Tensor | None, guess_from: torch.Tensor, seed: int) -> torch.Tensor:
    """ROWS rows with the target's P: guesses drawn from ``guess_from``, judged against q (None: certain guesses)."""
    generator = torch.Generator().manual_seed(seed)
    guesses = torch.multinomial(guess_from, ROWS, replacement=True, generator=generator)
    uniforms = torch.rand(ROWS, generator=generator)
    noise = torch.empty(ROWS, len(P)).exponential_(generator=generator)
    return rejection_sample(P.expand(ROWS, -1), guesses, uniforms, noise, None if q is None else q.expand(ROWS, -1))


def test_the_rule_row_by_row():
    """Hand-made rows, each testing one part of the rule, before the statistics below: a guess is kept exactly when
    u * q(guess) < p(guess); a rejected one is replaced by the exponential race over max(p - q, 0), never over p."""
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])  # the guess, token 1, has p/q = 0.25/0.4 = 0.625
    cases = [  # (guess, u, certain, what the row must give, why)
        (1, 0.6, False, 1, "u = 0.6 < p/q = 0.625 at the guess: kept (u * q(guess) < p(guess))"),
        (1, 0.65, False, None, "u = 0.65 > p/q = 0.625 at the guess: rejected"),
        (0, 0.99, False, 0, "p(guess) = 0.45 > q(guess) = 0.1: kept whatever u (min(1, p/q) = 1)"),
        (0, 0.4, True, 0, "a certain guess (q None: one-hot) is kept with probability p(guess): u = 0.4 < 0.45"),
        (0, 0.5, True, None, "a certain guess with u = 0.5 > p(guess) = 0.45: rejected"),
    ]
    # Noise that favours token 3 in the race: drawn from p, token 3 (p/noise = 100) would win; its residual
    # max(p - q, 0) is 0 whatever the guess, so a rejected guess's replacement must be another token.
    noise = torch.tensor([1.0, 1.0, 1.0, 1e-3, 1.0])
    for guess, u, certain, want, why in cases:
        token = int(rejection_sample(P[None], torch.tensor([guess]), torch.tensor([u]), noise[None],
                                     None if certain else q[None])[0])
        residual = (P - (torch.nn.functional.one_hot(torch.tensor(guess), len(P)).float() if certain else q)).clamp(
            min=0)
        if want is not None:
            assert token == want, f"guess {guess} gave token {token}, expected the guess kept: {why}"
            continue
        assert token != guess, f"guess {guess} was kept: {why}"
        rounded = [round(x, 2) for x in q.tolist()]
        shown = f"p {[round(x, 2) for x in P.tolist()]}, q {'one-hot' if certain else rounded}"
        assert residual[token] > 0, (
            f"guess {guess}, rejected ({why}), was replaced by token {token}, whose residual max(p - q, 0) is 0 "
            f"({shown}): the replacement is drawn from the residual, argmax(residual / noise), never from p itself"
        )
        assert token == int((residual / noise).argmax()), (
            f"guess {guess}, rejected ({why}), was replaced by token {token}, expected "
            f"{int((residual / noise).argmax())}: the exponential race over the residual, argmax(residual / noise)"
        )


@pytest.mark.parametrize("q", [
    torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1]),  # a draft that is often wrong
    torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1]),  # one close to the target
    torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5]),  # one that never guesses the likeliest tokens
], ids=["far", "close", "tail-only"])
def test_the_tokens_follow_the_targets_probabilities_whatever_the_draft(q):
    tokens = judged(q, q, seed=1)
    statistic = chi_square(tokens, P)
    assert statistic < CHI2_CRITICAL, f"chi-square {statistic:.1f} over {CHI2_CRITICAL} (5 tokens, {ROWS} rows): " \
        f"counts {torch.bincount(tokens, minlength=5).tolist()} against {(P * ROWS).tolist()}"
    assert torch.equal(tokens, judged(q, q, seed=1)), "the same seeds must give the same tokens"


@pytest.mark.parametrize("guess_from", [torch.tensor([0.2] * 5), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])],
                         ids=["uniform-guesses", "always-the-rarest"])
def test_certain_guesses_as_prompt_lookup_makes_them(guess_from):
    """A proposer without probabilities (q is the guess itself): kept with probability p(guess), else p without it."""
    tokens = judged(None, guess_from, seed=2)
    statistic = chi_square(tokens, P)
    assert statistic < CHI2_CRITICAL, f"chi-square {statistic:.1f} over {CHI2_CRITICAL}: " \
        f"counts {torch.bincount(tokens, minlength=5).tolist()} against {(P * ROWS).tolist()}"


def test_the_test_fails_without_the_residual():
    """The same rule drawing a rejected guess's replacement from p itself: the chi-square test must see it."""
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
    generator = torch.Generator().manual_seed(1)
    guesses = torch.multinomial(q, ROWS, replacement=True, generator=generator)
    uniforms = torch.rand(ROWS, generator=generator)
    noise = torch.empty(ROWS, len(P)).exponential_(generator=generator)
    keep = uniforms * q[guesses] < P[guesses]
    tokens = torch.where(keep, guesses, (P / noise).argmax(dim=-1))
    assert chi_square(tokens, P) > 10 * CHI2_CRITICAL


@dataclasses.dataclass(frozen=True)
class LenientOracle(OracleProposer):
    """m6's continuation, wrong every third position, while the request still follows m6; then no guess."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        try:
            return OracleProposer.propose(self, token_ids, num_tokens)
        except StopIteration:  # a sampled request that rejection sampling took elsewhere
            return []


def test_greedy_requests_still_give_m6s_tokens_and_sampled_ones_finish(tiny_model_path):
    prompts, settings = mixed_workload(12, seed=13, max_prompt=40, max_output=30)
    reference = run(m6, m6.LLM(tiny_model_path, **LIMITS), prompts, settings)
    config = NGRAM | {"acceptance": "rejection"}
    with m7.LLM(tiny_model_path, **LIMITS, speculative_config=config) as llm:
        futures = tuple(tuple(p) + tuple(c.token_ids) for p, c in zip(prompts, reference))
        llm.engine.speculator.proposer = LenientOracle(1, 1, futures)
        ours = run(m7, llm, prompts, settings)
        stats = llm.engine.spec_stats()
    greedy = [i for i, s in enumerate(settings) if s.get("temperature") == 0]
    assert greedy
    assert_same_outputs([ours[i] for i in greedy], [reference[i] for i in greedy])
    for completion, setting in zip(ours, settings):
        assert completion.finish_reason in ("stop", "length") and len(completion.token_ids) <= setting["max_tokens"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    sampled = [i for i in range(len(settings)) if i not in greedy]
    assert any(ours[i] != reference[i] for i in sampled), "no sampled request left m6's tokens: was a guess judged?"


def test_an_unknown_acceptance_rule_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="acceptance must be 'exact' or 'rejection'"):
        m7.LLM(tiny_model_path, **LIMITS, speculative_config=NGRAM | {"acceptance": "greedy"})


@dataclasses.dataclass(frozen=True)
class FavouriteOracle(NgramProposer):
    """Guesses, for a request's second token only, the token m6 ranked first after the request's first token."""

    guess_after: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)  # prompt + first token -> guess

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        guess = self.guess_after.get(tuple(token_ids))
        return [guess] if guess is not None else []

    def look_up(self, seq, num_tokens: int) -> list[int]:
        return self.propose(seq.token_ids, num_tokens)


ENGINE_TEMPERATURE = 5.0  # the tiny model is sure of itself: flattened, each of the five ranks gets a share


@pytest.fixture(scope="module")
def one_layer_draft(tiny_model_path, tmp_path_factory):
    return first_layers_copy(tiny_model_path, 1, tmp_path_factory.mktemp("draft") / "first-layer")


def top_k_probs(logprobs: dict) -> tuple[list[int], torch.Tensor]:
    """The five tokens top-k 5 samples from, likeliest first, and their probabilities at ENGINE_TEMPERATURE, from a
    row's top-5 log-probabilities (of the model's own logits)."""
    top = sorted((lp.rank, token, lp.logprob) for token, lp in logprobs.items() if lp.rank <= 5)
    return [token for _, token, _ in top], (torch.tensor([value for *_, value in top]) / ENGINE_TEMPERATURE).softmax(0)


@pytest.mark.parametrize("proposer", ["favourite", "draft"])
def test_the_engine_keeps_the_models_distribution_under_rejection(tiny_model_path, one_layer_draft, proposer):
    """Many seeds, one prompt, top-k 5: each request's second token is judged against a guess: of the token m6
    found likeliest after its first (certain, as prompt lookup's are), or a one-layer draft's (drawn from its q).
    m6's own top-5 log-probabilities give each request's p exactly (softmax over the top 5, at the temperature, is
    what top-k samples from), and the tokens m7 keeps or draws must follow those p: a chi-square test over the five
    ranks (summed over requests, whose p differ: a little conservative). m6's tokens must pass the same test, which
    checks the statistic; drawing a rejected guess's replacement from p instead of the residual fails it (chi-square
    61 here), and so does judging a draft's guess as if it were certain."""
    num_requests, prompt = 240, [17, 4021, 233, 9, 1500, 77]
    settings = [dict(temperature=ENGINE_TEMPERATURE, top_k=5, seed=s, max_tokens=3, ignore_eos=True, logprobs=5)
                for s in range(num_requests)]
    limits = LIMITS | dict(max_num_seqs=64, max_num_batched_tokens=512)
    reference = run(m6, m6.LLM(tiny_model_path, **limits), [prompt] * num_requests, settings)
    ranked = [top_k_probs(completion.logprobs[1]) for completion in reference]  # p after each request's first token
    guesses = {tuple(prompt) + (c.token_ids[0],): tokens[0] for c, (tokens, _) in zip(reference, ranked)}
    config = {"method": "ngram", "num_speculative_tokens": 1, "acceptance": "rejection"}
    if proposer == "draft":
        config |= {"method": "draft_model", "model": str(one_layer_draft)}
    with m7.LLM(tiny_model_path, **limits, speculative_config=config) as llm:
        if proposer == "favourite":
            llm.engine.speculator.proposer = FavouriteOracle(1, 1, guesses)
        ours = run(m7, llm, [prompt] * num_requests, settings)
        stats = llm.engine.spec_stats()
    assert [c.token_ids[0] for c in ours] == [c.token_ids[0] for c in reference], "the first tokens are m6's"
    assert stats["num_draft_tokens"] == num_requests, stats
    assert 0 < stats["num_accepted_tokens"] < num_requests, stats
    assert any(a.token_ids != b.token_ids for a, b in zip(ours, reference)), "every token is m6's: was a guess judged?"

    def statistic(completions) -> tuple[float, list[int], list[float]]:
        counts, expected = [0] * 5, [0.0] * 5
        for completion, (tokens, probs) in zip(completions, ranked):
            counts[tokens.index(completion.token_ids[1])] += 1
            expected = [e + float(p) for e, p in zip(expected, probs)]
        return sum((c - e) ** 2 / e for c, e in zip(counts, expected)), counts, expected

    if proposer == "draft":  # the rate at which guesses are kept is sum min(p, q), not the certain guess's sum p q
        drafted = run(m6, m6.LLM(one_layer_draft, **limits), [prompt + c.token_ids[:1] for c in reference],
                      [dict(s, max_tokens=1) for s in settings])  # q: the draft's top-5 after each first token
        rates, certain = [], 0.0
        for (p_tokens, p), completion in zip(ranked, drafted):
            p_of, q_of = dict(zip(p_tokens, p.tolist())), dict(zip(*top_k_probs(completion.logprobs[0])))
            rates.append(sum(min(p_of.get(x, 0.0), float(q_of.get(x, 0.0))) for x in p_of.keys() | q_of.keys()))
            certain += sum(p_of.get(x, 0.0) * float(q) for x, q in q_of.items())
        expected, spread = sum(rates), math.sqrt(sum(r * (1 - r) for r in rates))
        assert abs(stats["num_accepted_tokens"] - expected) < 4.5 * spread, (
            f"{stats['num_accepted_tokens']} of {num_requests} draft guesses kept, expected {expected:.1f} "
            f"(standard deviation {spread:.1f}); a guess judged as certain would keep {certain:.1f}")
    for name, completions in (("m6", reference), ("m7", ours)):
        value, counts, expected = statistic(completions)
        assert value < CHI2_CRITICAL, f"{name}: chi-square {value:.1f} over {CHI2_CRITICAL}: second tokens by rank " \
            f"{counts}, expected {[round(e, 1) for e in expected]}"
