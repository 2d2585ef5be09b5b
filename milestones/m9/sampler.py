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

from .step import SamplingRow


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # re-seeded for every row it draws

    # --8<-- [start:sample]
    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
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
            judged = [j for j, s in enumerate(sampled) if s.guess is not None]  # m7, acceptance "rejection"
            if judged:
                tokens[index[judged]] = self.judge_guesses(probs[judged], [sampled[j] for j in judged])
        return tokens
    # --8<-- [end:sample]

    # --8<-- [start:judge_guesses]
    def judge_guesses(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """m7, acceptance "rejection": each row's guess, or the pick that replaces it, with random numbers of their
        own (seeded by the request's seed and the position, salted), so the picks follow the model's probabilities.
        A draft model's guesses come with the distribution each was drawn from; prompt lookup's are certain."""
        uniforms, noise = [], []
        for row in rows:
            self.generator.manual_seed(noise_seed(row.seed ^ REJECTION_SALT, row.num_tokens))
            uniforms.append(torch.rand((), generator=self.generator, device=self.device))
            noise.append(torch.empty(probs.shape[-1], device=self.device).exponential_(generator=self.generator))
        guesses = to_device([row.guess for row in rows], torch.long, self.device)
        drawn_from = torch.stack([row.guess_probs for row in rows]) if rows[0].guess_probs is not None else None
        return rejection_sample(probs, guesses, torch.stack(uniforms), torch.stack(noise), drawn_from)
    # --8<-- [end:judge_guesses]

    # --8<-- [start:filtered_probs]
    def filtered_probs(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
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
    def exponential_noise(self, seq: SamplingRow, vocab: int) -> torch.Tensor:
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


# --8<-- [start:rejection_sample]
REJECTION_SALT = 0x5EC0_ADD5  # keeps a row's acceptance numbers apart from the noise that drew its guess


def rejection_sample(probs: torch.Tensor, guesses: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor,
                     guess_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Speculative sampling's rule, one row per guess: keep guess x with probability min(1, p(x) / q(x)), else draw
    from what is left of p once q is taken out, max(p - q, 0), normalised. Whatever q is, the token that comes out
    follows p. q is the proposer's distribution, one row per guess (None: each guess was certain, as prompt
    lookup's are). ``uniforms``: one U(0, 1) per row; ``noise``: Exponential(1) per row and token, for the draw."""
    q = guess_probs if guess_probs is not None else torch.nn.functional.one_hot(guesses, probs.shape[-1]).to(probs)
    p_guess = probs.gather(-1, guesses[:, None])[:, 0]
    q_guess = q.gather(-1, guesses[:, None])[:, 0]
    keep = uniforms * q_guess < p_guess  # u < p(x) / q(x), without dividing by a q(x) of 0
    residual = (probs - q).clamp(min=0)  # never the guess itself when it is rejected: there p(x) < q(x)
    return torch.where(keep, guesses, (residual / noise).argmax(dim=-1))
# --8<-- [end:rejection_sample]
