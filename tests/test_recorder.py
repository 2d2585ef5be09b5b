"""The recorder (milestones/recorder.py): each step's record against the engine's own state at that step, and the
whole file against the run's outputs.

At every schedule the test reads the engine itself beside the recorder (the pool's free count, the block tables
rebuilt from the file's changes, the tree's blocks and locks, and its integrity checks), and at the end each
request's new tokens, summed over the steps that ran it, must add up to what it computed: its prompt and its
output, less the last token, plus what preemptions made it compute again.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from milestones import recorder

PROMPTS = [list(range(40, 40 + n)) for n in (9, 23, 5, 17, 30, 12)]
SHARED = list(range(200, 232))  # two blocks of 16: what m4's tree keeps for the second request on


def run_recorded(name: str, path, prompts, tmp_path, settings=None, **options):
    """Generate ``prompts`` (greedy, 12 tokens; or one SamplingParams per request from ``settings``) with the
    recorder on, reading the engine's own state each time a record is made; the file, those states, the outputs
    and the engine."""
    mod = importlib.import_module(f"milestones.{name}")
    file = tmp_path / f"{name}.json"
    if name in ("m5", "m6", "m7", "m8"):
        options["enforce_eager"] = True  # the schedule is what is recorded: no minute of torch.compile for it
    llm = mod.LLM(str(path), device="cpu", max_model_len=128, record_file=str(file), **options)
    engine, seen = llm.engine, []
    runner = engine.runner
    name = "prepare" if hasattr(runner, "prepare") else "execute"
    recorded = getattr(runner, name)

    def checked(batch, *args):  # beside the recorder: the engine's own state when each record is made
        seen.append(engine_state(engine))
        engine.check_integrity()
        return recorded(batch, *args)

    setattr(runner, name, checked)
    params = ([mod.SamplingParams(**s) for s in settings] if settings is not None
              else mod.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    with llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return json.loads(file.read_text()), seen, outputs, engine


def engine_state(engine) -> dict:
    scheduler = engine.scheduler
    state = {"waiting": [seq.request_id for seq in scheduler.waiting]}
    blocks = getattr(scheduler, "block_manager", None)
    if blocks is not None:
        state["free"] = blocks.num_free_blocks
        state["tables"] = {rid: list(table) for rid, table in blocks.block_tables.items()}
    tree = getattr(scheduler, "tree", None)
    if tree is not None:
        state["cached"] = sorted(tree.cached_blocks())
        state["locks"] = sum(1 for node in recorder._nodes(tree.root) if node.lock_ref > 0)
    return state


def check_against_engine(record: dict, seen: list[dict], outputs) -> None:
    assert len(record["steps"]) == len(seen), "a record for every step the engine scheduled, and no other"
    names, tables, tree = record["requests"], {}, None
    for index, (step, state) in enumerate(zip(record["steps"], seen)):
        where = f"step {index}"
        tree = step.get("tree", tree)  # written where it changed: absent, it is the record before's
        assert [names[r] for r in step["waiting"]] == state["waiting"], where
        if "free" in state:
            assert step["free"] == state["free"], where
            for r in step["gone"]:
                del tables[names[r]]
            tables.update({names[int(r)]: t for r, t in step["tables"].items()})
            assert tables == state["tables"], f"{where}: the tables rebuilt from the file's changes"
            held = {b for t in tables.values() for b in t} | {b for node in tree or [] for b in node[2]}
            assert step["free"] + len(held) == record["num_blocks"], f"{where}: free + held = the pool"
        if "cached" in state:
            assert sorted(b for node in tree for b in node[2]) == state["cached"], where
            assert sum(1 for node in tree if node[3] > 0) == state["locks"], where
            parents = {node[0] for node in tree} | {-1}
            assert all(node[1] in parents for node in tree), f"{where}: a node's parent is in the tree"
    end = record["end"]
    assert end["batch"] == [] and end["waiting"] == [], "the run is over: nothing scheduled, nothing waiting"
    if "free" in end:
        assert sorted(end["gone"]) == sorted(record["requests"].index(r) for r in tables), "every table let go"
        cached = {b for node in end.get("tree", []) for b in node[2]}
        assert end["free"] + len(cached) == record["num_blocks"], "after the run a block is free or cached"
    computed: dict[str, int] = {}
    for step in record["steps"]:
        for r, before, new, *_ in step["batch"]:
            computed[names[r]] = before + new
    for out in outputs:
        total = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1  # the last token is never computed
        assert computed[out.request_id] == total, (out.request_id, computed[out.request_id], total)


@pytest.mark.parametrize("name", ["m1", "m2", "m6", "m7"])
def test_each_step_is_recorded_as_the_engine_scheduled_it(name, tiny_model_path, tmp_path):
    options = {"max_num_seqs": 3, "max_num_batched_tokens": 16} if name != "m1" else {}
    record, seen, outputs, _ = run_recorded(name, tiny_model_path, PROMPTS, tmp_path, **options)
    assert record["milestone"] == name and record["version"] == recorder.FORMAT_VERSION
    check_against_engine(record, seen, outputs)
    new_tokens = {entry[2] for step in record["steps"] for entry in step["batch"]}
    assert 1 in new_tokens and max(new_tokens) > 1, "prompts' chunks and decodes, each with its own count"


def test_a_tight_pool_s_preemptions_and_the_tables_are_recorded(tiny_model_path, tmp_path):
    record, seen, outputs, engine = run_recorded("m3", tiny_model_path, PROMPTS, tmp_path, max_num_seqs=4,
                                                 max_num_batched_tokens=32, block_size=4, num_kv_blocks=14)
    check_against_engine(record, seen, outputs)
    assert engine.scheduler.num_preemptions > 0, "the pool is meant to be too small for the four at once"
    assert record["steps"][-1]["preemptions"] == engine.scheduler.num_preemptions
    assert max(s["preemptions"] for s in record["steps"]) > 0
    assert record["num_blocks"] == 14 and record["block_size"] == 4


def test_a_shared_prefix_is_recorded_in_the_tree(tiny_model_path, tmp_path):
    prompts = [SHARED + [300 + i] for i in range(4)]
    record, seen, outputs, engine = run_recorded("m4", tiny_model_path, prompts, tmp_path, max_num_seqs=1)
    check_against_engine(record, seen, outputs)
    hits = [entry[0] for step in record["steps"] for entry in step["batch"] if entry[1] >= len(SHARED)]
    assert hits, "the later requests start past the cached prefix"
    assert any(node[3] > 0 for step in record["steps"] for node in step.get("tree", [])), "a request locks a node"
    assert sum("tree" in step for step in record["steps"]) < len(record["steps"]), "the tree written where it changed"
    assert sum(out.num_cached_tokens for out in outputs) == 3 * len(SHARED)


def test_nothing_is_wrapped_without_a_record_file(tiny_model_path):
    mod = importlib.import_module("milestones.m3")
    llm = mod.LLM(str(tiny_model_path), device="cpu", max_model_len=64)
    assert llm.recorder is None and "execute" not in vars(llm.engine.runner)



SHIPPED = ["m2", "m3", "m4", "m5", "m6", "m7"]
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_recording_is_of_its_milestone_in_this_format_and_small(name):
    """The replay page's recordings (examples/record_run.py, see docs/replay.md): each at most 300 KB, in the format
    the recorder writes now (rerun the example after changing it), and each chapter links its replay."""
    path = DOCS / "assets" / "replay" / f"{name}.json"
    record = json.loads(path.read_text())
    assert record["milestone"] == name and record["version"] == recorder.FORMAT_VERSION, path
    assert set(record["steps"][0]) >= {"batch", "waiting", "preemptions"} and {"end", "spans"} <= set(record)
    assert path.stat().st_size <= 300 * 1024, f"{path}: {path.stat().st_size} bytes"
    for chapter in (f"{name}.md", f"{name}.zh.md"):
        assert f"(replay.md?run={name})" in (DOCS / chapter).read_text(), f"docs/{chapter} links no replay of {name}"


def test_m6_s_spans_with_its_trace_on_show_the_overlap(tiny_model_path, tmp_path):
    """With overlap and the trace on, every record has its schedule, forward and process spans, and some step's
    schedule begins before the forward of the step before it ends: the host planned it while the device computed."""
    record, seen, outputs, _ = run_recorded("m6", tiny_model_path, PROMPTS, tmp_path, max_num_seqs=3,
                                            max_num_batched_tokens=16, async_scheduling=True,
                                            trace_file=str(tmp_path / "trace.json"))
    check_against_engine(record, seen, outputs)
    kinds: dict[int, dict[str, tuple[float, float]]] = {}
    for step, kind, start, ms in record["spans"]:
        kinds.setdefault(step, {})[kind] = (start, start + ms)
    assert sorted(kinds) == list(range(len(record["steps"]))), "spans for every record, and only for them"
    assert all(set(k) == {"schedule", "forward", "process"} for k in kinds.values())
    assert any(kinds[k + 1]["schedule"][0] < kinds[k]["forward"][1] for k in range(len(kinds) - 1)), record["spans"]
    assert run_recorded("m3", tiny_model_path, PROMPTS[:2], tmp_path)[0]["spans"] == [], "no trace, no spans"


@pytest.mark.parametrize("name", ["m3", "m4", "m7"])
def test_the_chain_s_workload_is_recorded_as_the_engine_ran_it(name, tiny_model_path, tmp_path):
    """The chain's mixed workload (sampling settings of every kind, n > 1, prompt log-probabilities, structured
    output, EOS stops) on a pool that preempts: each record against the engine's state at that step."""
    from tests.chain import mixed_workload

    prompts, settings = mixed_workload(10, seed=3, max_prompt=40, max_output=16)
    record, seen, _, engine = run_recorded(name, tiny_model_path, prompts, tmp_path, settings, max_num_seqs=4,
                                           max_num_batched_tokens=32, block_size=4, num_kv_blocks=24)
    check_against_engine(record, seen, [])  # n > 1: the outputs are the parents', not the requests the steps ran
    assert engine.scheduler.num_preemptions > 0 or name != "m3", "the pool is meant to preempt"


def test_a_record_file_that_cannot_be_written_is_refused_before_any_work(tiny_model_path, tmp_path):
    mod = importlib.import_module("milestones.m2")
    with pytest.raises(ValueError, match="does not exist or cannot be written; pick a path in a writable folder"):
        mod.LLM(str(tiny_model_path), device="cpu", max_model_len=64, record_file=str(tmp_path / "no" / "run.json"))
