"""Milestone 2: continuous batching with a token budget and chunked prefill."""

from milestones import serving
from milestones.serving import CompletionOutput, RequestOutput, SamplingParams

from .config import EngineConfig
from .engine import LLMEngine


# --8<-- [start:bind]
class LLM(serving.LLM):
    """The offline API (``milestones.serving``) over this milestone's engine."""

    engine_class, config_class = LLMEngine, EngineConfig
# --8<-- [end:bind]


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
