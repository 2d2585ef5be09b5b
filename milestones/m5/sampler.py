"""Pick the next token of every row, each row by its own request's rules.

Penalties come first, on greedy and sampled rows alike: they change the logits,
not the way of picking. Greedy rows take the argmax. Sampled rows scale by
temperature, cut to top-k and top-p, then draw with the *exponential race*:
``argmax(probs / E)`` with ``E ~ Exponential(1)`` picks index i with probability
``probs[i]``. The noise for a request's n-th token is seeded by (its seed, n) alone:
a seeded request draws the same numbers whatever else shares its batch, and a step
that fails, or a request that is preempted and recomputed, leaves no random state
half-advanced.
"""

from __future__ import annotations

import numpy as np
import torch

from milestones.serving.outputs import Logprob
from milestones.transfer import to_device

from .sequence import Sequence
from .step import SampledToken


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # re-seeded for every row it draws

    # --8<-- [start:sample]
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """logits: [len(seqs), vocab] in fp32, one row per sequence."""
        logits = self.apply_grammars(logits, seqs)  # structured requests: their format's tokens only
        model_logits = logits
        if any(seq.params.has_penalties for seq in seqs):  # serving features run for the steps that ask alone
            logits = self.apply_penalties(logits, seqs)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            sampled = [seqs[i] for i in rows]
            index = to_device(rows, torch.long, self.device)
            temperature = to_device([s.params.temperature for s in sampled], torch.float32, self.device)
            probs = self.filtered_probs(logits[index] / temperature[:, None], sampled)
            noise = torch.stack([self.exponential_noise(s, probs.shape[-1]) for s in sampled])
            tokens[index] = (probs / noise).argmax(dim=-1)
        token_ids = tokens.tolist()
        self.advance_grammars(seqs, token_ids)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if any(seq.params.logprobs is not None for seq in seqs):
            logprobs = self.logprobs(model_logits, seqs, token_ids)
        return [SampledToken(token, found) for token, found in zip(token_ids, logprobs)]
    # --8<-- [end:sample]

    # --8<-- [start:grammars]
    def apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rows of structured requests keep the logits of the tokens their grammar accepts next, the others become
        -inf (and so do their log-probabilities, as in vLLM). Returns new logits, or the same tensor when no row has a
        grammar."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # rows without a grammar allow every token
        for i in rows:
            grammar = seqs[i].grammar
            grammar.rewind(seqs[i].num_tokens - len(seqs[i].prompt_token_ids))  # a step undone may have run ahead
            bits = np.unpackbits(np.frombuffer(grammar.allowed(), dtype=np.uint8), bitorder="little")  # token t: bit t
            allowed[i] = torch.from_numpy(bits[:vocab].astype(bool))
        return logits.masked_fill(~allowed.to(self.device), float("-inf"))

    @staticmethod
    def advance_grammars(seqs: list[Sequence], tokens: list[int]) -> None:
        """Each grammar reads the token picked under its mask: the next step's mask follows from it."""
        for seq, token in zip(seqs, tokens):
            if seq.grammar is not None:
                seq.grammar.accept(token)
    # --8<-- [end:grammars]

    # --8<-- [start:logprobs]
    def logprobs(self, logits: torch.Tensor, seqs: list[Sequence],
                 tokens: list[int]) -> list[dict[int, Logprob] | None]:
        """For each row whose request asks (``params.logprobs`` = k): the chosen token's log-probability and the k
        likeliest tokens', each with its rank. From the model's own logits (vLLM's default): before penalties and
        temperature, they say what the model thinks, whatever rule then picked the token."""
        found: list[dict[int, Logprob] | None] = [None] * len(seqs)
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return found
        index = to_device(rows, torch.long, self.device)
        chosen = to_device([tokens[i] for i in rows], torch.long, self.device)
        ks = [seqs[i].params.logprobs for i in rows]
        for i, ranked in zip(rows, ranked_logprobs(logits[index], chosen, ks)):
            found[i] = ranked
        return found
    # --8<-- [end:logprobs]

    # --8<-- [start:penalties]
    def apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """vLLM's order: the repetition penalty on every token of the prompt and the output, then the frequency and
        presence penalties on the output's tokens. Rows without penalties are returned as they are."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()  # the caller's logits stay the model's own
        vocab = logits.shape[-1]
        for i in rows:
            params, row = seqs[i].params, logits[i]
            counts = to_device(seqs[i].output_token_ids, torch.long, self.device).bincount(minlength=vocab)
            if params.repetition_penalty != 1:
                seen = counts > 0
                seen[to_device(seqs[i].prompt_token_ids, torch.long, self.device)] = True
                penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return logits
    # --8<-- [end:penalties]

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


# --8<-- [start:ranked_logprobs]
def ranked_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Row by row of logits [rows, vocab]: ``{token: Logprob(logprob, rank)}``, the chosen token first (a sampled one,
    or a prompt's own next token), then the row's k likeliest in order; the chosen one is not listed twice."""
    logprobs = logits.log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(-1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # 1 + how many tokens are likelier than the chosen one
    top = logprobs.topk(max(ks), dim=-1)
    found = []
    columns = zip(ks, chosen.tolist(), chosen_logprobs[:, 0].tolist(), ranks.tolist(), top.indices.tolist(),
                  top.values.tolist())
    for k, token, value, rank, top_ids, top_values in columns:
        ranked = {token: Logprob(value, rank)}
        for place, (top_id, top_value) in enumerate(zip(top_ids[:k], top_values[:k]), 1):
            if top_value == float("-inf"):
                break  # a token a grammar masked: not among the likeliest, it cannot be picked at all
            ranked.setdefault(top_id, Logprob(top_value, place))
        found.append(ranked)
    return found
# --8<-- [end:ranked_logprobs]
