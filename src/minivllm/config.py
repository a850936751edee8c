"""Engine and model configuration, and the engine's environment flags (the others:
MINIVLLM_CACHE_DIR and MINIVLLM_DEFAULT_MODEL_WHEEL in default_model.py,
MINIVLLM_GRAMMAR_CACHE in engine/grammar.py, MINIVLLM_ENGINE_TRACE in the engine process,
MINIVLLM_PDL in csrc_triton/_pdl.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch

# ---- environment flags --------------------------------------------------------------

def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def compile_enabled() -> bool:
    """MINIVLLM_COMPILE=1 compiles the decode step with torch.compile, =0 does not (CUDA
    graphs are captured either way). Off by default: on the H200 the compiled step was
    slower than the hand-fused Triton kernels (W2 878 vs 915 tok/s,
    bench/results/2026-11-29-h200-w2-compile/)."""
    return _env_flag("MINIVLLM_COMPILE", False)


def cuda_graphs_enabled() -> bool:
    """MINIVLLM_CUDA_GRAPHS=0 turns CUDA-graph capture off, like enforce_eager=True."""
    return _env_flag("MINIVLLM_CUDA_GRAPHS", True)


def pipelining_enabled() -> bool:
    """MINIVLLM_PIPELINE=0 runs the engine step by step: no step is launched before the
    previous step's tokens are read back (slower; for profiling and bisecting)."""
    return _env_flag("MINIVLLM_PIPELINE", True)


def decode_prelude_enabled() -> bool:
    """MINIVLLM_DECODE_PRELUDE=0: no split-K GEMM before each decode graph replay (see
    cuda_graph_runner.make_prelude). It kept the H200's graph kernels close together, W2
    1,009 vs 932 tok/s (bench/results/2026-11-29-h200-w2-sweep-split-k-prelude/); on a GPU
    without that behaviour it costs ~7 us a step."""
    return _env_flag("MINIVLLM_DECODE_PRELUDE", True)


def max_unanswered_outputs() -> int:
    """MINIVLLM_MAX_UNANSWERED=N: how many output messages a server frontend may leave
    unanswered before the engine process keeps its outputs back (engine_process.OutputBuffer;
    default 2). 0 never keeps them back: every step's outputs are sent (for an A/B)."""
    value = os.environ.get("MINIVLLM_MAX_UNANSWERED", "").strip()
    if not value:
        return 2
    if not value.isdigit():
        raise ValueError(f"MINIVLLM_MAX_UNANSWERED must be a whole number, got {value!r}.")
    return int(value)


def attention_backend(device: torch.device) -> str:
    """MINIVLLM_ATTENTION_BACKEND=torch|triton; default: triton on CUDA, torch elsewhere.
    (triton on a CPU runs the kernels in Triton's interpreter: for tests only.)"""
    name = os.environ.get("MINIVLLM_ATTENTION_BACKEND", "").strip().lower()
    if name in ("torch", "triton"):
        return name
    if name:
        raise ValueError(f"MINIVLLM_ATTENTION_BACKEND must be torch or triton, got {name!r}.")
    return "triton" if device.type == "cuda" else "torch"


def fused_ops_enabled(backend: str) -> bool:
    """Whether the model uses the fused Triton kernels for RMSNorm + residual, rotary
    (+ q/k norm + K/V store) and SiLU*up. MINIVLLM_FUSED_OPS=0/1 forces it; by default they
    are used with the Triton backend when torch.compile is off (the compiler fuses those
    ops itself when it is on)."""
    value = os.environ.get("MINIVLLM_FUSED_OPS", "").strip()
    if value:
        return _env_flag("MINIVLLM_FUSED_OPS", False)
    return backend == "triton" and not compile_enabled()


def cpu_kv_cache_bytes() -> int:
    """Upper bound on the KV pool on a CPU (MINIVLLM_CPU_KVCACHE_GB, default 1 GiB)."""
    return int(float(os.environ.get("MINIVLLM_CPU_KVCACHE_GB", "1")) * (1 << 30))


