"""Run the steps on the device while the host gets on with the next one: m6's lesson.

The ``ForwardWorker`` computes the launched steps one after the other, in order: on a
CPU in a thread of its own (torch releases the GIL inside its kernels, so the host's
Python runs meanwhile); on CUDA that thread also works on a stream of its own and
copies each step's tokens to pinned host memory without waiting for them. Because
steps run in launch order, a step launched later always sees what an earlier one
wrote: KV blocks freed by the host while a step still writes them can be handed out
at once. Everything here runs on the worker's thread except ``submit``, ``result`` and
``close``, which the host calls. Dependencies point one way: this module drives the
model runner, which never calls back into it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from milestones.runtime.threads import InOrderThread
from milestones.trace import Tracer

from .step import StepOutput

if TYPE_CHECKING:  # only for type hints
    from .model_runner import ModelRunner
    from .step import StepInputs


# --8<-- [start:worker]
class ForwardWorker:
    """Computes launched steps in launch order: in a thread of its own, or inline (m5's loop)."""

    def __init__(self, runner: ModelRunner, device: torch.device, threaded: bool, tracer: Tracer) -> None:
        self.runner, self.tracer = runner, tracer
        self.stream = None
        if device.type == "cuda" and threaded:
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the weights, KV pool and graphs are ready
        # the thread itself, its start and stop, a dead one reported: milestones.runtime, no lesson
        self.steps = InOrderThread(lambda item: self._compute(*item), "forward worker", threaded, self._on_thread)

    def submit(self, step_number: int, inputs: StepInputs) -> None:
        """Hand a prepared step over; inline, it is computed before this returns."""
        self.steps.put((step_number, inputs))

    def result(self, step_number: int) -> StepOutput:
        """Step ``step_number``'s sampled tokens and scores (waits for them), or its exception, re-raised.

        Results of older steps are thrown away: steps the host rolled back, or one whose wait was interrupted
        (Ctrl-C), would otherwise be taken for the steps after them.
        """
        while (output := self.steps.get()).step_number != step_number:
            pass
        if output.error is not None:
            raise output.error  # with the worker's traceback
        if output.ready is not None:
            output.ready.synchronize()
        return output

    def _on_thread(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.stream.device)  # the stream knows its device's index; "cuda" alone does not

    def _compute(self, step_number: int, inputs: StepInputs) -> StepOutput:
        start = self.tracer.now()
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                output = self.runner.execute(inputs)
                output.step_number = step_number
                if self.stream is not None:  # copy without waiting; the host waits on the event when it needs them
                    tokens, output.tokens = output.tokens, torch.empty(output.tokens.shape, dtype=torch.long,
                                                                       pin_memory=True)
                    output.tokens.copy_(tokens, non_blocking=True)
                    output.ready = torch.cuda.Event()
                    output.ready.record(self.stream)
        except BaseException as error:  # handed to the host, which re-raises it; the worker lives on
            output = StepOutput(None, [], {}, step_number, error=error)
        self.tracer.record("forward", start, step_number, inputs.num_seqs)
        return output

    def close(self) -> None:
        """Stop the thread once it has finished what it was given; later steps are refused."""
        self.steps.close()
# --8<-- [end:worker]
