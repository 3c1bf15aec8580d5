"""ridge: an LLM inference engine that moves fewer bytes, and tells you which wall binds."""

from ridge.engine.beam_search import BeamSearchParams
from ridge.engine.engine import LLMEngine
from ridge.engine.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from ridge.llm import LLM
from ridge.lora import LoRARequest
from ridge.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput", "CompletionOutput",
           "LoRARequest"]
__version__ = "0.1.0"
