"""Steps with prefill, captured in pieces: every layer's work but attention replayed, attention eager between.

A step that carries a prefill chunk cannot replay the decode step's graph: its attention depends on how long
each request's chunk and context are, which change every step. Nothing else in a layer does: the norms, the
products, RoPE and the MLP see only how many tokens the step has. So the step is cut at attention (vLLM's
piecewise graphs): the pieces between one layer's attention and the next are captured once per padded token
count, and a replay runs them in order with each layer's attention, over the paged cache, eager between them:

    piece 0       the embedding, layer 0 up to its q, k, v          attention of layer 0 (eager)
    piece 1       layer 0's o_proj and MLP, layer 1 up to q, k, v    attention of layer 1 (eager)
    ...
    piece L       the last layer's o_proj and MLP, the final norm

The capture runs the model once with its attention replaced by a cut that ends the graph being captured and
begins the next one, so the model itself is not changed. Every piece of every size shares one memory pool: safe
because they are replayed in the order they were captured, each piece rewriting what the next one reads. CUDA
only; on a CPU the dispatcher sends these steps to the eager path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from milestones.kernels import AttentionBackend

from .attention import AttentionContext
from .model import CausalLM


@dataclass(slots=True)
class Cut:
    """One layer's attention, cut out of the captured pieces: where the piece before leaves q, k and v, and where
    the piece after reads attention's output (both inside the pieces' memory pool, at fixed addresses)."""

    q: torch.Tensor  # [size, heads, dim]
    k: torch.Tensor  # [size, kv_heads, dim]
    v: torch.Tensor
    out: torch.Tensor  # [size, heads, dim]


@dataclass(slots=True)
class Pieces:
    """A token count's captured step: a graph more than there are layers, a cut between each two."""

    graphs: list[torch.cuda.CUDAGraph]
    cuts: list[Cut]
    hidden: torch.Tensor  # [size, hidden_size]: what the last piece writes


class PiecewiseRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, sizes: list[int], device: torch.device) -> None:
        self.model, self.attention, self.sizes = model, attention, sorted(sizes)
        # --8<-- [start:static_buffers]
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)  # a padding token is id 0 ...
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)  # ... or what a step left
        # --8<-- [end:static_buffers]
        self.pieces: dict[int, Pieces] = {}  # token count -> its captured step
        self.num_replays = self.num_padded_tokens = 0
        self.capture_seconds = 0.0

    # --8<-- [start:capture]
    def capture(self) -> None:
        """Capture every token count, the largest first, all in one memory pool."""
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        for size in tqdm(self.sizes[::-1], desc="Capturing the pieces of a step", unit="token count"):
            self.pieces[size] = self._capture(size, pool)
        self.capture_seconds = time.perf_counter() - start

    def _capture(self, size: int, pool: tuple[int, int]) -> Pieces:
        ids, positions = self.input_ids[:size], self.positions[:size]
        ctx = AttentionContext([], [], ids[:0], ids[:0], [])  # read by no piece: attention is cut out of them
        graphs, cuts = [torch.cuda.CUDAGraph()], []

        def cut(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
            out = torch.empty_like(q)  # made in the piece before, at an address the piece after reads
            graphs[-1].capture_end()
            cuts.append(Cut(q, k, v, out))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return out

        stream = torch.cuda.Stream()  # a capture may not run on the default stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                self.model.use_attention(lambda q, k, v, layer, ctx: torch.empty_like(q))
                self.model(ids, positions, ctx)  # one warm-up: lazy initialisation must not happen inside a capture
                stream.synchronize()
                self.model.use_attention(cut)
                graphs[0].capture_begin(pool=pool)
                hidden = self.model(ids, positions, ctx)
                graphs[-1].capture_end()
        finally:
            self.model.use_attention(self.attention.forward)
        torch.cuda.current_stream().wait_stream(stream)
        return Pieces(graphs, cuts, hidden)
    # --8<-- [end:capture]

    # --8<-- [start:run]
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, size: int) -> torch.Tensor:
        """The step's tokens into the static buffers, then each piece and each layer's attention in turn; the
        hidden states of the real tokens. Attention sees the real tokens alone: the padding rows' keys and values
        are never written, and their outputs, which no other row reads, are dropped."""
        n, pieces = len(input_ids), self.pieces[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for layer, (graph, cut) in enumerate(zip(pieces.graphs, pieces.cuts)):
            graph.replay()
            cut.out[:n] = self.attention.forward(cut.q[:n], cut.k[:n], cut.v[:n], layer, ctx)
        pieces.graphs[-1].replay()
        self.num_replays += 1
        self.num_padded_tokens += size - n
        return pieces.hidden[:n]
    # --8<-- [end:run]
