"""m5's dispatcher on numbers alone, and the piecewise replay's contract with stand-in graphs (no GPU needed).

Which way a step runs is decided from its ``BatchDescriptor`` before anything is computed, so every rule (the
bucket a batch pads to, when a decode step leaves the full graphs for the pieces, each reason for the eager path)
is checked here without a model. ``PiecewiseRunner.run`` is checked with pieces whose graphs are stand-ins that
record what they read and write, as tests/m5/test_padded_inputs.py does for the full graphs.
"""

from __future__ import annotations

import pytest
import torch

from milestones.m5.attention import AttentionContext
from milestones.m5.config import EngineConfig, default_piecewise_sizes
from milestones.m5.dispatcher import BatchDescriptor, Dispatch, GraphDispatcher, GraphMode
from milestones.m5.piecewise import Cut, Pieces, PiecewiseRunner

DECODE, TOKENS = [1, 2, 4, 8], [8, 16, 32, 64, 128]
BOTH = GraphDispatcher(DECODE, TOKENS)
CPU = "a step with prefill on a CPU: no graphs to cut around attention"


def decodes(n: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_reqs=n, uniform_decode=True)


def mixed(tokens: int, reqs: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=tokens, num_reqs=reqs, uniform_decode=False)


@pytest.mark.parametrize("n, padded", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_a_decode_step_that_fits_replays_whole_padded_to_the_smallest_size_that_holds_it(n, padded):
    assert BOTH.dispatch(decodes(n)) == Dispatch(GraphMode.FULL, padded)


@pytest.mark.parametrize("tokens, padded", [(1, 8), (9, 16), (16, 16), (17, 32), (100, 128), (128, 128)])
def test_a_step_with_prefill_replays_in_pieces_padded_to_a_token_count(tokens, padded):
    assert BOTH.dispatch(mixed(tokens, 3)) == Dispatch(GraphMode.PIECEWISE, padded)


def test_a_decode_step_larger_than_every_captured_batch_goes_to_the_pieces():
    assert BOTH.dispatch(decodes(9)) == Dispatch(GraphMode.PIECEWISE, 16)


def test_more_tokens_than_the_largest_piece_run_eagerly_and_say_so():
    dispatch = BOTH.dispatch(mixed(129, 2))
    assert dispatch.mode is GraphMode.NONE and dispatch.size == 129
    assert dispatch.reason == "129 tokens: more than the largest piecewise capture (128)"


def test_without_pieces_a_step_with_prefill_gives_their_reason_and_a_large_decode_step_its_own():
    cpu = GraphDispatcher(DECODE, CPU)
    assert cpu.dispatch(decodes(3)) == Dispatch(GraphMode.FULL, 4)
    assert cpu.dispatch(mixed(40, 3)) == Dispatch(GraphMode.NONE, 40, CPU)
    assert cpu.dispatch(decodes(9)) == Dispatch(GraphMode.NONE, 9, "a decode step of 9 rows (9 requests): more "
                                                                    "than the largest captured batch (8)")


def test_enforce_eager_sends_every_step_eagerly_with_that_reason():
    eager = GraphDispatcher("enforce_eager=True", "enforce_eager=True")
    for batch in (decodes(1), decodes(3), mixed(40, 3)):
        assert eager.dispatch(batch) == Dispatch(GraphMode.NONE, batch.num_tokens, "enforce_eager=True")


def test_the_default_token_counts_end_at_max_num_batched_tokens_and_a_cpu_has_none():
    cuda = torch.device("cuda")
    assert default_piecewise_sizes(cuda, 512) == [8, 16, 32, 64, 128, 256, 512]
    assert default_piecewise_sizes(cuda, 1000) == [8, 16, 32, 64, 128, 256, 512, 768, 1000]
    assert default_piecewise_sizes(cuda, 20) == [8, 16, 20]
    assert default_piecewise_sizes(torch.device("cpu"), 512) == []


@pytest.mark.parametrize("sizes", [[0], [513], "64", [16.5]])
def test_token_counts_outside_the_step_budget_are_refused_with_the_bound(sizes):
    with pytest.raises(ValueError, match=r"piecewise_capture_sizes must be a non-empty list of token counts in "
                                         r"\[1, max_num_batched_tokens=512\], or \[\]"):
        EngineConfig(device="cpu", piecewise_capture_sizes=sizes).resolve(2048)


def test_an_empty_list_turns_the_pieces_off():
    assert EngineConfig(device="cpu", piecewise_capture_sizes=[]).resolve(2048).piecewise_capture_sizes == []


class Graph:
    """A stand-in for one captured piece: replaying it runs ``work`` on the static buffers, and is logged."""

    def __init__(self, log: list[str], name: str, work) -> None:
        self.log, self.name, self.work = log, name, work

    def replay(self) -> None:
        self.log.append(self.name)
        self.work()


class Attention:
    """Records the rows each layer's attention is given; returns 100 * (layer + 1) + q."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.seen = log, []

    def forward(self, q, k, v, layer, ctx):
        self.log.append(f"attention {layer}")
        self.seen.append((layer, q.shape[0], k.shape[0], v.shape[0]))
        return q + 100 * (layer + 1)


def test_a_piecewise_replay_runs_the_pieces_in_order_with_attention_on_the_real_tokens_between():
    log: list[str] = []
    attention = Attention(log)
    runner = PiecewiseRunner(None, attention, [8, 16], torch.device("cpu"))
    size, layers = 8, 2
    q = [torch.full((size, 1, 1), -1.0) for _ in range(layers)]
    cuts = [Cut(q[i], q[i].clone(), q[i].clone(), torch.full((size, 1, 1), -7.0)) for i in range(layers)]
    hidden = torch.zeros(size, 1)

    def piece(i: int):
        def work():
            if i < layers:  # the piece before attention i leaves q = the input ids (as floats) there
                cuts[i].q.copy_(runner.input_ids[:size, None, None].float())
            if i > 0:  # the piece after attention i - 1 reads its output
                hidden.copy_(cuts[i - 1].out[:, 0] + runner.positions[:size, None])
        return work

    runner.pieces[size] = Pieces([Graph(log, f"piece {i}", piece(i)) for i in range(layers + 1)], cuts, hidden)
    runner.input_ids[:] = 99  # what a step before left: the padding rows' tokens
    ids, positions = torch.tensor([3, 4, 5]), torch.tensor([10, 11, 12])
    ctx = AttentionContext([], [], torch.tensor([0, 1, 2]), torch.tensor([0]), [])
    out = runner.run(ids, positions, ctx, size)
    assert log == ["piece 0", "attention 0", "piece 1", "attention 1", "piece 2"], log
    assert attention.seen == [(0, 3, 3, 3), (1, 3, 3, 3)], (
        f"attention saw {attention.seen}: (layer, q rows, k rows, v rows) must be the step's 3 real tokens alone"
    )
    assert out.shape == (3, 1), f"run returned {tuple(out.shape)}: the real tokens' hidden states, [3, 1]"
    assert out[:, 0].tolist() == [203 + 10, 204 + 11, 205 + 12], (
        "the last piece's output for each real token: attention 1 of its id, plus its position"
    )
    assert cuts[1].out[3:, 0, 0].tolist() == [-7.0] * 5, "the padding rows of attention's output are left alone"
    assert runner.num_replays == 1 and runner.num_padded_tokens == 5
