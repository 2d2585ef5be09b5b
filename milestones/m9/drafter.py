"""m7's other proposer: a smaller model with the target's tokenizer guesses each request's next tokens.

The draft runs on a KV pool of its own, shaped like the target's and addressed by the very same
block tables (a block id names the same token slots in both pools). So what rolls back a rejected
guess in the target's tables rolls it back in the draft's too, and a block the prefix cache shares
holds both models' keys and values. The draft follows every step: its first forward pass computes
the chunks the target computes (prompt chunks and decode tokens, within the step's budget), so its
keys and values keep up with the target's, and samples each guessing request's first guess; each
later pass feeds the guess before and samples the next. Its picks follow the target's sampling
rules with the same (seed, position) noise, so a draft that agrees with the target guesses
exactly the target's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from transformers import AutoConfig, AutoTokenizer

from milestones.model_store import resolve_model
from milestones.serving.sampling_params import SamplingParams

from .config import EngineConfig
from .model import ModelConfig
from .model_runner import ModelRunner
from .proposer import NgramProposer
from .sampler import Sampler
from .sequence import SpecState
from .step import SamplingRow, ScheduledBatch, StepInputs


@dataclass(slots=True)
class DraftView:
    """A request as the draft's runner reads it: its tokens to the end of the step's chunk and the guesses so far,
    how many the draft computed, and how many it may still guess."""

    token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]  # the penalties' history starts after these, as the target's does
    room: int  # guesses still to make (0: the row only keeps the draft's keys and values up with the target's)
    spec: SpecState = field(default_factory=SpecState)  # no guesses: the draft checks none of its own
    grammar: None = None  # never: a structured request gets no guesses

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:  # what the runner's dispatch asks of every request
        return len(self.token_ids)


# --8<-- [start:draft_model]
class DraftModelProposer:
    """The draft model and its runner (eager: its steps change shape every time). Its keys and values sit in the
    requests' blocks: the scheduler caches a block once both models wrote it."""

    min_lookahead = 0  # each guess costs a forward of the draft: a request whose guesses fail stops guessing

    def __init__(self, config: EngineConfig, tokenizer, target: ModelConfig) -> None:
        name = config.speculative_config.model
        path = resolve_model(name)
        model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab() or \
                model_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model {name!r} has another tokenizer than the target's; "
                             "a draft must share the target's vocabulary (pick a smaller model of the same family)")
        if model_config.max_position_embeddings < config.max_model_len:
            raise ValueError(f"speculative_config: the draft model {name!r} reads at most "
                             f"{model_config.max_position_embeddings} tokens; lower max_model_len to that")
        # The same pool size and block size as the target's (num_kv_blocks is resolved by now): the same tables.
        self.runner = ModelRunner(replace(config, enforce_eager=True, speculative_config=None), model_config, path)
        self.rejection = config.speculative_config.acceptance == "rejection"  # the target judges guesses against q
        if self.rejection:
            self.runner.sampler = DraftSampler(config.device)

    def propose_batch(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        """Compute what the target computes in this step, and up to ``batch.guess_rooms[row]`` guesses for each row
        with room. Every step, guessing or not: a block the target writes, the draft writes too, so it may be cached.

        The first forward pass takes each row's chunk as the scheduler planned it (within the step's budget), and the
        rows with room sample their first guess there; each later pass feeds the guess before and samples the next.
        The draft is at most one token behind: after a step whose guesses were all kept, the last guess was sampled but
        never fed, so the first pass feeds it before the bonus token, one token a request beyond the budget."""
        views = []
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            unscored = replace(seq.params, logprobs=None, prompt_logprobs=None)  # a guess's are nobody's
            views.append(DraftView(seq.token_ids[: seq.num_computed_tokens + num_new], seq.spec.num_drafted_tokens,
                                   unscored, seq.seed, seq.prompt_token_ids, batch.guess_rooms.get(row, 0)))
        guesses: dict[int, list[int]] = {row: [] for row in batch.guess_rooms}
        active = list(range(len(views)))
        while active:  # everyone's chunk and the first guesses, then a guess each for the rows with room left
            step = self.runner.prepare(ScheduledBatch([views[i] for i in active],
                                                      [len(views[i].token_ids) - views[i].num_computed_tokens
                                                       for i in active],
                                                      [batch.block_tables[i] for i in active]))
            tokens = iter(self.runner.execute(sampling_guesses_only(step)).tokens.tolist())
            drawn_from = iter(self.runner.sampler.drawn_from if self.rejection else [])  # q of each sampled row
            for i in active:
                view = views[i]
                view.num_computed_tokens = len(view.token_ids)
                if view.room:  # its last row sampled (the tokens come in the order of the rows that did)
                    token = next(tokens)
                    view.token_ids.append(token)
                    guesses[i].append(token)
                    view.room -= 1
                    if self.rejection and not view.params.greedy:  # what the guess was drawn from, to judge it by
                        batch.guess_probs.setdefault(batch.seqs[i].request_id, []).append(next(drawn_from))
            active = [i for i in active if views[i].room]
        for seq, view in zip(batch.seqs, views):
            seq.spec.num_drafted_tokens = view.num_computed_tokens
        return guesses
# --8<-- [end:draft_model]


class DraftSampler(Sampler):
    """The draft's sampler with acceptance "rejection": it keeps the distribution each sampled (not greedy) row drew
    its pick from, q, with which the target's sampler judges the guess (``ScheduledBatch.guess_probs``)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.drawn_from: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        self.drawn_from = []  # a pass of greedy rows draws from nothing
        return super().__call__(logits, seqs)

    def filtered_probs(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        probs = super().filtered_probs(logits, seqs)
        self.drawn_from = list(probs)  # a row each, in the order of the rows that sample
        return probs


def sampling_guesses_only(step: StepInputs) -> StepInputs:
    """The pass without the picks of rows that guess nothing: the runner samples after every chunk that reaches the
    end of its view, and those tokens would be thrown away (a pass in which no row guesses skips the LM head)."""
    keep = [i for i, view in enumerate(step.sample_seqs) if view.room]
    forward = step.forward  # eager: the draft's runner replays no graph
    forward.sample_rows, forward.sample_seqs, step.samples, step.future_ids = (
        [items[i] for i in keep] for items in (forward.sample_rows, forward.sample_seqs, step.samples, step.future_ids))
    step.sample_seqs = forward.sample_seqs
    return step


def make_proposer(config: EngineConfig, tokenizer, target: ModelConfig) -> NgramProposer | DraftModelProposer | None:
    """What guesses each request's next tokens (None: nothing does, and m7 runs as m6)."""
    speculative = config.speculative_config
    if speculative is None:
        return None
    if speculative.method == "draft_model":
        return DraftModelProposer(config, tokenizer, target)
    return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
