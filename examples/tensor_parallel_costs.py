"""What tensor parallelism costs a step on this machine: decode speed by rank count, the collectives' share, a message.

    python examples/tensor_parallel_costs.py                       # the bundled model: 1 and 3 ranks
    python examples/tensor_parallel_costs.py --model /tmp/tiny --sizes 1,2,4 --out costs.json --trace traces/

For each rank count, in one process run, rows interleaved over --rounds:

1. decode speed: one request past a short prompt decodes --steps tokens (greedy); the median step;
2. where rank 0's step goes: the same steps under torch.profiler, whose gloo collectives (``gloo:all_reduce``,
   ``gloo:all_gather``, ``gloo:broadcast``) are summed against the steps' wall time; ``--trace`` writes the
   profile as a Chrome trace per rank count (open it in Perfetto);
3. a step's message, sent two ways with the same ranks: m8's two gloo broadcasts of the pickled step
   (``TensorParallel.send_step``), and shared memory with an event per worker, as nano-vllm sends it. Each round
   is the message then an all-reduce of one number (so that the next message waits for every rank); the
   all-reduce alone is timed too and taken off.

On a CPU the ranks share the cores, so more ranks are slower here whatever the all-reduce costs: the figures say
by how much, and which part is the ranks' meeting.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import torch
import torch.distributed as dist
from _common import HelpFormatter
from bench.report import machine_info
from torch.profiler import ProfilerActivity, profile

from milestones import m8
from milestones.m8.dispatcher import Dispatch, GraphMode
from milestones.m8.distributed import join
from milestones.m8.step import ModelInputs, ShardStep

COLLECTIVES = ("gloo:all_reduce", "gloo:all_gather", "gloo:broadcast")
MESSAGE_BYTES = 1 << 20  # the shared buffer: a step's pickle is a few KiB


def decode_steps(llm: m8.LLM, steps: int) -> list[float]:
    """Seconds of each decode step of one greedy request (its prefill step left out)."""
    engine = llm.engine
    engine.add_request("The lighthouse keeper rose every morning", m8.SamplingParams(
        temperature=0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def collective_share(llm: m8.LLM, steps: int, trace: Path | None) -> dict[str, float]:
    """Rank 0's time in each collective over ``steps`` decode steps, as a share of their wall time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        decode_steps(llm, steps)
        wall = time.perf_counter() - start
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    totals = {event.key: event.cpu_time_total / 1e6 for event in prof.key_averages() if event.key in COLLECTIVES}
    return {name: totals.get(name, 0.0) / wall for name in COLLECTIVES}


def a_step_message() -> ShardStep:
    """What rank 0 sends for a decode step of 8 requests, 300 tokens into their sequences (eager: several CPU ranks
    capture nothing)."""
    tables = [list(range(i * 20, i * 20 + 19)) for i in range(8)]
    forward = ModelInputs([-1 - i for i in range(8)], [300] * 8, [t[-1] * 16 + 12 for t in tables], sum(tables, []),
                          [], list(range(8)), [], [])
    return ShardStep(forward, Dispatch(GraphMode.NONE, 8, "enforce_eager=True"), [-9 - i for i in range(8)])


def message_worker(rank: int, size: int, port: int, rounds: int, names: list[str], events) -> None:
    """A worker of the message benchmark: receive each message both ways, meet the others after each."""
    torch.set_num_threads(1)
    tp = join(dist.TCPStore("127.0.0.1", port, size, is_master=False), rank, size, torch.device("cpu"))
    memory = shared_memory.SharedMemory(names[0])
    one = torch.zeros(1)
    for _ in range(rounds):
        tp.all_reduce(one)
    for _ in range(rounds):
        tp.receive_step()
        tp.all_reduce(one)
    for _ in range(rounds):
        events[rank - 1].wait()
        events[rank - 1].clear()
        length = int.from_bytes(memory.buf[:4], "little")
        pickle.loads(memory.buf[4 : 4 + length])
        tp.all_reduce(one)
    memory.close()


def message_costs(size: int, rounds: int) -> dict[str, float]:
    """Microseconds a step's message adds, each way, with ``size`` ranks (medians of ``rounds``)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    memory = shared_memory.SharedMemory(create=True, size=MESSAGE_BYTES)
    context = multiprocessing.get_context("spawn")
    events = [context.Event() for _ in range(size - 1)]
    workers = [context.Process(target=message_worker, args=(rank, size, store.port, rounds, [memory.name], events))
               for rank in range(1, size)]
    for worker in workers:
        worker.start()
    tp = join(store, 0, size, torch.device("cpu"))
    step, one = a_step_message(), torch.zeros(1)

    def timed(send) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            send()
            tp.all_reduce(one)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def through_memory() -> None:
        payload = pickle.dumps(step)
        memory.buf[:4] = len(payload).to_bytes(4, "little")
        memory.buf[4 : 4 + len(payload)] = payload
        for event in events:
            event.set()

    meeting = timed(lambda: None)
    broadcast = timed(lambda: tp.send_step(step))
    shared = timed(through_memory)
    for worker in workers:
        worker.join()
    memory.close()
    memory.unlink()
    return {"all_reduce_us": 1e6 * meeting, "gloo_broadcast_us": 1e6 * (broadcast - meeting),
            "shared_memory_us": 1e6 * (shared - meeting), "message_bytes": len(pickle.dumps(step))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", default=None, help="local folder; default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--sizes", default="1,3", help="rank counts, comma-separated (each must divide the heads)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round, and as many profiled")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the rank counts interleaved in each")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--trace", type=Path, default=None, help="a folder for each rank count's Chrome trace")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    threads = torch.get_num_threads()
    machine = machine_info(torch.device("cpu"))  # what the benchmarks page's results table says of the run
    engines = {size: m8.LLM(args.model, device="cpu", tensor_parallel_size=size, enforce_eager=True, max_num_seqs=4)
               for size in sizes}  # each rank count's ranks stay up, so the rounds interleave
    steps: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.rounds):
        for size, llm in engines.items():
            torch.set_num_threads(max(1, threads // size))  # what m8 gives rank 0 when it starts its workers
            steps[size] += decode_steps(llm, args.steps)
    results = {}
    for size, llm in engines.items():
        torch.set_num_threads(max(1, threads // size))
        if args.trace is not None:
            args.trace.mkdir(parents=True, exist_ok=True)
        trace = None if args.trace is None else args.trace / f"tp{size}.json"
        share = collective_share(llm, args.steps, trace)
        llm.close()
        median = statistics.median(steps[size])
        results[size] = {"step_ms": 1e3 * median, "tokens_per_s": 1 / median,
                         "share": {name.removeprefix("gloo:"): round(value, 3) for name, value in share.items()}}
        if size > 1:
            torch.set_num_threads(threads)
            results[size]["message"] = message_costs(size, 200)
        print(f"{size} rank(s): {results[size]}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({
            "created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(["examples/tensor_parallel_costs.py"]
                                                                                 + sys.argv[1:]),
            "machine": machine, "cpu_threads": threads, "model": args.model or "bundled SmolLM2-135M",
            "results": results}, indent=2))


if __name__ == "__main__":
    main()
