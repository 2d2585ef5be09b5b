"""A worker that dies fails only the requests it held, with its name, within seconds; the others go on; with no
worker of a role left, every new request is refused at once; nothing outlives the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from milestones import m9
from milestones.m9 import disaggregation
from milestones.m9.config import EngineConfig
from milestones.m9.scheduler import Scheduler
from milestones.m9.sequence import Sequence
from milestones.serving.outputs import RequestMetrics
from tests.chain import LIMITS

PARAMS = m9.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def decode_worker_of(llm, request_id: str) -> int:
    return llm.engine.requests[request_id].decode


def test_a_dead_decode_worker_fails_its_requests_and_the_other_serves(tiny_model_path):
    with m9.LLM(tiny_model_path, **LIMITS, num_prefill_workers=1, num_decode_workers=2, enforce_eager=True) as llm:
        engine = llm.engine
        first, second = (engine.add_request([5 + i, 6, 7, 8], PARAMS) for i in range(2))
        assert {decode_worker_of(llm, first), decode_worker_of(llm, second)} == {0, 1}, "one on each"
        while not any(len(o.outputs[0].token_ids) > 2 for o in engine.step() if o.request_id == first):
            pass
        doomed = decode_worker_of(llm, first)
        process = engine.workers.processes[engine.num_prefill + doomed]
        os.kill(process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"decode worker {doomed} has exited \(code -9\).*'{first}'"):
            while time.monotonic() - start < 30:
                engine.step()
        assert time.monotonic() - start < 10, "named within seconds"
        assert first not in engine.requests and second in engine.requests
        late = engine.add_request([9, 9, 9], m9.SamplingParams(temperature=0, max_tokens=4))
        assert decode_worker_of(llm, late) == 1 - doomed, "new requests go to the worker that is left"
        done = {}
        while len(done) < 2:
            done |= {o.request_id: o for o in engine.step() if o.finished}
        assert set(done) == {second, late} and len(done[late].outputs[0].token_ids) == 4
        engine.check_integrity()  # the live workers' books

        os.kill(engine.workers.processes[engine.num_prefill + 1 - doomed].pid, signal.SIGKILL)
        engine.add_request([1, 2, 3], PARAMS)  # sent before anyone knows: fails with the worker
        with pytest.raises(RuntimeError, match="has exited"):
            while True:
                engine.step()
        with pytest.raises(RuntimeError, match="no worker of a role is left"):
            engine.add_request([1, 2, 3], PARAMS)
        processes = list(engine.workers.processes)
    assert not any(p.is_alive() for p in processes), "close() leaves no worker running"


SCRIPT = """
import sys, time
from milestones import m9
if __name__ == "__main__":
    llm = m9.LLM(sys.argv[1], device="cpu", max_model_len=128, num_prefill_workers=1, num_decode_workers=1,
                 enforce_eager=True)
    print(*[p.pid for p in llm.engine.workers.processes], flush=True)
    time.sleep(600)
"""


def test_no_worker_outlives_a_killed_router(tiny_model_path, tmp_path):
    """The router's process is killed (SIGKILL: no clean-up runs): each worker watches its parent and ends."""
    from tests.m8.test_faults import alive, wait_until_gone

    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(tiny_model_path)], stdout=subprocess.PIPE, text=True,
                               cwd=os.getcwd(), env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        pids = [int(pid) for pid in process.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        process.kill()
        process.wait(timeout=60)
        assert not wait_until_gone(pids, 10), "a worker outlived the router's process"
    finally:
        process.kill()


def test_a_transfer_that_stalls_fails_its_request_with_a_clear_error(monkeypatch):
    """The decode side's transfer queue, torch-free of any model: a receive that never completes fails its request
    after TRANSFER_TIMEOUT, its reserved blocks go back, and the failure says why."""
    monkeypatch.setattr(disaggregation, "TRANSFER_TIMEOUT", 0.05)
    config = EngineConfig(device="cpu", num_kv_blocks=8, block_size=4, max_model_len=64).resolve(64)
    scheduler = Scheduler(config)
    engine = SimpleNamespace(scheduler=scheduler, lock=threading.RLock())
    stalled = disaggregation.PendingTransfer(torch.empty(0), torch.empty(0))  # never finished
    transfer = SimpleNamespace(receive=lambda peer, tag, num_blocks: stalled)
    outbox = disaggregation.Outputs()
    side = disaggregation.DecodeSide(engine, transfer, outbox)
    seq = Sequence("r", None, [1, 2, 3, 4, 5], m9.SamplingParams(max_tokens=4), 0, detokenizer=None)
    side.prealloc.append(disaggregation.Binding(seq, peer=0, tag=1))
    side.advance()
    assert side.notices == [disaggregation.Reserved("r", [0, 1])] and scheduler.reserved
    scheduler.check_integrity()
    side.prefilled(disaggregation.Prefilled("r", 7, [], [], 0, RequestMetrics(), time.perf_counter()))
    time.sleep(0.1)
    side.advance()
    assert [f.request_id for f in outbox.failures] == ["r"] and "did not arrive within" in outbox.failures[0].error
    assert not scheduler.reserved and scheduler.block_manager.num_free_blocks == 8
    scheduler.check_integrity()


def test_what_a_disaggregated_engine_cannot_run_is_refused_before_any_worker_starts(tiny_model_path):
    for options, message in [(dict(num_decode_workers=0), "needs at least one of each"),
                             (dict(tensor_parallel_size=2), "one process each"),
                             (dict(speculative_config={"method": "draft_model", "model": str(tiny_model_path),
                                                       "num_speculative_tokens": 2}), "draft model"),
                             (dict(trace_file="t.json"), "trace_file=None"),
                             (dict(router_policy="random"), "router_policy")]:
        options = dict(num_prefill_workers=1, num_decode_workers=1) | options
        with pytest.raises(ValueError, match=message):
            m9.LLM(tiny_model_path, device="cpu", max_model_len=64, **options)
