"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import fields

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import LLMEngine, Prompt
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Load a model once, then generate for lists of prompts.

    ``LLM()`` loads the bundled SmolLM2-135M-Instruct on CUDA/bf16 if available,
    else CPU/fp32. Further keyword arguments use vLLM's names (``max_model_len``,
    ``seed``, ...).
    """

    def __init__(self, model: str | None = None, *, device=None, dtype=None, **kwargs) -> None:
        accepted = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - accepted
        if unknown:
            raise TypeError(f"unknown LLM option(s) {sorted(unknown)}; accepted: {sorted(accepted)}")
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer

    # --8<-- [start:generate]
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_ids.append(self.engine.add_request(prompt, p))
        except ValueError as err:
            for request_id in request_ids:  # leave the engine as we found it
                self.engine.abort_request(request_id)
            raise ValueError(f"prompt {len(request_ids)}: {err}") from None
        return self._run(request_ids, use_tqdm and len(prompts) > 1)
    # --8<-- [end:generate]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[r] for r in request_ids]
