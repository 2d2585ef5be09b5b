"""An LLM inference engine built up in milestones; each ``milestones.mK`` is a complete engine.

``CHANGED_FILES`` declares, for every milestone after the first, which files it
changes from the previous one (new files included). Every other file must stay
byte-identical to its predecessor's copy (``tests/test_milestone_diffs.py``
checks it), so ``diff -ru milestones/m1 milestones/m2`` shows exactly the lesson.
Platform speed-ups that are no lesson live in ``milestones.kernels``, shared by all; serving features
that are no lesson (the ``LLM`` front end, ``SamplingParams``, n > 1, structured output, request outputs)
live in ``milestones.serving``; supervision of worker threads and processes in ``milestones.runtime``; and
the plumbing every milestone uses alike beside them (``options``, ``speculative_config``, ``hf_checkpoint``,
``transfer``, ``trace``, ``model_store``).
"""

import os

MILESTONES = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "m9"]

CHANGED_FILES: dict[str, set[str]] = {
    "m1": set(),
    # continuous batching: a scheduler with budgets, a packed forward, one KV slot per request
    "m2": {"__init__.py", "config.py", "scheduler.py", "model_runner.py", "attention.py", "step.py"},
    # paged attention: a block manager, block tables and slot mapping, preemption; what admission holds back (a block
    # of headroom, or SGLang's reservation and retraction)
    "m3": {"__init__.py", "config.py", "scheduler.py", "model_runner.py", "attention.py", "block_manager.py",
           "step.py", "admission.py"},
    # radix prefix cache: a radix tree, reference-counted blocks, match/insert/evict in the scheduler, a request's
    # n samples sharing its prompt; the scheduling policies (fcfs, lpm, dfs-weight, lof, random)
    "m4": {"__init__.py", "config.py", "scheduler.py", "block_manager.py", "radix_tree.py", "engine.py", "sequence.py",
           "policies.py"},
    # the decode step captured per batch size and replayed: static buffers, padding, a fixed-shape decode attention;
    # every step dispatched (whole, in pieces cut at attention, or eagerly with a reason)
    "m5": {"__init__.py", "config.py", "model_runner.py", "graph_runner.py", "attention.py", "engine.py", "step.py",
           "dispatcher.py", "piecewise.py"},
    # overlap scheduling: a forward worker, future ids resolved on the device, the one-step lag, a trace
    "m6": {"__init__.py", "config.py", "model_runner.py", "graph_runner.py", "engine.py", "sampler.py",
           "sequence.py", "scheduler.py", "worker.py", "future_map.py", "step.py", "rollback.py"},
    # speculative decoding: a proposer, guesses checked as a chunk with a sample row each, rejected ones rolled back
    "m7": {"__init__.py", "config.py", "engine.py", "scheduler.py", "sequence.py", "model_runner.py", "step.py",
           "sampler.py", "block_manager.py", "proposer.py", "drafter.py", "rollback.py", "speculation.py"},
    # tensor parallelism: ranks with a shard of every layer, two all-reduces a layer, worker processes, rank 0 samples
    "m8": {"__init__.py", "config.py", "distributed.py", "engine.py", "executor.py", "model.py", "model_runner.py",
           "step.py"},
    # prefill/decode disaggregation: workers in two roles, a prompt's blocks reserved on the decode side before its
    # prefill and sent there after it, a router (cache-aware or round-robin) in front
    "m9": {"__init__.py", "config.py", "engine.py", "scheduler.py", "disaggregation.py", "router.py", "pd_engine.py"},
}

# `make check` runs the tests with a learner's package as milestones.mK ($MILESTONE_IMPL, set by
# milestones/exercise/check.py). A process the tests start imports this package first (m8's ranks, spawned: a fresh
# interpreter), and must run the learner's package too, not the reference.
if os.environ.get("MILESTONE_IMPL"):
    from milestones.exercise.install import install_from_environment

    install_from_environment()
