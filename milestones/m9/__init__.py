"""Milestone 9: prefill/decode disaggregation: prompts computed on prefill workers, decoded on decode workers, the
prompt's keys and values moved between them, a router in front."""

from milestones import serving
from milestones.serving import CompletionOutput, RequestOutput, SamplingParams

from .config import EngineConfig
from .engine import LLMEngine
from .pd_engine import DisaggregatedEngine, make_engine


# --8<-- [start:bind]
class LLM(serving.LLM):
    """The offline API (``milestones.serving``) over this milestone's engine: m8's, or with prefill and decode workers
    asked for, the router in front of them."""

    engine_class, config_class = staticmethod(make_engine), EngineConfig
# --8<-- [end:bind]


__all__ = ["LLM", "LLMEngine", "DisaggregatedEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
