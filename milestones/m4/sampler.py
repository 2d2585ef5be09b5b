"""Pick the next token of every row, each row by its own request's rules.

Greedy rows take the argmax. Sampled rows scale by temperature, cut to top-k
and top-p, then draw with the *exponential race*: ``argmax(probs / E)`` with
``E ~ Exponential(1)`` picks index i with probability ``probs[i]``. The noise
comes from the request's own generator, so a seeded request draws the same
numbers whatever else shares its batch.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    # --8<-- [start:sample]
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] in fp32, one row per sequence."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            sampled = [seqs[i] for i in rows]
            index = torch.tensor(rows, device=self.device)
            temperature = torch.tensor([s.params.temperature for s in sampled], device=self.device)
            probs = self.filtered_probs(logits[index] / temperature[:, None], sampled)
            noise = torch.stack([self.exponential_noise(s, probs.shape[-1]) for s in sampled])
            tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()
    # --8<-- [end:sample]

    # --8<-- [start:filtered_probs]
    def filtered_probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if all(k == -1 for k in top_k) and all(p == 1.0 for p in top_p):
            return logits.softmax(dim=-1)
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=self.device)
        k = torch.tensor([vocab if k == -1 else k for k in top_k], device=self.device)
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest head whose mass reaches top_p: drop a token if the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_p, device=self.device)
        sorted_logits.masked_fill_(mass_before > p[:, None], float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
    # --8<-- [end:filtered_probs]

    def exponential_noise(self, seq: Sequence, vocab: int) -> torch.Tensor:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        return torch.empty(vocab, device=self.device).exponential_(generator=seq.generator)
