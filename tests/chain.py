"""The correctness chain's tools: a mixed workload, a checked run of it, and a comparison that says what diverged.

``run`` drives ``LLM.generate`` with the engine's integrity check after every step, a
check of every batch as it is scheduled, and a cap on the number of steps, so a
bookkeeping bug fails at the step that made it (a leaked block, a lost lock, a request
scheduled in the step that preempted it) and a scheduler that stops making progress
fails with a message instead of hanging. ``assert_same_outputs`` names the first request
and token where two runs differ.
"""

from __future__ import annotations

import random
from typing import NamedTuple

# The formats of the workload's structured requests, as StructuredOutputsParams' arguments (``run`` builds them).
STRUCTURED = (
    {"regex": "[0-9]{3}-[0-9]{4}"},
    {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}},
    {"choice": ["red", "green", "blue sky"]},
)


def mixed_workload(num_requests: int, seed: int, max_prompt: int, max_output: int):
    """Prompts of varied lengths (real token ids drawn from the vocabulary) and a mix of sampling settings."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append([rng.randrange(3, 49152) for _ in range(rng.randint(1, max_prompt))])
        kind = i % 4
        settings = dict(max_tokens=rng.randint(1, max_output), seed=1000 + i, ignore_eos=i % 5 != 0)
        if kind == 0:
            settings.update(temperature=0)
        elif kind == 1:
            settings.update(temperature=0.8)
        elif kind == 2:
            settings.update(temperature=1.0, top_p=0.9)
        else:
            settings.update(temperature=0.7, top_k=40)
        # Penalties, on sampled and greedy requests alike (i % 4 is 2 or 0). The tiny random model never repeats
        # itself, so they pull it towards what it has seen (below 1), and then count every repeat.
        if i % 6 == 2:
            settings.update(repetition_penalty=0.1)
        elif i % 6 == 5:
            settings.update(repetition_penalty=0.1, presence_penalty=-1.0, frequency_penalty=2.0)
        if i % 3 == 1:  # log-probabilities: 0 (the chosen token's alone) to 6 of the likeliest
            settings.update(logprobs=i % 7)
        if i % 5 == 3:  # and of every prompt token: such a request takes nothing from the prefix cache (m4 on)
            settings.update(prompt_logprobs=i % 4)
        if i % 7 == 4:  # several samples of the prompt: a request each (m4 on, sharing the prompt's blocks)
            settings.update(n=2 + i % 2)
        if i % 9 == 7:  # a structured output (its grammar masks the logits; it ends with EOS, never ignored)
            settings.update(structured_outputs=STRUCTURED[(i // 9) % len(STRUCTURED)], ignore_eos=False)
        params.append(settings)
    return prompts, params


class Completion(NamedTuple):
    """What the chain compares of one request: its tokens, why it stopped, its text, its log-probabilities."""

    token_ids: list[int]
    finish_reason: str
    text: str
    logprobs: list[dict] | None = None  # {token id: Logprob} per output token, if the request asked
    prompt_logprobs: list[dict | None] | None = None  # and per prompt token (None for the first), if it asked
    samples: tuple[Completion, ...] = ()  # with n > 1: every sample's completion, in order (the first is the above)


# Log-probabilities come from logits that another batch shape sums in another order: equal to this much, not exactly
# (on a CPU; the CUDA tests pass their own, for cuBLAS's kernels chosen by row count).
LOGPROB_ATOL = 1e-4
# Ranks are equal in the top 20 (what a client sees of the likeliest). Beyond them, tens of thousands of tokens share a
# few nats, so the same rounding can move a prompt's unlikely token past a neighbour: a rank of 30416 may read 30417.
TOP_RANKS, TAIL_RANK_RTOL = 20, 1e-3


# The batching limits of the chain's tiny-model comparisons: five requests a step, chunks of 24 tokens.
LIMITS = dict(device="cpu", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24)


def stop_rules_from(reference: list[Completion], settings: list[dict], otherwise=lambda i, s: s) -> list[dict]:
    """Stop rules taken from the middle of what each request generated in ``reference``: a stop token for one request
    in three, a stop string for the next; the others get ``otherwise(i, settings[i])``."""
    stopped = []
    for i, (tokens, _, text, *_) in enumerate(reference):
        if i % 3 == 1:
            stopped.append(dict(settings[i], stop_token_ids=[tokens[len(tokens) // 2]]))
        elif i % 3 == 2 and len(text) > 4:
            stopped.append(dict(settings[i], stop=[text[len(text) // 2 : len(text) // 2 + 2]]))
        else:
            stopped.append(otherwise(i, settings[i]))
    return stopped


def stepped(engine, params, prompts, settings, tolerated: tuple[type[BaseException], ...] = ()) -> StepRun:
    """The requests run by hand, step by step (m6 on: until the step in flight is processed too), every invariant of
    the engine checked after every step. A ``tolerated`` exception a step raises is counted, and stepping goes on."""
    ids = [engine.add_request(p, params(**s)) for p, s in zip(prompts, settings)]
    finished, failures = {}, 0
    while engine.has_unfinished_requests() or getattr(engine, "pending", None):
        try:
            outputs = engine.step()
        except tolerated:
            failures, outputs = failures + 1, []
        for out in outputs:
            assert all(t >= 0 for t in out.outputs[0].token_ids), "a future id reached the caller"
            if out.finished:
                assert out.request_id not in finished, f"request {out.request_id} finished twice"
                finished[out.request_id] = out
        engine.check_integrity()
    return StepRun(completions([finished[i] for i in ids]), failures)


class StepRun(NamedTuple):
    """What ``stepped`` saw: each request's completion, and how many steps raised a tolerated exception."""

    completions: list[Completion]
    failures: int


