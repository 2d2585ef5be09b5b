"""m5's capture on a CPU, which has no graphs: ``torch.compile`` per batch size, tuned so a replay costs little.

The lesson (``graph_runner.py``) captures the decode step once per bucket and replays it: on CUDA with
``torch.cuda.CUDAGraph``, on a CPU by compiling the step for the bucket's buffers, as SGLang's CPU graph runner
does. What it takes to make a compiled replay cheap is not the lesson and lives here: each runner's own copy of
the step's code, guards kept only on the step's arguments, checks the replay skips, inductor's options.
"""

from __future__ import annotations

import os
import shutil
import threading
import types
from collections.abc import Callable

import torch


def cpp_compiler_available() -> bool:
    """torch.compile on a CPU writes C++ and needs a compiler ($CXX, else c++) to build it."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def compiled_replay(forward: Callable, buffers: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    """``forward`` compiled for one bucket's buffers (the first call compiles it, or loads inductor's cache from
    disk), and a call that replays it."""
    # Every size is one more compiled entry of the runner's forward: allow many.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    compiled = torch.compile(forward, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS)
    with torch._inductor.config.patch(freezing=True):  # read as dynamo traces: no option of compile
        compiled(*buffers)

    def replay() -> torch.Tensor:
        # Only the guards that tell the buckets apart (their buffers' shapes) are checked: a bucket is always called
        # with its own buffers, so the others held when it compiled and hold at every replay. By hand, taking turns:
        # a bfloat16 batch-1 replay 9.6 -> 8.7 ms, a float32 one 15.1 -> 14.3 ms. The stance is one setting for the
        # whole process, set and restored around the call: the lock keeps replays in other threads (another engine's
        # worker) from restoring it out of order; a compiled function of another thread, called meanwhile, skips too.
        with _SKIP_GUARDS, torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(*buffers)
    return replay


_SKIP_GUARDS = threading.Lock()


# --8<-- [start:own_entries]
def own_method(method: Callable) -> Callable:
    """The bound method over a copy of its code. torch.compile files what it compiled, with the guards that say when
    it applies, under the code object: with a copy per runner, one runner's entries are never tried for another's
    calls (another engine, another model), so they need no guards on the runner."""
    function = method.__func__
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def _guards_on_arguments(guards: list) -> list[bool]:
    """Keep the guards on the step's arguments (the buffers' shapes, one entry per bucket) and global state; drop
    those named from the runner, most of the ~5,000 on it and its model (each module's hooks, attributes, types).
    Dynamo checks what is kept (a replay, only those that tell the buckets apart): with all of them, a millisecond of
    a 13 ms step on two cores. So after capture nothing may swap a module or change a number the step reads (weights
    changed in place are still read)."""
    return [not guard.name.startswith("self") for guard in guards]
# --8<-- [end:own_entries]


# --8<-- [start:compile_options]
# How torch.compile builds a CPU bucket. Besides the model's own work, a replay runs inductor's Python wrapper around
# it, a line or more per operator: each option below takes lines out of it (measured on the benchmarks page).
COMPILE_OPTIONS = {
    "guard_filter_fn": _guards_on_arguments,  # check only the guards on the step's arguments
    # No check of each input's and output's shape, strides and alignment at every replay (about 500 a step).
    "size_asserts": False,
    "alignment_asserts": False,
    # Frozen (capture's ``freezing=True``), the weights are constants of the compiled step, not ~250 inputs gathered
    # from the model at every replay. They stay the model's own tensors, not copies: one changed in place is read.
    "cpp.weight_prepack": False,  # and in torch's layout: with the plain torch backend, the products stay m4's
}
# --8<-- [end:compile_options]
