"""Architecture name (config.json's `architectures`) -> the model class that runs it."""

from .gemma import GemmaForCausalLM
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}
