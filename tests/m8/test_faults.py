"""m8's refusals and faults: a tensor_parallel_size that cannot run is refused before any process starts; a worker
that dies or hangs fails the step within seconds, never a wait without end; no worker outlives its engine, however
the engine ends (close, the context manager, the interpreter's exit, a killed parent)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from milestones import m8
from milestones.m8 import distributed
from milestones.runtime import processes

OPTIONS = dict(device="cpu", max_model_len=128, max_num_seqs=4)
GREEDY = m8.SamplingParams(temperature=0, max_tokens=8)


def alive(pid: int) -> bool:
    """Is ``pid`` a running process (not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (running := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


@pytest.mark.parametrize("size, message", [(3, "does not divide the model's 4 attention heads"),
                                           (0, "tensor_parallel_size must be a positive integer")])
def test_a_size_the_model_cannot_split_is_refused_before_any_process_starts(tiny_model_path, size, message):
    with pytest.raises(ValueError, match=message):
        m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=size)
    assert not multiprocessing.active_children()


def test_a_missing_backend_is_refused(tiny_model_path, monkeypatch):
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    with pytest.raises(ValueError, match="needs torch.distributed with gloo"):
        m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_is_named_at_once(tiny_model_path):
    llm = m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2)
    before = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(before) == 8
    worker = llm.engine.workers.processes[0]
    worker.kill()
    worker.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 has exited"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    llm.close()
    assert not multiprocessing.active_children()


def test_a_worker_that_hangs_fails_the_step_after_the_timeout(tiny_model_path, monkeypatch):
    monkeypatch.setattr(distributed, "COLLECTIVE_TIMEOUT", timedelta(seconds=3))  # rank 0's groups, made below
    monkeypatch.setattr(processes, "STOP_TIMEOUT", 1.0)
    llm = m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2)
    worker = llm.engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        llm.close()  # the stopped worker does not answer: it is killed
    assert not worker.is_alive() and not multiprocessing.active_children()


def test_two_engines_at_once_each_find_a_free_port(tiny_model_path, monkeypatch):
    """Rank 0's store takes a port the system gives it: a busy MASTER_PORT (torchrun's variable, read only under
    torchrun) and another engine's port are never in the way."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
    with busy, m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2) as first:
        with m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2) as second:
            texts = [llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].text
                     for llm in (first, second)]
            assert texts[0] == texts[1]
            assert len(multiprocessing.active_children()) == 2
    assert not multiprocessing.active_children()


SCRIPT = """
import os, sys, time
from milestones import m8
if __name__ == "__main__":
    llm = m8.LLM(sys.argv[1], device="cpu", max_model_len=128, tensor_parallel_size=2)
    print(" ".join(str(p.pid) for p in llm.engine.workers.processes), flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["exit", "killed"])
def test_no_worker_outlives_its_process(tiny_model_path, tmp_path, ending):
    """The interpreter exits without close(), or the process is killed (SIGKILL: no clean-up runs): the workers end
    all the same (multiprocessing ends daemon children at exit; a worker watches its parent)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(SCRIPT))
    process = subprocess.Popen([sys.executable, str(script), str(tiny_model_path),
                                "sleep" if ending == "killed" else "exit"], stdout=subprocess.PIPE, text=True,
                               cwd=os.getcwd(), env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        pids = [int(pid) for pid in process.stdout.readline().split()]
        assert len(pids) == 1 and alive(pids[0])
        if ending == "killed":
            process.kill()
        process.wait(timeout=60)
        assert not wait_until_gone(pids, 10), "a worker outlived its engine's process"
    finally:
        process.kill()


def test_a_step_that_fails_on_rank_0_stops_every_rank(tiny_model_path):
    """Rank 0 raises after it sent the step (here in its sampler): the other ranks have computed it, and wait in a
    collective rank 0 will not call. The engine stops them and says so; it takes no more steps, and no process
    is left."""
    llm = m8.LLM(tiny_model_path, **OPTIONS, tensor_parallel_size=2)
    workers = list(llm.engine.workers.processes)

    def fails(*args, **kwargs):
        raise ValueError("injected failure in rank 0's sampler")

    llm.engine.runner.sampler = type("Failing", (), {"__call__": fails})()
    stopped = "a tensor-parallel step failed, so every tensor-parallel rank was stopped.*injected"
    with pytest.raises(RuntimeError, match=stopped):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert not any(worker.is_alive() for worker in workers)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    llm.close()
    assert not multiprocessing.active_children()
