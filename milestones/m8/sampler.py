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

from .future_map import FutureMap
from .step import SamplingRow


class Sampler:
    def __init__(self, device: torch.device, future_map: FutureMap) -> None:
        self.device = device
        self.future_map = future_map  # m6: resolves the future ids a penalty's history may end with
        self.generator = torch.Generator(device=device)  # re-seeded for every row it draws

    # --8<-- [start:sample]
    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """logits: [len(seqs), vocab] in fp32, one row per sequence; the tokens stay on the device."""
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
            judged = [j for j, s in enumerate(sampled) if s.guess is not None]  # m7, acceptance "rejection"
            if judged:
                tokens[index[judged]] = self.judge_guesses(probs[judged], [sampled[j] for j in judged])
        self.advance_grammars(seqs, tokens)
        return tokens
    # --8<-- [end:sample]

    # --8<-- [start:grammars]
    def apply_grammars(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """Rows of structured requests keep the logits of the tokens their grammar accepts next, the others become
        -inf (and so do their log-probabilities, as in vLLM). Returns new logits, or the same tensor when no row has a
        grammar. m6: the runner calls it, so that the log-probabilities it reads are of the masked logits too."""
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
    def advance_grammars(seqs: list[SamplingRow], tokens: torch.Tensor) -> None:
        """Each grammar reads the token picked under its mask: the next step's mask follows from it. m6: here, on the
        worker, so that the mask is ready when the next step samples; reading the tokens waits for the step, only in
        steps with a structured request."""
        if all(seq.grammar is None for seq in seqs):
            return
        for seq, token in zip(seqs, tokens.tolist()):
            if seq.grammar is not None:
                seq.grammar.accept(token)
    # --8<-- [end:grammars]

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

    # --8<-- [start:logprobs]
    def logprobs(self, logits: torch.Tensor, seqs: list[SamplingRow],
                 tokens: torch.Tensor) -> list[dict[int, Logprob] | None]:
        """For each row whose request asks (``params.logprobs`` = k): the chosen token's log-probability and the k
        likeliest tokens', each with its rank. From the model's own logits (vLLM's default): before penalties and
        temperature, they say what the model thinks, whatever rule then picked the token. m6: reading them waits for
        the step on the worker (tokens alone stay on the device): only steps with a row that asks pay for it."""
        found: list[dict[int, Logprob] | None] = [None] * len(seqs)
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return found
        index = to_device(rows, torch.long, self.device)
        ks = [seqs[i].params.logprobs for i in rows]
        for i, ranked in zip(rows, ranked_logprobs(logits[index], tokens[index], ks)):
            found[i] = ranked
        return found
    # --8<-- [end:logprobs]

    # --8<-- [start:penalties]
    def apply_penalties(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """vLLM's order: the repetition penalty on every token of the prompt and the output, then the frequency and
        presence penalties on the output's tokens. Rows without penalties are returned as they are."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()  # the caller's logits stay the model's own
        vocab = logits.shape[-1]
        for i in rows:
            params, row = seqs[i].params, logits[i]
            output = to_device(seqs[i].output_token_ids, torch.long, self.device)
            self.future_map.resolve_(output)  # m6: the last token may still be a future id; the device has it
            counts = output.bincount(minlength=vocab)
            if params.repetition_penalty != 1:
                seen = counts > 0
                seen[to_device(seqs[i].prompt_token_ids, torch.long, self.device)] = True
                penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return logits
    # --8<-- [end:penalties]

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