def run(mod, llm, prompts, settings) -> list[Completion]:
    """Generate the workload with ``llm``, checking the engine's integrity after every step."""
    engine = llm.engine
    # Every step computes at least one token of some request, so a working engine needs fewer steps than this.
    longest = engine.config.max_model_len
    max_steps = 10 * sum(len(p) + (s.get("max_tokens") or longest) for p, s in zip(prompts, settings))
    step, num_steps, own_step = engine.step, 0, "step" in vars(engine)  # a test may have wrapped it already

    def checked_step():
        nonlocal num_steps
        outputs = step()
        num_steps += 1
        engine.check_integrity()  # an AssertionError here names the invariant this step broke
        assert num_steps <= max_steps, (
            f"{num_steps} steps and requests are still unfinished: the scheduler has stopped making progress "
            "(are blocks or slots returned when a request finishes? can a waiting request be admitted?)"
        )
        return outputs

    scheduler = engine.scheduler
    schedule, own_schedule = scheduler.schedule, "schedule" in vars(scheduler)

    def checked_schedule():
        batch = schedule()
        for seq in batch.seqs if batch is not None else ():
            waiting = any(s is seq for s in scheduler.waiting)
            assert seq.status.value == "running" and not waiting, (
                f"request {seq.request_id!r} is in this step's batch but is {seq.status.value}"
                f"{' and in the waiting queue' if waiting else ''}: a scheduled request is running (admitted: status "
                "RUNNING, out of the waiting queue) for the whole step, so a request preempted in a step is never "
                "scheduled in it (the victim comes from the requests not yet scheduled; one that preempts itself "
                "is left out of the step)"
            )
        return batch

    engine.step = checked_step  # generate calls it through the instance, so every step is checked
    scheduler.schedule = checked_schedule  # and the engine calls this one, so every batch is
    try:
        outs = llm.generate(prompts, [mod.SamplingParams(**s) for s in settings], use_tqdm=False)
    finally:
        if own_step:
            engine.step = step
        else:
            del engine.step
        if own_schedule:
            scheduler.schedule = schedule
        else:
            del scheduler.schedule
    return completions(outs)


def completions(outs) -> list[Completion]:
    """What the chain compares of each request's output."""
    def completion(out, sample: int) -> Completion:
        c, prompt_logprobs = out.outputs[sample], out.prompt_logprobs if sample == 0 else None
        return Completion(c.token_ids, c.finish_reason, c.text, c.logprobs, prompt_logprobs)

    return [completion(o, 0)._replace(samples=tuple(completion(o, s) for s in range(len(o.outputs))))
            if len(o.outputs) > 1 else completion(o, 0) for o in outs]


