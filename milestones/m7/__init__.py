"""Milestone 7: speculative decoding: guess a request's next tokens, check them all in one forward, keep what agrees."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
