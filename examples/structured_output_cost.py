"""What a grammar costs per token on this machine: llguidance (the engine's) against xgrammar, when it is installed.

One process, the two libraries interleaved round after round, medians reported (CPUs vary by
up to 50% between runs): the compile of each format, then, token after token of a valid
document, the bitmask of the tokens allowed next and the grammar reading the token. Last,
the same per token through the engine's own serving layer (``LogitsProcessors.apply_grammars`` and
``advance_grammars`` on one row of SmolLM2's 49152 logits), the figure to set against a
decode step. The tokenizer is the bundled model's; no weights are read.

    python examples/structured_output_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoTokenizer

from milestones.model_store import resolve_model
from milestones.serving.logits_processors import LogitsProcessors
from milestones.serving.sampling_params import StructuredOutputsParams
from milestones.serving.structured_output import StructuredOutputManager, grammar_source

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}
FORMATS = {"json_schema": StructuredOutputsParams(json=SCHEMA),
           "json_object": StructuredOutputsParams(json_object=True)}


def llguidance_run(lltokenizer, params: StructuredOutputsParams, token_ids: list[int]) -> tuple[float, list[float]]:
    import llguidance

    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltokenizer, grammar_source(params))
    compile_s, per_token = time.perf_counter() - start, []
    for token in token_ids:
        start = time.perf_counter()
        matcher.compute_bitmask()
        assert matcher.consume_token(token), matcher.get_error()
        per_token.append(time.perf_counter() - start)
    return compile_s, per_token


def xgrammar_run(compiler, params: StructuredOutputsParams, token_ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar

    start = time.perf_counter()
    compiled = compiler.compile_json_schema(params.json, any_whitespace=False) if params.json else \
        compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s, per_token = time.perf_counter() - start, []
    mask = xgrammar.allocate_token_bitmask(1, VOCAB)
    for token in token_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        assert matcher.accept_token(token)
        per_token.append(time.perf_counter() - start)
    return compile_s, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    manager = StructuredOutputManager(tokenizer, VOCAB, {tokenizer.eos_token_id})
    manager.grammar(FORMATS["json_object"])  # builds llguidance's tokenizer once
    libraries = {"llguidance": (llguidance_run, manager.lltokenizer)}
    try:
        import xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        libraries["xgrammar"] = (xgrammar_run, xgrammar.GrammarCompiler(info, cache_enabled=False))
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar): llguidance alone")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    token_ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    for name, params in FORMATS.items():
        results = {library: ([], []) for library in libraries}
        for _ in range(args.rounds):
            for library, (run, state) in libraries.items():
                compile_s, per_token = run(state, params, token_ids)
                results[library][0].append(compile_s)
                results[library][1].append(statistics.median(per_token))
        for library, (compiles, per_token) in results.items():
            print(f"{name:12} {library:10} compile {statistics.median(compiles) * 1e3:6.2f} ms   per token (mask + "
                  f"read) {statistics.median(per_token) * 1e6:6.1f} us   ({len(token_ids)} tokens, medians of "
                  f"{args.rounds} rounds)")
    features, logits = LogitsProcessors(torch.device("cpu")), torch.randn(1, VOCAB)
    row = type("Row", (), {})()
    row.prompt_token_ids, row.grammar = [], manager.grammar(FORMATS["json_schema"])
    per_token = []
    for position, token in enumerate(token_ids):
        row.num_tokens = position
        start = time.perf_counter()
        features.apply_grammars(logits, [row])
        features.advance_grammars([row], torch.tensor([token]))
        per_token.append(time.perf_counter() - start)
    print(f"the engine's grammar mask, json_schema, one row of {VOCAB} logits: "
          f"{statistics.median(per_token) * 1e6:.0f} us per token (mask, -inf, read)")


if __name__ == "__main__":
    main()
