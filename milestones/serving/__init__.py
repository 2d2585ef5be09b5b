"""What serves requests but is no milestone's lesson, written once: the offline front end and its checks, chat
templates, n > 1, structured output, request outputs and their metrics.

Every milestone imports it; it imports no milestone (each ``milestones.mK.LLM`` binds its own engine to ``LLM``).
"""

from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics"]
