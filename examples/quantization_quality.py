"""How far quantized weights move the bundled model: ours (gguf, int8) and llama.cpp's (Q4_1, Q8_0) against float32.

On the lm-eval example tasks (examples/lm_eval: 20 capitals, four choices each, and 20 sums), every prompt and
continuation is scored token by token, as lm-eval's loglikelihood requests do. For each engine:

* top-1 agreement: at how many scored positions its likeliest next token is float32's;
* log-likelihood shift: the mean |change| of a continuation's summed log-probability from float32's;
* accuracy on the capitals (the choice with the highest log-likelihood).

float32 is m1 on the float32 weights (transformers' de-quantization of the bundled file). ``gguf`` multiplies by
those very weights, summing a block as ``d * (x . q) + m * sum(x)``, so it agrees within float32's rounding; int8
is made from the float32 weights at load time; llama.cpp's Q8_0 is made from them too (examples/bench), and its
Q4_1 is the bundled file itself, run with llama.cpp's own arithmetic (which quantizes the activations to 8 bits).
llama.cpp's rows need llama-cpp-python (``pip install -e ".[llama-cpp]"``).

    python examples/quantization_quality.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TASKS = Path(__file__).with_name("lm_eval")


def requests(tokenizer) -> list[tuple[list[int], list[int], str, bool]]:
    """(context ids, continuation ids, task, is the right answer) for every loglikelihood request of both tasks."""
    found = []
    for line in (TASKS / "capitals.jsonl").read_text().splitlines():
        doc = json.loads(line)
        for i, choice in enumerate(doc["choices"]):
            found.append((tokenizer.encode(doc["question"]), tokenizer.encode(choice), "capitals", i == doc["answer"]))
    for line in (TASKS / "sums.jsonl").read_text().splitlines():
        doc = json.loads(line)
        found.append((tokenizer.encode(doc["question"]), tokenizer.encode(" " + str(doc["answer"])), "sums", True))
    return found


def ours(quantization: str | None, reqs) -> list[tuple[list[float], list[int]]]:
    """Each request's continuation log-probabilities and the likeliest token at each of its positions (m1)."""
    from milestones.m1 import LLM, SamplingParams

    llm = LLM(quantization=quantization)
    prompts = [context + continuation for context, continuation, _, _ in reqs]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    scored = []
    for (context, continuation, _, _), out in zip(reqs, outs):
        rows = out.prompt_logprobs[len(context):]  # the continuation's tokens, each given the tokens before it
        logprobs = [row[token].logprob for row, token in zip(rows, continuation)]
        top = [next(t for t, lp in row.items() if lp.rank == 1) for row in rows]
        scored.append((logprobs, top))
    return scored


def llama_cpp(path: Path, reqs) -> list[tuple[list[float], list[int]]]:
    """The same from llama.cpp: every position's logits of one evaluation of the prompt and continuation."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
    scored = []
    for context, continuation, _, _ in reqs:
        llm.reset()
        llm.eval(context + continuation)
        logits = np.array(llm.scores[len(context) - 1 : len(context) + len(continuation) - 1], dtype=np.float64)
        logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        scored.append(([float(logprobs[i, t]) for i, t in enumerate(continuation)], logprobs.argmax(1).tolist()))
    return scored


def summary(name: str, scored, reference, reqs) -> str:
    agree = total = 0
    shifts, correct = [], 0
    for (logprobs, top), (ref_logprobs, ref_top) in zip(scored, reference):
        agree += sum(a == b for a, b in zip(top, ref_top))
        total += len(top)
        shifts.append(abs(sum(logprobs) - sum(ref_logprobs)))
    for i in range(0, sum(task == "capitals" for _, _, task, _ in reqs), 4):
        choices = [sum(scored[i + j][0]) for j in range(4)]
        correct += reqs[i + choices.index(max(choices))][3]
    return (f"{name:<16} {100 * agree / total:6.1f}%   {np.mean(shifts):10.2e}   {np.max(shifts):10.2e}   "
            f"{correct:>2}/20")


def main() -> None:
    from transformers import AutoTokenizer

    from milestones.model_store import bundled_gguf_path, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    reqs = requests(tokenizer)
    reference = ours(None, reqs)
    rows = [("m1 float32", reference), ("m1@gguf", ours("gguf", reqs)), ("m1@int8", ours("int8", reqs))]
    try:
        from bench.llama_cpp_rows import gguf_for

        rows += [("llama.cpp Q4_1", llama_cpp(bundled_gguf_path(), reqs)),
                 ("llama.cpp Q8_0", llama_cpp(gguf_for("q8_0"), reqs))]
    except ImportError as error:
        print(f"(llama.cpp rows skipped: {error})")
    positions = sum(len(c) for _, c, _, _ in reqs)
    longest = max(len(c) for _, c, _, _ in reqs)
    print(f"{len(reqs)} loglikelihood requests, {positions} scored tokens (the longest continuation {longest}); "
          "against m1 float32:")
    print(f"{'engine':<16} {'top-1':>7}   {'mean |dLL|':>10}   {'max |dLL|':>10}   capitals")
    for name, scored in rows:
        print(summary(name, scored, reference, reqs))


if __name__ == "__main__":
    main()
