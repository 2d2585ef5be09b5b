"""Pick the next token of every row, each row by its own request's rules.

The logits come in as the serving layer made them (``milestones.serving.logits_processors``:
a structured request's grammar masked, penalties applied), so the sampler only picks.
Greedy rows take the argmax. Sampled rows scale by
temperature, cut to top-k and top-p, then draw with the *exponential race*:
``argmax(probs / E)`` with ``E ~ Exponential(1)`` picks index i with probability
``probs[i]``. The noise for a request's n-th token is seeded by (its seed, n) alone:
a seeded request draws the same numbers whatever else shares its batch, and a step
that fails, or a request that is preempted and recomputed, leaves no random state
half-advanced.
"""

from __future__ import annotations

import torch

from milestones.transfer import to_device

from .sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # re-seeded for every row it draws

    # --8<-- [start:sample]
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [len(seqs), vocab] in fp32, one row per sequence. Returns the picked token ids, on the device."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            sampled = [seqs[i] for i in rows]
            index = to_device(rows, torch.long, self.device)
            temperature = to_device([s.params.temperature for s in sampled], torch.float32, self.device)
            probs = self.filtered_probs(logits[index] / temperature[:, None], sampled)
            noise = torch.stack([self.exponential_noise(s, probs.shape[-1]) for s in sampled])
            tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens
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
        k = to_device([vocab if k == -1 else min(k, vocab) for k in top_k], torch.long, self.device)
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Top-p: a token stays when the tokens ranked above it hold at most top_p, so the one that crosses it stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = to_device(top_p, torch.float32, self.device)
        sorted_logits.masked_fill_(mass_before > p[:, None], float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
    # --8<-- [end:filtered_probs]

    # --8<-- [start:exponential_noise]
    def exponential_noise(self, seq: Sequence, vocab: int) -> torch.Tensor:
        """Exponential(1) noise for the sequence's next token, a function of its seed and that token's position."""
        self.generator.manual_seed(noise_seed(seq.seed, seq.num_tokens))
        return torch.empty(vocab, device=self.device).exponential_(generator=self.generator)


def noise_seed(seed: int, position: int) -> int:
    """Mix a request's seed with a token position into one 64-bit seed (SplitMix64's finaliser).

    Neighbouring positions get unrelated seeds, and every bit of the input matters
    (a CPU generator keeps only the low 32 bits of its seed).
    """
    mask = 2**64 - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)
# --8<-- [end:exponential_noise]