def assert_same_outputs(ours: list[Completion], reference: list[Completion], settings=None, what="request",
                        atol: float = LOGPROB_ATOL) -> None:
    """Fail with the first request that differs: at which token, what the reference gave and what we gave; their
    log-probabilities within ``atol``."""
    assert len(ours) == len(reference), f"{len(ours)} outputs for {len(reference)} {what}s"
    for index, (got, want) in enumerate(zip(ours, reference)):
        got, want = Completion(*got), Completion(*want)
        where = f"{what} {index}" + (f" (sampling {settings[index]})" if settings is not None else "")
        if got[:3] == want[:3]:
            assert_same_logprobs(got.logprobs, want.logprobs, where, atol=atol)
            assert_same_prompt_logprobs(got.prompt_logprobs, want.prompt_logprobs, where, atol)
            assert_same_outputs(list(got.samples), list(want.samples), what=f"{where}: sample", atol=atol)
            continue
        agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if agree is not None:
            raise AssertionError(f"{where}: output token {agree} differs: the reference gave {want.token_ids[agree]}, "
                                 f"this engine gave {got.token_ids[agree]} (the {agree} tokens before it agree)")
        if len(got.token_ids) != len(want.token_ids):
            raise AssertionError(
                f"{where}: the reference stopped after {len(want.token_ids)} tokens ({want.finish_reason!r}), this "
                f"engine after {len(got.token_ids)} ({got.finish_reason!r}); the tokens both have agree")
        raise AssertionError(f"{where}: same tokens, but the reference gave finish_reason={want.finish_reason!r}, "
                             f"text={want.text!r:.60}; this engine {got.finish_reason!r}, {got.text!r:.60}")


def assert_same_prompt_logprobs(got: list[dict | None] | None, want: list[dict | None] | None, where: str,
                                atol: float = LOGPROB_ATOL) -> None:
    """Both engines scored every prompt token but the first, as ``assert_same_logprobs`` compares them."""
    assert (got is None) == (want is None), f"{where}: prompt log-probabilities given by one engine only"
    if got is not None:
        assert len(got) == len(want) and got[0] is None and want[0] is None, (
            f"{where}: {len(got)} prompt entries, the reference's {len(want)}; each has one per prompt token, None "
            "for the first")
        assert_same_logprobs(got[1:], want[1:], where, "prompt token", first=1, atol=atol)


def assert_same_logprobs(got: list[dict] | None, want: list[dict] | None, where: str,
                         what: str = "output token", first: int = 0, atol: float = LOGPROB_ATOL) -> None:
    """The same tokens with the same ranks, their log-probabilities within ``atol``; the last of the likeliest may
    differ only where it ties, within that tolerance, with the token it displaced."""
    assert (got is None) == (want is None), f"{where}: log-probabilities given by one engine only"
    for position, (ours, theirs) in enumerate(zip(got or [], want or [])):
        at = f"{where}, {what} {first + position}"
        chosen = next(iter(theirs))
        assert next(iter(ours)) == chosen, f"{at}: the chosen token is not the first entry"
        for token in ours.keys() & theirs.keys():
            a, b = ours[token], theirs[token]
            assert abs(a.logprob - b.logprob) <= atol, (
                f"{at}: token {token}'s log-probability is {a.logprob:.6f}, the reference's {b.logprob:.6f}: "
                f"{abs(a.logprob - b.logprob):.2e} apart, more than {atol}")
            in_the_tail = min(a.rank, b.rank) > TOP_RANKS and abs(a.rank - b.rank) <= TAIL_RANK_RTOL * b.rank
            assert a.rank == b.rank or in_the_tail, (
                f"{at}: token {token} ranks {a.rank}, {b.rank} in the reference (beyond the top {TOP_RANKS}, "
                f"{abs(a.rank - b.rank)} apart where {TAIL_RANK_RTOL * b.rank:.1f} is allowed)")
        lowest = min(entry.logprob for entry in theirs.values())
        for token in ours.keys() ^ theirs.keys():
            entry = ours.get(token) or theirs[token]
            assert abs(entry.logprob - lowest) <= atol, (
                f"{at}: token {token} ({entry.logprob:.6f}) is among the likeliest in one engine only, and no tie "
                f"explains it (the reference's last is {lowest:.6f})")
