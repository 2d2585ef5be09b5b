"""The requests every row serves: built once per run from one seed, so that all rows get the same work.

decode  one prompt of --decode-prompt-len tokens, --decode-tokens forced output tokens.
mixed   --num-requests requests, prompt and output lengths uniform in their ranges, prompts cut from real
        English text at varying offsets. All arrive at once.
shared  as many requests behind one system prompt of --shared-prefix-len tokens, each with its own short
        question: what a prefix cache is for (milestone rows only).
batch   decode at each of --batch-sizes: B requests at once, each its own --decode-prompt-len-token prompt and
        --decode-tokens forced tokens, so every step after the prompts decodes B tokens (milestone rows only).
grounded  chat requests that ask to copy or rewrite a passage they contain: the answer repeats the prompt, what
        m7's prompt lookup guesses well (milestone rows only; --max-num-seqs 1 for batch 1).
open    chat requests with nothing to copy (stories, explanations): where guessing finds little.
        Both end at the answer's end-of-sequence token, as a served chat answer does (every row makes the same
        tokens, so the same work): forced on past it, the model chatters on in turns of its own invention, which
        time something else than the copy or the story.
host    the engine's own work per step: each milestone row on a tiny checkpoint, B requests decoding, for each B of
        --host-batch-sizes (host_rows.py; milestone rows only).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from _common import SAMPLE_TEXT, chat_token_ids, text_token_ids

if TYPE_CHECKING:
    import torch

SMALL_REQUESTS = 64  # the small workload: this many requests of 4-16 prompt and 4-16 output tokens
WORKLOADS = ("decode", "mixed", "shared", "batch", "small", "grounded", "open", "host")
GROUNDED_ASKS = ("Copy the following text exactly, word for word:", "Repeat this text, one sentence per line:",
                 "Rewrite this text in the present tense, changing nothing else:", "Correct any mistakes in this "
                 "text and give it back in full:")
OPEN_ASKS = ("Write a short story about {}.", "Explain how {} works to a child.", "Give three reasons to like {}.",
             "Write a poem about {}.")
TOPICS = ("a lighthouse", "the rain", "a bicycle", "bread", "the moon", "a library", "trains", "a garden")


@dataclass(slots=True)
class Request:
    """One request of a workload: prompt tokens and how many tokens to generate."""

    prompt_ids: list[int]
    max_tokens: int  # forced with ignore_eos: every row generates exactly this many
    ignore_eos: bool = True  # False: the request ends at its end-of-sequence token, as a chat answer does
    temperature: float = 0.0  # above 0: sampled, with ``seed``
    seed: int | None = None


@dataclass(slots=True)
class Workloads:
    """The requests of every workload, each drawn from its own seed."""

    decode_prompt: list[int]
    mixed: list[Request]
    shared: list[Request]
    batch_prompts: list[list[int]]  # as many prompts as the largest of --batch-sizes, all of one length
    small: list[Request] = field(default_factory=list)  # many short requests: host time matters most
    grounded: list[Request] = field(default_factory=list)  # answers that repeat the prompt
    open: list[Request] = field(default_factory=list)  # answers with nothing to copy

    def requests(self, workload: str) -> list[Request]:
        """The requests of a workload served through the engine (every one but decode and batch)."""
        chosen = {"shared": self.shared, "small": self.small, "grounded": self.grounded, "open": self.open}
        return chosen.get(workload, self.mixed)


@dataclass(slots=True)
class Setup:
    """What every row of a run shares, worked out once from the arguments."""

    args: argparse.Namespace
    model_path: Path  # the resolved model folder (args.model stays as given, for the JSON)
    device: torch.device
    dtype: torch.dtype
    workloads: Workloads
    max_model_len: int  # the smallest that fits the selected workloads, unless --max-model-len says otherwise
    kv_bytes_per_token: int  # for --tight-kv: the same KV bytes for every milestone
    weight_bytes_per_token: int  # what batch-1 decode must read per token (hf_rows.weight_bytes_per_token)


def build_workloads(tokenizer, args: argparse.Namespace) -> Workloads:
    return Workloads(
        decode_prompt=text_token_ids(tokenizer, args.decode_prompt_len)[: args.decode_prompt_len],
        mixed=make_mixed_workload(tokenizer, args.num_requests, args.prompt_len_range, args.output_len_range,
                                  args.seed),
        shared=make_shared_workload(tokenizer, args.num_requests, args.shared_prefix_len,
                                    args.shared_output_len_range, args.seed),
        small=make_mixed_workload(tokenizer, SMALL_REQUESTS, (4, 16), (4, 16), args.seed + 3),
        batch_prompts=make_batch_prompts(tokenizer, max(args.batch_sizes), args.decode_prompt_len, args.seed),
        grounded=make_grounded_workload(tokenizer, args.chat_requests, args.seed + 4, args.chat_temperature),
        open=make_open_workload(tokenizer, args.chat_requests, args.seed + 5, args.chat_temperature),
    )


def make_grounded_workload(tokenizer, n: int, seed: int, temperature: float = 0.0) -> list[Request]:
    """Chat requests that hand the model a passage of real text (40 to 80 tokens) and ask for it back, copied or
    lightly edited; each may generate as many tokens as the passage has, and a few more."""
    rng, text = random.Random(seed), tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    requests = []
    for i in range(n):
        length = rng.randint(40, 80)
        start = rng.randrange(0, len(text) - length)
        passage = tokenizer.decode(text[start : start + length]).strip()
        prompt = chat_token_ids(tokenizer, f"{GROUNDED_ASKS[i % len(GROUNDED_ASKS)]}\n\n{passage}")
        requests.append(Request(prompt, length + 8, ignore_eos=False, temperature=temperature, seed=seed * 1000 + i))
    return requests


def make_open_workload(tokenizer, n: int, seed: int, temperature: float = 0.0) -> list[Request]:
    """Chat requests with nothing in them to copy, 48 to 96 output tokens each."""
    rng = random.Random(seed)
    asks = [OPEN_ASKS[i % len(OPEN_ASKS)].format(TOPICS[(i // len(OPEN_ASKS) + i) % len(TOPICS)]) for i in range(n)]
    return [Request(chat_token_ids(tokenizer, ask), rng.randint(48, 96), ignore_eos=False, temperature=temperature,
                    seed=seed * 1000 + i) for i, ask in enumerate(asks)]


def make_mixed_workload(tokenizer, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                        seed: int) -> list[Request]:
    """Seeded requests whose prompts are slices of real text at varying offsets."""
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(n)]
    text = text_token_ids(tokenizer, prompt_range[1] + 256)
    requests = []
    for prompt_len, output_len in lengths:
        start = rng.randrange(0, len(text) - prompt_len + 1)
        requests.append(Request(text[start : start + prompt_len], output_len))
    return requests


def make_shared_workload(tokenizer, n: int, prefix_len: int, output_range: tuple[int, int],
                         seed: int) -> list[Request]:
    """One long system prompt shared by every request, each followed by its own short question."""
    rng = random.Random(seed + 1)
    text = text_token_ids(tokenizer, prefix_len + 512)
    prefix = text[:prefix_len]
    requests = []
    for _ in range(n):
        start, length = rng.randrange(prefix_len, len(text) - 40), rng.randint(8, 32)
        requests.append(Request(prefix + text[start : start + length], rng.randint(*output_range)))
    return requests


def make_batch_prompts(tokenizer, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """n prompts of prompt_len tokens: slices of real text at n distinct seeded offsets."""
    offsets = random.Random(seed + 2).sample(range(4 * n), n)
    text = text_token_ids(tokenizer, prompt_len + 4 * n)
    return [text[start : start + prompt_len] for start in offsets]


def fitting_max_model_len(args: argparse.Namespace, workloads: Workloads) -> int:
    """The longest prompt plus the longest output over the selected workloads."""
    needs = {
        "decode": args.decode_prompt_len + args.decode_tokens,
        "batch": args.decode_prompt_len + args.decode_tokens,
        "mixed": args.prompt_len_range[1] + args.output_len_range[1],
        "small": 16 + 16,
        "host": 16,  # its own engine, on its own tiny checkpoint
        "grounded": max(len(r.prompt_ids) + r.max_tokens for r in workloads.grounded),
        "open": max(len(r.prompt_ids) + r.max_tokens for r in workloads.open),
        "shared": max(len(r.prompt_ids) for r in workloads.shared) + args.shared_output_len_range[1],
    }
    longest = max(needs[workload] for workload in args.workloads)
    return -(-longest // 16) * 16  # whole blocks of 16: a pool sized for max_num_seqs=1 then holds the longest
