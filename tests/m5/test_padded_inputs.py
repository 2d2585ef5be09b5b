"""decode_inputs and GraphRunner.run on the chapter's batch of three in the bucket of four, without a compiler.

A replay reads only the static buffers, so what run writes into them is the whole of its contract. Here the
captured steps are stand-ins that record the buffers they would read, so a padding row that writes to a real
block, a stale table entry or a bucket too large is named at once, not found later as a different token.
"""

from __future__ import annotations

import pytest
import torch

from milestones import m5
from milestones.m5.detokenizer import IncrementalDetokenizer
from milestones.m5.graph_runner import GraphRunner
from milestones.m5.sequence import Sequence
from milestones.m5.step import DecodeInputs, ScheduledBatch

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, SIZES = 16, 11, 6, [1, 2, 4]
SCRATCH = NUM_BLOCKS - 1  # the pool's last block
S = SCRATCH
# The chapter's batch: A, B and C decode at positions 36, 19 and 8 (context lengths 37, 20 and 9).
CHAPTER = DecodeInputs([11, 12, 13], [36, 19, 8], [9 * 16 + 4, 0 * 16 + 3, 5 * 16 + 8], [[7, 2, 9], [4, 0], [5]],
                       [37, 20, 9])


def request(request_id: str, num_tokens: int) -> Sequence:
    """A request of ``num_tokens`` tokens (ids 100, 101, ...), all computed but the last: it decodes."""
    prompt = list(range(100, 100 + num_tokens))
    seq = Sequence(request_id, None, prompt, m5.SamplingParams(max_tokens=4), seed=0,
                   detokenizer=IncrementalDetokenizer(None, prompt, []))
    seq.num_computed_tokens = num_tokens - 1
    return seq


def test_decode_inputs_on_the_chapters_batch(tiny_model_path):
    llm = m5.LLM(tiny_model_path, device="cpu", max_model_len=96, block_size=BLOCK_SIZE, num_kv_blocks=10,
                 enforce_eager=True, attention_backend="torch")
    seqs = [request("A", 37), request("B", 20), request("C", 9)]
    inputs = llm.engine.runner.decode_inputs(ScheduledBatch(seqs, [1, 1, 1], [[7, 2, 9], [4, 0], [5]]))
    assert inputs.token_ids == [seq.token_ids[-1] for seq in seqs], (
        f"token_ids {inputs.token_ids}: each request's token at num_computed_tokens, its last one"
    )
    assert inputs.positions == [36, 19, 8], f"positions {inputs.positions}, expected num_computed_tokens [36, 19, 8]"
    assert inputs.slots == CHAPTER.slots, (
        f"slots {inputs.slots}, the chapter's {CHAPTER.slots}: a token at position p is written at "
        "table[p // block_size] * block_size + p % block_size"
    )
    assert inputs.block_tables == CHAPTER.block_tables, f"block_tables {inputs.block_tables}: each request's own"
    assert inputs.context_lens == [37, 20, 9], (
        f"context_lens {inputs.context_lens}, the chapter's [37, 20, 9]: position + 1, the new token included"
    )


@pytest.fixture
def runner() -> tuple[GraphRunner, list[dict[str, torch.Tensor]]]:
    """A GraphRunner over a pool of 11 blocks of 16 (block 10 is scratch) whose captured steps are stand-ins: each
    records the buffers of its bucket and returns row i filled with i."""
    pool = torch.zeros(1, 1, NUM_BLOCKS, BLOCK_SIZE, 2)
    graph_runner = GraphRunner(None, pool, pool.clone(), None, SIZES, MAX_BLOCKS)
    seen = []

    def replay(size: int) -> torch.Tensor:
        names = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens")
        seen.append({name: getattr(graph_runner, name)[:size].clone() for name in names} | {"size": size})
        return torch.arange(size, dtype=torch.float)[:, None].expand(size, 3)

    graph_runner.replays = {size: (lambda size=size: replay(size)) for size in SIZES}
    return graph_runner, seen


def check_buffers(buffers: dict, want: DecodeInputs, size: int) -> None:
    pad = size - len(want.token_ids)
    tables = [table + [S] * (MAX_BLOCKS - len(table)) for table in want.block_tables] + [[S] * MAX_BLOCKS] * pad
    expected = {
        "input_ids": (want.token_ids + [0] * pad, "token 0"),
        "positions": (want.positions + [0] * pad, "position 0"),
        "slot_mapping": (want.slots + [SCRATCH * BLOCK_SIZE] * pad, f"the scratch slot {SCRATCH * BLOCK_SIZE}"),
        "block_tables": (tables, f"the scratch block {SCRATCH} in every entry (and a real row's entries past its "
                                 "blocks hold it too, never an old number)"),
        "context_lens": (want.context_lens + [1] * pad, "context_len 1"),
    }
    for name, (values, padding) in expected.items():
        got = buffers[name].tolist()
        assert got == values, (
            f"the replay of bucket {size} read {name} = {got}, expected {values}: the real rows' values, then "
            f"{pad} padding row(s) with {padding}; every row of the bucket is written each step"
        )


def test_a_batch_of_three_is_padded_to_the_bucket_of_four_with_scratch_rows(runner):
    graph_runner, seen = runner
    hidden = graph_runner.run(CHAPTER)
    assert [s["size"] for s in seen] == [4], (
        f"a batch of 3 replayed buckets {[s['size'] for s in seen]}: the smallest captured size that holds it, 4"
    )
    check_buffers(seen[0], CHAPTER, 4)
    assert hidden.tolist() == [[0.0] * 3, [1.0] * 3, [2.0] * 3], (
        "run returns the replay's first num_rows rows (the real requests'), not the padding row"
    )
    assert (graph_runner.num_replays, graph_runner.num_padded_rows) == (1, 1), (
        f"num_replays, num_padded_rows = {graph_runner.num_replays}, {graph_runner.num_padded_rows}: one replay, "
        "one padding row (graph_stats reports them)"
    )


def test_a_small_batch_after_a_large_one_leaves_nothing_of_it_in_the_buffers(runner):
    """Four requests with long tables fill every row, then the chapter's three and a batch of one replay."""
    graph_runner, seen = runner
    large = DecodeInputs([1, 2, 3, 4], [90, 91, 92, 93], [1, 2, 3, 4], [[1, 2, 3, 4, 5, 6]] * 4, [91, 92, 93, 94])
    graph_runner.run(large)
    graph_runner.run(CHAPTER)
    check_buffers(seen[1], CHAPTER, 4)
    alone = DecodeInputs([9], [20], [4 * 16 + 4], [[3, 4]], [21])
    graph_runner.run(alone)
    assert seen[2]["size"] == 1, f"a batch of 1 replayed bucket {seen[2]['size']}: the smallest that holds it, 1"
    check_buffers(seen[2], alone, 1)
    graph_runner.run(DecodeInputs([5, 6], [7, 8], [7, 8], [[0], [1]], [8, 9]))
    assert seen[3]["size"] == 2, f"a batch of 2 replayed bucket {seen[3]['size']}: the smallest that holds it, 2"
