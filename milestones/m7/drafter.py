"""m7's other proposer: a smaller model with the target's tokenizer guesses each request's next tokens.

The draft runs on a KV pool of its own, shaped like the target's and addressed by the very same
block tables (a block id names the same token slots in both pools). So what rolls back a rejected
guess in the target's tables rolls it back in the draft's too, and a block the prefix cache shares
holds both models' keys and values. In each step it guesses k tokens for every decoding request in
k batched forward passes: the first catches up on the tokens the draft has not seen (the last one,
and the bonus token of a step whose guesses were all kept), each later one feeds the guess before.
Its picks follow the target's sampling rules with the same (seed, position) noise, so a draft that
agrees with the target guesses exactly the target's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import AutoConfig, AutoTokenizer

from milestones.model_store import resolve_model

from .config import EngineConfig
from .model import ModelConfig
from .model_runner import ModelRunner
from .proposer import NgramProposer
from .sampling_params import SamplingParams
from .sequence import Sequence
from .step import ScheduledBatch


@dataclass(slots=True)
class DraftView:
    """A request as the draft's runner reads it: its tokens and the guesses so far, and how many the draft computed."""

    token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]  # the penalties' history starts after these, as the target's does
    draft_token_ids: list[int] = field(default_factory=list)  # always empty: the draft checks no guesses of its own
    grammar: None = None  # never: a structured request gets no guesses

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


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

    def propose_batch(self, seqs: list[Sequence], tables: list[list[int]], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` guesses for request i, whose block table ``tables[i]`` has the slots for them."""
        # The draft computes what it has not seen: at least the last token, sampled after its previous guesses.
        unscored = [replace(seq.params, logprobs=None, prompt_logprobs=None) for seq in seqs]  # a guess's are nobody's
        views = [DraftView(list(seq.token_ids), seq.num_drafted_tokens, params, seq.seed, seq.prompt_token_ids)
                 for seq, params in zip(seqs, unscored)]
        guesses: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:  # k forward passes: everyone's catch-up and first guess, then a guess each
            batch = ScheduledBatch([views[i] for i in active],
                                   [len(views[i].token_ids) - views[i].num_computed_tokens for i in active],
                                   [tables[i] for i in active])
            tokens = self.runner.execute(self.runner.prepare(batch)).tokens.tolist()
            for i, token in zip(active, tokens):
                views[i].num_computed_tokens = len(views[i].token_ids)
                views[i].token_ids.append(token)
                guesses[i].append(token)
            active = [i for i in active if len(guesses[i]) < rooms[i]]
        for seq, view in zip(seqs, views):
            seq.num_drafted_tokens = view.num_computed_tokens
        return guesses
# --8<-- [end:draft_model]


def make_proposer(config: EngineConfig, tokenizer, target: ModelConfig) -> NgramProposer | DraftModelProposer | None:
    """What guesses each request's next tokens (None: nothing does, and m7 runs as m6)."""
    speculative = config.speculative_config
    if speculative is None:
        return None
    if speculative.method == "draft_model":
        return DraftModelProposer(config, tokenizer, target)
    return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
