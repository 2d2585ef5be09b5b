"""llama.cpp's rows, the yardstick for a CPU: the same weights as a GGUF in F32, BF16, Q4_1 or Q8_0, batch-1 decode.

llama.cpp@f32   (decode) llama.cpp through llama-cpp-python, every matrix in float32.
llama.cpp@bf16  (decode) the same in bfloat16 (norm weights stay float32, as llama.cpp's own converter keeps them).
llama.cpp@q4_1  (decode) the bundled GGUF itself, unconverted: Q4_1 layers, a Q8_0 embedding (the LM head), the
                weights mK@gguf runs.
llama.cpp@q8_0  (decode) every matrix in Q8_0 (norm weights stay float32).

Run only when named in --engines, and only with llama-cpp-python installed
(``pip install -e ".[llama-cpp]"``, which compiles llama.cpp for this CPU: minutes).
The F32, BF16 and Q8_0 GGUFs are written once from the bundled one, de-quantized to the float32 values
the milestones load (``model_store``) then stored in their type, and cached next to the converted model.
"""

from __future__ import annotations

import functools
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .rows import (
    Measurement,
    error_row,
    failed_measurement,
    inter_token_latency,
    measure_each,
    median_of_runs,
    new_row,
)
from .workloads import Setup

if TYPE_CHECKING:
    from llama_cpp import Llama

LLAMA_CPP_ROWS = ("llama.cpp@f32", "llama.cpp@bf16", "llama.cpp@q4_1", "llama.cpp@q8_0")
GGUF_TYPES = {"f32": "F32", "bf16": "BF16", "q4_1": "Q4_1", "q8_0": "Q8_0"}  # row option -> GGMLQuantizationType
BUNDLED = "q4_1"  # the row that runs the bundled file as it is (its embedding is Q8_0): no GGUF written
ROW_DTYPES = {"f32": "float32", "bf16": "bfloat16", "q4_1": "Q4_1", "q8_0": "Q8_0"}  # a row's "dtype" in the JSON
FILE_TYPES = {"F32": "ALL_F32", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}  # a written GGUF's LlamaFileType


def write_gguf(source: Path, target: Path, type_name: str) -> None:
    """Copy ``source``'s metadata and tensors into ``target``, every matrix de-quantized and stored as ``type_name``
    (F32, BF16 or Q8_0; vectors stay F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target.with_suffix(".partial"), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # written by the writer itself, or no longer true
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[type_name]))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim > 1 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)  # shape in bytes
        else:  # vectors (norm weights) stay float32
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target.with_suffix(".partial").rename(target)


def gguf_for(option: str) -> Path:
    """The bundled model as a GGUF of this row's type, written on first use and cached (Q4_1: the bundled file)."""
    from milestones.model_store import DEFAULT_MODEL, bundled_gguf_path, cache_dir

    if option == BUNDLED:
        return bundled_gguf_path()
    target = cache_dir() / f"{DEFAULT_MODEL}.{GGUF_TYPES[option]}.gguf"
    if not target.is_file():
        print(f"    writing {target.name} once (de-quantized from the bundled GGUF) ...", flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(bundled_gguf_path(), target, GGUF_TYPES[option])
    return target


def run_llama_cpp(setup: Setup) -> list[dict]:
    """Each llama.cpp row the command line named, in turn, one model loaded at a time."""
    rows = []
    for engine in setup.args.llama_cpp_rows if "decode" in setup.args.workloads else []:
        rows += measure_each([load_row(engine, setup)])
        gc.collect()  # this row's model (Llama closes itself when collected), before the next loads
    return rows


def load_llama_cpp(setup: Setup) -> list[Measurement]:
    """Each llama.cpp row the command line named, its model loaded: a decode measurement each."""
    if "decode" not in setup.args.workloads:
        return []
    return [load_row(engine, setup) for engine in setup.args.llama_cpp_rows]


def load_row(engine: str, setup: Setup) -> Measurement:
    """The row's GGUF loaded into llama.cpp, with the milestones' threads (a row that cannot load: its error row)."""
    import torch

    try:
        from llama_cpp import Llama

        if setup.args.model is not None or setup.device.type != "cpu":
            raise ValueError("the llama.cpp rows run the bundled model on the CPU only (no --model, --device cpu)")
        threads = torch.get_num_threads()  # the milestones' threads
        prompt, start = setup.workloads.decode_prompt, time.perf_counter()
        llm = Llama(model_path=str(gguf_for(engine.partition("@")[2])), n_threads=threads, n_threads_batch=threads,
                    n_ctx=len(prompt) + setup.args.decode_tokens + 8, n_batch=512, verbose=False)
        load_s = time.perf_counter() - start
    except Exception as err:
        return failed_measurement("decode", engine, "llama.cpp", err)
    return Measurement(engine, "decode", functools.partial(measure, engine, llm, setup,
                                                           {"load_s": load_s, "threads": threads}))


def measure(engine: str, llm: Llama, setup: Setup, extra: dict) -> dict:
    """One measurement: a warm-up and --runs timed runs (the row carries ``extra``: its load time and threads)."""
    try:
        return decode_row(engine, llm, setup) | extra
    except Exception as err:
        return error_row("decode", engine, "llama.cpp", err)


def decode_row(engine: str, llm: Llama, setup: Setup) -> dict:
    """One prompt, --decode-tokens greedy tokens (end of text never stops it), one warm-up then --runs timed runs."""
    args, prompt = setup.args, setup.workloads.decode_prompt

    def one_run() -> tuple[list[int], list[float], float]:
        llm.reset()  # no prefix cache between runs: every run computes its prompt
        tokens, times, begin = [], [], time.perf_counter()
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; never stops on its own
            tokens.append(token)
            times.append(time.perf_counter())
            if len(tokens) == args.decode_tokens:
                break
        return tokens, times, begin

    one_run()  # warm-up
    runs = []
    for _ in range(args.runs):
        tokens, times, begin = one_run()
        wall = times[-1] - begin
        runs.append({"wall_s": wall, "tokens_per_s": len(tokens) / wall, "ttft_s": times[0] - begin,
                     "itl_s": inter_token_latency(times[0], times[-1], len(tokens))})
    return new_row("decode", engine, "llama.cpp", num_requests=1, output_tokens=len(tokens), **median_of_runs(runs),
                   runs=runs, dtype=ROW_DTYPES[engine.partition("@")[2]], _tokens=[tokens])
