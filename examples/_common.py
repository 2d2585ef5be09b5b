"""Helpers shared by the example scripts (not part of any milestone).

Importing this module also makes ``milestones`` importable when a script is run
from a checkout that was not installed with ``pip install -e .``: it puts the
repository root on ``sys.path`` if, and only if, the import would fail otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("milestones") is None:  # a plain checkout: use the package next to examples/
    sys.path.insert(0, str(REPO_ROOT))


# Real English prose for benchmark prompts (written for this project; public domain).
# Slices of its tokens at varying offsets give prompts of any wanted length.
SAMPLE_TEXT = """\
The lighthouse keeper rose every morning before the gulls, climbed the hundred and
twelve steps of the tower, and wiped the salt from the great lens with a soft cloth
that his mother had sewn for the purpose forty years before. Nobody had asked him to
keep doing it. The light had been electric for a generation, the shipping lanes had
moved further out to sea, and the harbour below was used mostly by children in small
boats with patched sails. Still, he said, a light that is looked after burns a little
brighter, and a man who looks after something sleeps a little better. In the evenings
he wrote down the weather in a ledger: the direction of the wind, the colour of the
water, the number of ships he had seen, which was usually none, and the number of
stars, which he counted in patches and multiplied, the way his teacher had shown him.

A machine that answers questions works, in the end, much like that keeper's ledger.
It reads what it has been given one word at a time, keeps a careful record of
everything it has read so far, and uses that record to decide what ought to come
next. The record is the expensive part. Each new word must be compared with every
word before it, so a long conversation costs far more than a short one, and a
thousand conversations at once cost more still. Engineers who build such machines
spend most of their days on bookkeeping: where to keep the record, how much room to
set aside for it, when to throw part of it away, and how to share the pages that two
conversations happen to have in common. The arithmetic itself is simple; arranging it
so that nothing waits and nothing is wasted is the whole craft.

In the spring the keeper planted beans along the south wall of the cottage, where the
stones held the warmth of the afternoon, and in the autumn he gave most of them away
to the families in the village, because one man cannot eat a wall of beans, however
much he likes them. The children who sailed in the harbour would sometimes climb the
hill to ask him how the light worked. He would explain the lens, and the way it gathers
a small flame into a beam that can be seen twenty miles away, and then he would tell
them that the real trick was not the lens at all but the patience of turning up every
day, in good weather and bad, to make sure that the beam was there when it was needed.
Most of them nodded politely and asked whether they could see the top of the tower.
He always said yes.
"""

DEFAULT_CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a cat watching the rain.",
    "Explain in two sentences why the sky is blue.",
]


# The batched demos' prompts (m2-m4): different kinds and lengths of answer, so requests
# finish at different steps and the batch changes shape as they run.
DEMO_PROMPTS = [
    ("fact", "What is the capital of Japan?"),
    ("poem", "Write a four-line poem about the sea."),
    ("arithmetic", "What is 10 divided by 2?"),
    ("explanation", "Explain in two sentences why the sky is blue."),
    ("list", "List five fruits."),
    ("chinese", "用一句话介绍北京。"),  # multi-byte text: the detokenizer must not print half a character
    ("code", "Write a Python function that checks whether a number is even."),
    ("one word", "What is the opposite of hot? Answer with one word."),
]


def chat_token_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """The token ids of ``text`` as a user message in the chat template (what ``LLM.chat`` sends)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(templated, add_special_tokens=False)


def text_token_ids(tokenizer, min_tokens: int) -> list[int]:
    """The tokens of SAMPLE_TEXT, repeated as often as needed to hold at least ``min_tokens``."""
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    return ids * max(1, -(-min_tokens // len(ids)))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default in --help, unless its help text already explains it (or it has none)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_bytes(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def busy_cores(interval: float = 0.25) -> tuple[float, int] | None:
    """(cores busy right now, cores in all), from /proc/stat over ``interval`` seconds; None where it cannot tell.

    Called while this process sleeps, so the busy cores are other processes' work.
    """
    def sample() -> tuple[list[int], int]:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        ticks = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        return ticks, sum(line.startswith("cpu") and line[3:4].isdigit() for line in lines)

    try:
        t0, ncpu = sample()
        time.sleep(interval)
        t1, _ = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = sum(t1) - sum(t0)
    if total <= 0 or ncpu < 1:
        return None
    idle = (t1[3] + t1[4]) - (t0[3] + t0[4])
    return ncpu * (1 - idle / total), ncpu


_picked_threads: tuple[int, str] | None = None


def pick_threads(requested: int | None) -> tuple[int, str]:
    """Set torch's CPU threads: ``requested``, or by default one per core that is idle right now.

    PyTorch starts one thread per core; when another process already keeps a core busy,
    its threads wait for each other at every operation and a small model runs several
    times slower than with fewer threads. Returns the count and a note saying why; the
    first call decides for the whole process, later calls return the same answer.
    """
    global _picked_threads
    if _picked_threads is None:
        _picked_threads = _pick_threads(requested)
    return _picked_threads


def _pick_threads(requested: int | None) -> tuple[int, str]:
    import torch

    if requested:
        torch.set_num_threads(requested)
        return requested, "set by --threads"
    default = torch.get_num_threads()
    busy = busy_cores()
    if busy is None:
        return default, "torch's default"
    load, ncpu = busy
    idle = max(1, round(ncpu - load))
    if idle >= default:
        return default, "torch's default"
    torch.set_num_threads(idle)
    return idle, f"other processes keep ~{load:.1f} of {ncpu} cores busy; --threads N to choose"


class EngineWatch:
    """Watch an engine while ``LLM.generate`` drives it: the largest batch of any step, KV usage extremes, preemptions.

    It wraps ``engine.scheduler.schedule`` (to see each step's batch) and ``engine.step``,
    reading ``engine.kv_usage()`` after each; the engines themselves are not changed.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps = 0  # forward passes while watched (engine.num_steps counts them from the start)
        self.max_batch = 0
        self.high: dict[str, float] = {}  # the largest value of each kv_usage() entry seen
        self.low: dict[str, float] = {}  # and the smallest
        # (step, counting from 1; request id): sent from running back to waiting
        self.preempted: list[tuple[int, str]] = []
        scheduler = engine.scheduler
        schedule, step, steps0 = scheduler.schedule, engine.step, engine.num_steps

        def watched_schedule():
            running = {seq.request_id for seq in scheduler.running}
            batch = schedule()
            self.preempted += [(engine.num_steps + 1, seq.request_id)
                               for seq in scheduler.waiting if seq.request_id in running]
            if batch is not None:
                self.max_batch = max(self.max_batch, len(batch.seqs))
                self._sample()  # blocks are at their fullest just after scheduling
            return batch

        def watched_step():
            outputs = step()
            self.steps = engine.num_steps - steps0
            self._sample()  # tokens computed are at their most just after the forward pass
            return outputs

        engine.scheduler.schedule = watched_schedule
        engine.step = watched_step

    def _sample(self) -> None:
        for key, value in self.engine.kv_usage().items():
            self.high[key] = max(self.high.get(key, value), value)
            self.low[key] = min(self.low.get(key, value), value)
