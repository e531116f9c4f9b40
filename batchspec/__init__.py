"""batchspec: batched speculative decoding that provably produces what plain decoding produces."""

from .config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from .llm import LLM, RequestOutput

__all__ = ["LLM", "BatchspecError", "ModelConfig", "RequestOutput", "SamplingParams", "SpecConfig"]
