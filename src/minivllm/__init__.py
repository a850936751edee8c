"""minivllm: a compact LLM inference engine (paged KV cache, continuous batching, CUDA
graphs, Triton paged attention) with vLLM's offline API and an OpenAI-compatible server."""

from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
