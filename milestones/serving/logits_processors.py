"""The serving features that work on a step's logits, around the lesson's sampler (vLLM V1's logits processors).

Before the pick, a structured request's grammar masks every token that would break its format and the penalties
shift the logits of tokens already seen; after it, the grammar reads the token picked and the rows that ask get
their log-probabilities, from the masked logits before the penalties (what the model thinks). A milestone's runner
meets all of it in one call, ``LogitsProcessors.sample(sampler, logits, rows)``; its sampler picks from the logits
it is given and knows none of this. A row is any record with ``params``, ``grammar``, ``num_tokens``,
``prompt_token_ids`` and ``output_token_ids``: a milestone's ``Sequence``, or m6's ``SamplingRow``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from milestones.transfer import to_device

from .outputs import Logprob
from .step_records import PromptLogprobRows, SampledToken


@dataclass(slots=True)
class PickedTokens:
    """What a step's sampled rows got: the tokens, on the device, and each row's log-probabilities (or None)."""

    tokens: torch.Tensor  # [rows]
    logprobs: list[dict[int, Logprob] | None]

    def as_list(self) -> list[SampledToken]:
        """Row by row, on the host (reading the tokens waits for the step)."""
        return [SampledToken(token, found) for token, found in zip(self.tokens.tolist(), self.logprobs)]


class LogitsProcessors:
    """The grammars, penalties and log-probabilities of a step's rows, applied around the sampler a milestone owns.

    ``resolve`` (m6 on) replaces, in place, the future ids a penalty's history may end with: the tokens a step still
    in flight will pick, known on the device only. Each feature costs nothing in a step that no row asks for.
    """

    def __init__(self, device: torch.device, resolve: Callable[[torch.Tensor], None] | None = None) -> None:
        self.device = device
        self.resolve = resolve

    # --8<-- [start:sample]
    def sample(self, sampler: Callable[[torch.Tensor, list], torch.Tensor], logits: torch.Tensor,
               rows: list) -> PickedTokens:
        """logits: [len(rows), vocab] in fp32. The sampler picks from the masked, penalized logits; the
        log-probabilities are the masked logits', before the penalties."""
        masked = self.apply_grammars(logits, rows)  # structured requests: their format's tokens only
        penalized = masked
        if any(row.params.has_penalties for row in rows):  # each feature runs in the steps that ask for it alone
            penalized = self.apply_penalties(masked, rows)
        tokens = sampler(penalized, rows)
        self.advance_grammars(rows, tokens)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        if any(row.params.logprobs is not None for row in rows):
            logprobs = self.logprobs(masked, rows, tokens)
        return PickedTokens(tokens, logprobs)
    # --8<-- [end:sample]

    # --8<-- [start:grammars]
    def apply_grammars(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """Rows of structured requests keep the logits of the tokens their grammar accepts next, the others become
        -inf (and so do their log-probabilities, as in vLLM). Returns new logits, or the same tensor when no row has a
        grammar."""
        structured = [i for i, row in enumerate(rows) if row.grammar is not None]
        if not structured:
            return logits
        vocab = logits.shape[-1]
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # rows without a grammar allow every token
        for i in structured:
            grammar = rows[i].grammar
            grammar.rewind(rows[i].num_tokens - len(rows[i].prompt_token_ids))  # a step undone may have run ahead
            bits = np.unpackbits(np.frombuffer(grammar.allowed(), dtype=np.uint8), bitorder="little")  # token t: bit t
            allowed[i] = torch.from_numpy(bits[:vocab].astype(bool))
        return logits.masked_fill(~allowed.to(self.device), float("-inf"))

    @staticmethod
    def advance_grammars(rows: list, tokens: torch.Tensor) -> None:
        """Each grammar reads the token picked under its mask: the next step's mask follows from it. Reading the
        tokens waits for the step, in steps with a structured request only."""
        if all(row.grammar is None for row in rows):
            return
        for row, token in zip(rows, tokens.tolist()):
            if row.grammar is not None:
                row.grammar.accept(token)
    # --8<-- [end:grammars]

    # --8<-- [start:penalties]
    def apply_penalties(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """vLLM's order: the repetition penalty on every token of the prompt and the output, then the frequency and
        presence penalties on the output's tokens. Returns new logits, or the same tensor when no row has
        penalties."""
        penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if not penalized:
            return logits
        logits = logits.clone()  # the caller's logits stay the model's own
        vocab = logits.shape[-1]
        for i in penalized:
            params, row = rows[i].params, logits[i]
            output = to_device(rows[i].output_token_ids, torch.long, self.device)
            if self.resolve is not None:
                self.resolve(output)  # m6 on: the last token may still be a future id; the device has it
            counts = output.bincount(minlength=vocab)
            if params.repetition_penalty != 1:
                seen = counts > 0
                seen[to_device(rows[i].prompt_token_ids, torch.long, self.device)] = True
                penalized_row = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
                row.copy_(torch.where(seen, penalized_row, row))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return logits
    # --8<-- [end:penalties]

    # --8<-- [start:logprobs]
    def logprobs(self, logits: torch.Tensor, rows: list, tokens: torch.Tensor) -> list[dict[int, Logprob] | None]:
        """For each row whose request asks (``params.logprobs`` = k): the chosen token's log-probability and the k
        likeliest tokens', each with its rank. From the model's own logits (vLLM's default): before penalties and
        temperature, they say what the model thinks, whatever rule then picked the token. Reading them waits for the
        step: only steps with a row that asks pay for it."""
        found: list[dict[int, Logprob] | None] = [None] * len(rows)
        asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not asking:
            return found
        index = to_device(asking, torch.long, self.device)
        ks = [rows[i].params.logprobs for i in asking]
        for i, ranked in zip(asking, ranked_logprobs(logits[index], tokens[index], ks)):
            found[i] = ranked
        return found
    # --8<-- [end:logprobs]

    # --8<-- [start:prompt_logprobs]
    def prompt_logprobs(self, logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        scored: list[PromptLogprobRows]) -> dict[str, list[dict[int, Logprob]]]:
        """Each asking request's scores of the prompt tokens its rows predict, from the step's hidden states
        (``logits_of``: the runner's LM head): the same ranking as a sampled token's, the prompt's own next token in
        the chosen one's place."""
        found = {}
        for rows in scored:
            logits = logits_of(hidden[rows.first_row : rows.first_row + len(rows.token_ids)])
            chosen = to_device(rows.token_ids, torch.long, self.device)
            found[rows.request_id] = ranked_logprobs(logits, chosen, [rows.k] * len(rows.token_ids))
        return found
    # --8<-- [end:prompt_logprobs]


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
