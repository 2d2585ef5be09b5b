"""The ngram proposer on its own: plain lists, no model (it is torch-free, like the scheduler that calls it)."""

from __future__ import annotations

import random

from milestones.m7.detokenizer import IncrementalDetokenizer
from milestones.m7.proposer import PROBE_INTERVAL, NgramProposer, guess_room
from milestones.m7.sequence import Sequence
from milestones.m7.step import ScheduledBatch
from milestones.serving.sampling_params import SamplingParams


def test_the_latest_earlier_occurrence_of_the_longest_suffix_wins():
    proposer = NgramProposer(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    got = proposer.propose(tokens, 2)
    assert got == [8, 1], (
        f"proposed {got} after {tokens}, expected [8, 1]: '1 2 3' was last seen at 4..6, followed by 8 (the latest "
        "earlier occurrence wins, never the suffix itself at the end)"
    )
    got = proposer.propose([5, 6, 7, 5, 6], 3)
    assert got == [7, 5, 6], f"proposed {got}, expected [7, 5, 6]: only as many tokens as follow the match"
    got = proposer.propose([4, 1, 2, 7, 2], 2)
    assert got == [7, 2], f"proposed {got}, expected [7, 2]: '7 2' never repeats, so n goes down to 1: '2' at 2"
    got = NgramProposer(min_n=2, max_n=3).propose([4, 1, 2, 7, 2], 2)
    assert got == [], f"proposed {got} with min_n=2, expected []: a single token is too short a match here"
    got = NgramProposer(min_n=1, max_n=2).propose([1, 2, 5, 7, 2, 9, 1, 2], 2)
    assert got == [5, 7], (
        f"proposed {got}, expected [5, 7]: the longest suffix first, n from max_n down: '1 2' (seen at 0) before "
        "'2' alone (seen later, at 4)"
    )


def test_nothing_to_propose():
    proposer = NgramProposer(min_n=1, max_n=4)
    assert proposer.propose([1, 2, 3, 4], 3) == [], "no token repeats: nothing to propose, []"
    assert proposer.propose([7], 3) == [], "one token has no earlier occurrence: []"
    assert proposer.propose([1, 1, 1], 0) == [], "num_tokens 0: []"


def test_the_index_guesses_what_propose_guesses_as_tokens_come():
    """propose_batch looks up each request's index (look_up), kept up to date token by token: on random texts, some
    copying their own earlier passages, it must give what propose's scan gives at every length, for any n and room."""
    rng = random.Random(0)
    for trial in range(400):
        min_n = rng.randint(1, 3)
        proposer = NgramProposer(min_n, rng.randint(min_n, 5))
        vocab = rng.choice([2, 3, 8, 1000])  # a small vocabulary repeats by chance, a large one only by copying
        seq = sequence([rng.randrange(vocab) for _ in range(rng.randint(1, 4))], None, [])
        tokens = seq.token_ids
        copying_from = None  # where the passage being copied goes on, if one is
        for step in range(80):
            if rng.random() < 0.7:  # not every step looks up: the index catches up on several tokens at once
                num_tokens = rng.randint(0, 6)
                want, got = proposer.propose(tokens, num_tokens), proposer.look_up(seq, num_tokens)
                assert got == want, (
                    f"trial {trial}, step {step}: with n from {proposer.max_n} to {proposer.min_n}, look_up proposed "
                    f"{got} after {tokens}, but propose gives {want}: the latest earlier occurrence of the longest "
                    "suffix, never the suffix itself"
                )
            if rng.random() < 0.1:
                copying_from = rng.randrange(len(tokens))
            if copying_from is not None and rng.random() < 0.9:
                tokens.append(tokens[copying_from])
                copying_from += 1
            else:
                tokens.append(rng.randrange(vocab))
        del tokens[rng.randint(1, len(tokens)) :]  # tokens taken away: the index starts over at its next lookup
        assert proposer.look_up(seq, 3) == proposer.propose(tokens, 3), f"trial {trial}: after a cut, at {tokens}"


def test_propose_batch_keeps_each_requests_index_on_the_request():
    proposer = NgramProposer(min_n=1, max_n=3)
    seq = sequence([1, 2, 3, 4], None, [])
    assert proposer.propose_batch(batch_of([seq], [2])) == {0: []} and seq.spec.num_ngram_indexed == 3, (
        "propose_batch indexes the request's runs on its first lookup (seq.spec.ngram_index), even with nothing to "
        "guess"
    )
    index = seq.spec.ngram_index
    seq.token_ids += [9, 2, 3]
    assert proposer.propose_batch(batch_of([seq], [2])) == {0: [4, 9]} and seq.spec.ngram_index is index, (
        "the next lookup extends the same index with the tokens added since: '2 3' was last seen at 1..2"
    )


def batch_of(seqs: list[Sequence], rooms: list[int]) -> ScheduledBatch:
    """A step that computes each request's last token, with these rooms (0: none); no blocks: prompt lookup reads
    none."""
    rooms_by_row = {row: room for row, room in enumerate(rooms) if room}
    return ScheduledBatch(seqs, [1] * len(seqs), [[] for _ in seqs], rooms_by_row)


def sequence(prompt: list[int], max_tokens: int | None, generated: list[int]) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    seq = Sequence("0", None, prompt, params, 0, IncrementalDetokenizer(None, prompt, []))
    seq.token_ids += generated
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec.num_lookahead = 5
    return seq


def test_guesses_never_reach_past_the_requests_last_token():
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert guess_room(sequence(prompt, None, []), max_model_len=100) == 5  # its lookahead
    # Two tokens of max_tokens left: the step samples after its last token and after each guess, so one guess.
    assert guess_room(sequence(prompt, 4, [9, 1]), max_model_len=100) == 1
    assert guess_room(sequence(prompt, 4, [9, 1, 2]), max_model_len=100) == 0
    assert guess_room(sequence(prompt, None, []), max_model_len=12) == 2  # the context's end
    seqs = [sequence(prompt, None, []), sequence(prompt, 4, [9, 1])]
    assert NgramProposer(min_n=1, max_n=2).propose_batch(batch_of(seqs, [5, 1])) == {0: [3, 4, 5, 6, 7], 1: [2]}
    assert NgramProposer(min_n=1, max_n=2).propose_batch(batch_of(seqs, [0, 1])) == {1: [2]}, "a row without room"


def test_no_guess_before_the_prompt_is_done_or_while_the_last_token_is_unknown():
    seq = sequence([1, 2, 3, 1, 2], None, [])
    seq.num_computed_tokens = 2  # a prefill chunk is still to come
    assert guess_room(seq, max_model_len=100) == 0
    seq = sequence([1, 2, 3, 1, 2], None, [-1])  # a future id: the step in flight samples it
    seq.num_pending_tokens = 1
    assert guess_room(seq, max_model_len=100) == 0


def test_a_request_that_stopped_guessing_probes_now_and_then():
    """Lookahead 0 (a draft model's guesses kept failing): one guess every PROBE_INTERVAL tokens, none between."""
    rooms = []
    for generated in range(2 * PROBE_INTERVAL):
        seq = sequence([1, 2, 3], None, list(range(10, 10 + generated)))
        seq.spec.num_lookahead = 0
        rooms.append(guess_room(seq, max_model_len=100))
    assert rooms == [1] + [0] * (PROBE_INTERVAL - 1) + [1] + [0] * (PROBE_INTERVAL - 1)
