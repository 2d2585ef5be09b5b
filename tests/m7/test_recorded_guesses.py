"""The recorder (milestones/recorder.py) in m7: each step's record holds the guesses its batch checks."""

from __future__ import annotations

import json

from milestones import m7

from .conftest import SMALL_VOCAB


def test_each_record_holds_the_guesses_its_step_checks(small_vocab_model_path, tmp_path):
    """A small vocabulary makes the model repeat itself, so prompt lookup guesses; the proposer adds them after the
    schedule, and the record, made when the batch reaches the runner, holds as many as the engine counts, and each
    checking entry how many its step kept, as many in all as the engine accepted."""
    file = tmp_path / "m7.json"
    prompts = [[(7 * i + j) % SMALL_VOCAB for j in range(12)] for i in range(4)]
    with m7.LLM(small_vocab_model_path, device="cpu", max_model_len=128, enforce_eager=True, max_num_seqs=3,
                max_num_batched_tokens=32, record_file=str(file),
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}) as llm:
        llm.generate(prompts, m7.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.spec_stats()
    steps = json.loads(file.read_text())["steps"]
    guesses = sum(entry[3] for step in steps for entry in step["batch"])
    assert guesses > 0 and guesses == stats["num_draft_tokens"], (guesses, stats)
    assert all(entry[2] >= 1 + entry[3] for step in steps for entry in step["batch"]), "a guess is a new token"
    kept = [entry[4] for step in steps for entry in step["batch"] if entry[3]]
    assert len(kept) == sum(1 for step in steps for entry in step["batch"] if entry[3]), "every check's outcome"
    assert sum(kept) == stats["num_accepted_tokens"] and all(0 <= k <= 3 for k in kept), (kept, stats)