# ---- model --------------------------------------------------------------------------

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config.json that the model code needs."""

    architecture: str
    family: str  # model/families.py's ARCHITECTURES values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    checkpoint_dtype: torch.dtype
    initializer_range: float = 0.02
    raw: dict = field(default_factory=dict, repr=False)
    hidden_act: str = "silu"
    # Per layer: the sliding window it attends within (the last W positions, itself
    # included), or None for a layer that sees the whole context.
    layer_windows: tuple = ()
    attn_softcap: float | None = None    # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None   # Gemma 2: the logits, the same way
    attn_scale: float | None = None      # the softmax scale, when not head_dim ** -0.5
    o_bias: bool = False                 # the attention's output projection has a bias
    rope_local: tuple | None = None      # Gemma 3's sliding layers: (theta, scaling)
    moe: dict | None = None              # mixtures of experts: families._moe_settings

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        from .model.families import (ARCHITECTURES, MODEL_TYPES, _rope, family_settings,
                                     unread_fields)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"Unsupported model architecture {archs or cfg.get('model_type')}; "
                f"supported: {sorted(ARCHITECTURES)}.")
        family = ARCHITECTURES[arch]
        unread = unread_fields(family, cfg)
        if unread:
            logging.getLogger("minivllm").warning(
                "config.json fields that minivllm does not read and may change the model's "
                "outputs: %s.", ", ".join(unread))
        if family == "gpt2":  # GPT-2's own names
            cfg = {**cfg, "hidden_size": cfg["n_embd"], "num_attention_heads": cfg["n_head"],
                   "num_hidden_layers": cfg["n_layer"],
                   "intermediate_size": cfg.get("n_inner") or 4 * cfg["n_embd"],
                   "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
                   "max_position_embeddings": cfg.get("n_positions", 1024)}
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = _rope(cfg, "full_attention")
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            rope_scaling.setdefault("original_max_position_embeddings",
                                    cfg.get("original_max_position_embeddings"))
        extra = family_settings(family, cfg)
        extra["layer_windows"] = tuple(extra["layer_windows"])
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            initializer_range=cfg.get("initializer_range", 0.02),
            raw=cfg,
            **extra,
        )

    @property
    def max_context_len(self) -> int:
        """The longest context the model was made for (vLLM's derived max_model_len):
        max_position_embeddings, times the factor of a linear rope scaling (llama3 and
        longrope scaling already count in max_position_embeddings)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "linear":
            return int(self.max_position_embeddings * scaling.get("factor", 1.0))
        return self.max_position_embeddings

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within (None if a layer sees everything): KV
        blocks wholly before it are never read again."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def resolve_model_path(model: str | os.PathLike | None) -> tuple[Path, Path]:
    """Return (model_dir, config_path). `model` may be a folder, a config.json, or a .gguf."""
    if model is None:
        from .default_model import ensure_default_model
        model = ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path, path / "config.json"
    if path.is_file():
        return path.parent, path
    raise ValueError(f"Model path {str(model)!r} does not exist (no model hub is reachable: "
                     "pass a local Hugging Face folder, a config.json, or a .gguf file).")


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype,
                  device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # No bf16 instructions on our CPUs: bf16 matmuls are ~50x slower there.
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16.")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ---- engine -------------------------------------------------------------------------

@dataclass
class EngineConfig:
    """Everything the engine is built from; LLM(...) keyword arguments land here."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Tokens per KV-cache block; None: 64 on a GPU (a prefill tile of 64 keys then lies in one
    # block and loads whole, docs/decisions.md "KV blocks of 64 tokens"), 16 on a CPU.
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides memory-based sizing (tests, benchmarks)
    enforce_eager: bool = False
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    seed: int | None = 0  # None: a random one (vLLM's)
    device: str | torch.device = "auto"
    skip_tokenizer_init: bool = False
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_cudagraph_batch_size: int | None = None
    # Prefill/mixed steps of up to this many tokens replay CUDA graphs too (None: up to the
    # step budget, at most 8192; 0: never). Longer steps run eagerly.
    max_graph_tokens: int | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; nothing remote runs
    # Sampling defaults for the fields a request leaves unset (vLLM's --generation-config):
    # "auto": the model folder's generation_config.json; "vllm": none; or a folder.
    # Read by LLM and the server (sampling_params.generation_config_defaults).
    generation_config: str = "auto"
    # vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5} (engine/speculative.py).
    speculative_config: dict | None = None
    # Quantized decoder projections: "fp8", "int8" or "int4" (model/quantization.py).
    quantization: str | None = None
    # Processes the model is split over (worker/tensor_parallel.py): gloo on the CPU.
    tensor_parallel_size: int = 1
    # Several hosts (torchrun's names): the ranks are split evenly over nnodes; node 0 runs
    # the engine, the others only workers (`minivllm serve --node-rank K`), all meeting at
    # master_addr:master_port (a free local port when unset and nnodes is 1).
    # Offline LLM(...) only: engines splitting each generate() call's prompts (the server's
    # is --data-parallel-size, engine/data_parallel.py).
    data_parallel_size: int = 1
    # Which of the server's data-parallel engines this is (replica_configs sets it; it
    # names the engine's trace file, engine/step_trace.py).
    data_parallel_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # The KV cache's element type (vLLM's name): "auto" (the model's dtype) or "fp8" (e4m3).
    kv_cache_dtype: str = "auto"
    # The most logprobs (and prompt_logprobs) a request may ask for; -1: the whole
    # vocabulary (vLLM's). Past 20 a step's top tokens are found by a sort in PyTorch.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = secrets.randbits(32)
        elif not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer or None (random), got {self.seed!r}.")
        if self.block_size is not None and (self.block_size < 1
                                            or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"Unknown load_format {self.load_format!r}.")
        from .engine.speculative import SpeculativeConfig
        from .model.quantization import check_method
        SpeculativeConfig.from_dict(self.speculative_config)  # a bad one fails here
        check_method(self.quantization)
        if (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                or self.max_logprobs < -1):
            raise ValueError("max_logprobs must be an integer >= 0, or -1 for the whole "
                             f"vocabulary, got {self.max_logprobs!r}.")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError("kv_cache_dtype must be 'auto' or 'fp8' (e4m3), got "
                             f"{self.kv_cache_dtype!r}.")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model running in model_dtype."""
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def num_speculative_tokens(self) -> int:
        """The most drafts a sequence verifies per step (0 without speculation)."""
        return (self.speculative_config or {}).get("num_speculative_tokens", 0)

    def finalize(self, model_config: ModelConfig, device: torch.device) -> None:
        """Fill in the limits that depend on the model and the device."""
        if self.block_size is None:
            self.block_size = 64 if device.type == "cuda" else 16
        if self.max_model_len is None:
            self.max_model_len = model_config.max_position_embeddings
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}.")
        limit = model_config.max_context_len
        if self.max_model_len > limit:
            # vLLM's rule: positions past it were never trained (GPT-2 has no embedding
            # for them at all).
            scaled = (" x its linear rope scaling"
                      if limit != model_config.max_position_embeddings else "")
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than this model's maximum "
                f"context of {limit} tokens (max_position_embeddings{scaled} in its "
                "config): lower max_model_len.")
        if self.max_num_batched_tokens is None:
            # Big enough that ordinary prompts prefill in one step; long ones are chunked.
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs so every "
                             "running sequence can decode each step.")
        if self.max_graph_tokens is None:
            # Past 1,024 tokens every 512 more is another graph: a budget of a whole
            # context (chunked prefill off) would capture hundreds.
            self.max_graph_tokens = min(self.max_num_batched_tokens, 8192)
        elif self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, got {self.max_graph_tokens}.")

    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


# ---- vLLM's LLM(...) arguments that change nothing here ----------------------------

ANY = "any value"
# name -> (the values accepted, why they change nothing). Other values are refused: they
# ask for something minivllm does not do.
VLLM_ONLY_ARGUMENTS: dict[str, tuple] = {
    "swap_space": (ANY, "preempted sequences are recomputed, never swapped to the CPU"),
    "disable_log_stats": (ANY, "minivllm logs no periodic stats offline"),
    "disable_log_requests": (ANY, "minivllm logs no requests offline"),
    "enable_log_requests": (ANY, "minivllm logs no requests offline"),
    "max_seq_len_to_capture": (ANY, "decode graphs cover every context length"),
    "disable_async_output_proc": (ANY, "outputs are always processed behind the device"),
    "async_scheduling": (ANY, "steps are always launched ahead (pipelined decoding)"),
    "compilation_config": (ANY, "MINIVLLM_COMPILE chooses torch.compile"),
    "download_dir": (ANY, "nothing is downloaded"),
    "hf_token": (ANY, "nothing is downloaded"),
    "served_model_name": (ANY, "offline, no name is served"),
    "limit_mm_per_prompt": (ANY, "text-only models take no multimodal items"),
    "disable_custom_all_reduce": (ANY, "tensor parallelism uses NCCL's all-reduce"),
    "distributed_executor_backend": ((None, "mp", "uni"),
                                     "ranks run in minivllm's own processes"),
    "enable_lora": ((None, False), "LoRA is not supported"),
    "enable_sleep_mode": ((None, False), "sleep mode is not supported"),
    "tokenizer_mode": (("auto", "hf"), "the Hugging Face fast tokenizer is used"),
    "revision": ((None,), "a local model has no revisions"),
    "tokenizer_revision": ((None,), "a local tokenizer has no revisions"),
    "code_revision": ((None,), "no remote code runs"),
    "task": (("auto", "generate"), "minivllm runs generative models only"),
    "runner": (("auto", "generate"), "minivllm runs generative models only"),
    "convert": (("auto", "none"), "minivllm runs generative models only"),
    "hf_overrides": ((None, {}), "config.json is read as it is"),
    "mm_processor_kwargs": ((None, {}), "text-only models have no multimodal processor"),
    "cpu_offload_gb": ((0,), "weights are not offloaded to the CPU"),
    "pipeline_parallel_size": ((1,), "no pipeline parallelism (tensor_parallel_size "
                                     "splits the model)"),
    "enable_expert_parallel": ((False,), "experts are split by tensor parallelism"),
    "calculate_kv_scales": ((False,), "the FP8 KV cache has a scale of 1"),
    "config_format": (("auto", "hf"), "config.json (or the GGUF's metadata) is read"),
    "disable_sliding_window": ((False,), "sliding windows are always honoured"),
    "model_impl": (("auto", "vllm"), "minivllm's own model code runs"),
    "allowed_local_media_path": (("",), "text-only models read no media"),
    "scheduling_policy": (("fcfs",), "requests run first come, first served"),
    "logprobs_mode": (("raw_logprobs",), "logprobs are the raw logits' log-softmax"),
}


def engine_kwargs(kwargs: dict) -> dict:
    """LLM(**kwargs)'s EngineConfig arguments: vLLM's that change nothing here
    (VLLM_ONLY_ARGUMENTS, at their neutral values) dropped; ValueError naming any other
    argument, or a value that asks for something minivllm does not do."""
    from dataclasses import fields
    names = {f.name for f in fields(EngineConfig)}
    out = {}
    for name, value in kwargs.items():
        if name in names:
            out[name] = value
            continue
        if name not in VLLM_ONLY_ARGUMENTS:
            raise ValueError(f"LLM got the argument {name!r}, which minivllm does not "
                             "support (neither one of its engine arguments nor one of "
                             "vLLM's it accepts).")
        accepted, why = VLLM_ONLY_ARGUMENTS[name]
        if accepted is not ANY and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool)
                for v in accepted):
            raise ValueError(f"minivllm does not support {name}={value!r} ({why}); it "
                             f"accepts only {' or '.join(repr(v) for v in accepted)}.")
    return out


def load_config_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)
