"""Builds a model and fills its weights from safetensors, a GGUF file, or dummy values."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from .layers import RotaryEmbedding
from .registry import MODEL_CLASSES
from .prequantized import PackedParts, checkpoint_quantization
from .quantization import (CHECKPOINT_METHODS, METHODS, QuantizedLinear, check_device,
                           quantize_model, quantized_shells)

logger = logging.getLogger(__name__)


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a checkpoint for this config."""
    return MODEL_CLASSES[cfg.architecture].parameter_shapes(cfg)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' size in memory, from the checkpoint's shapes."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in hf_parameter_shapes(cfg).values()) * elem


def dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights from the config alone (as vLLM's load_format="dummy").

    Normal(0, initializer_range) for matrices and biases, ones for norms: the logits then
    have a realistic spread, so greedy decoding has clear winners and is comparable across
    engines that load the same tensors.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    # Gemma's norms scale by 1 + weight: zeros are its identity, as ones are the others'.
    norm_value = 0.0 if cfg.family.startswith("gemma") else 1.0
    for name, shape in hf_parameter_shapes(cfg).items():
        if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            t = torch.full(shape, norm_value, dtype=torch.float32, device=device)
        elif name.endswith(("ln_1.bias", "ln_2.bias", "ln_f.bias")):
            t = torch.zeros(shape, dtype=torch.float32, device=device)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            t.normal_(0.0, cfg.initializer_range, generator=gen)
        yield name, t.to(dtype)


def safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir}.")
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _weights_for(cfg: ModelConfig, model_path: Path, load_format: str, seed: int,
                 device: torch.device, dtype: torch.dtype):
    if load_format == "dummy":
        return dummy_weights(cfg, seed, dtype, device)
    if load_format == "gguf" or (load_format == "auto" and model_path.suffix == ".gguf"):
        from .gguf_loader import load_gguf_state
        _, tensors = load_gguf_state(model_path)
        return tensors
    model_dir = model_path if model_path.is_dir() else model_path.parent
    return safetensors_weights(model_dir)


def load_model(cfg: ModelConfig, model_path: Path, *, load_format: str, dtype: torch.dtype,
               device: torch.device, max_positions: int, attention_backend: str,
               fused_ops: bool = False, seed: int = 0,
               quantization: str | None = None,
               layer_loaded: Callable[[nn.Module], None] | None = None) -> torch.nn.Module:
    """The model with its weights, its decoder projections quantized if asked
    (model/quantization.py: loaded in `dtype`, then quantized one projection at a time) or
    as the checkpoint has them (GPTQ, AWQ, compressed-tensors, FP8: model/prequantized.py).

    With `layer_loaded` (tensor parallelism cuts each layer to its shard there), each
    decoder layer is allocated when its first weight arrives and handed to `layer_loaded`
    once its last one is in, so the whole model never sits in memory at once: a model
    larger than one GPU loads onto several."""
    ahead = checkpoint_quantization(cfg.raw)
    if ahead is None and quantization in CHECKPOINT_METHODS:
        raise ValueError(f"quantization={quantization!r} reads a checkpoint quantized with "
                         f"{quantization.upper()}; this one has no quantization_config.")
    if ahead is not None:
        # The method, or the checkpoint's own name for it (compressed-tensors' FP8 is fp8);
        # weights dequantized at load take any method of quantization at load.
        names = {ahead.method, cfg.raw["quantization_config"].get("quant_method")}
        if ahead.layout == "dense":
            names |= set(METHODS)
        if quantization not in names | {None}:
            raise ValueError(f"This checkpoint is quantized with {ahead.method.upper()}: "
                             f"quantization must be None or one of {sorted(names)}, got "
                             f"{quantization!r}.")
    if ahead is not None and cfg.moe:
        raise ValueError(f"A mixture of experts quantized with {ahead.method.upper()} is not "
                         "supported yet: load its 16-bit checkpoint, with quantization='fp8' "
                         "to store the experts in fp8.")
    if ahead is not None and ahead.layout == "fp8":
        check_device("fp8", device)  # an FP8 checkpoint needs FP8 tensor cores too
    if ahead is not None and ahead.layout != "int4" and load_format == "dummy":
        # Dummy weights, quantized as they load (block-wise FP8: kept in the model dtype).
        if ahead.layout in ("fp8", "int8"):
            quantization = ahead.layout
        ahead = None
    if ahead is not None and ahead.layout == "dense":
        logger.info("Block-wise FP8 checkpoint: its weights are dequantized to %s at load%s.",
                    str(dtype).removeprefix("torch."),
                    ", then quantized again per channel (fp8)" if quantization == "fp8"
                    else "" if quantization is None else f", then quantized to {quantization}")
    model_cls = MODEL_CLASSES[cfg.architecture]
    # Build on the meta device (no wasted random init), then materialize on the target.
    with torch.device("meta"):
        model = model_cls(cfg, max_positions, attention_backend, fused_ops)
        if ahead is not None and ahead.layout != "dense":
            quantized_shells(model, ahead.layout, ahead.group_size, ahead.act_order)
    if layer_loaded is None:
        # In `dtype` while still on meta: to_empty() first would allocate float32 (twice the
        # bf16 bytes: Qwen3-30B-A3B's 122 GB ran out of an 80 GB GPU before its cast).
        model = model.to(dtype).to_empty(device=device)
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.restore_storage_dtypes()
        if cfg.tie_word_embeddings:  # to_empty() untied them
            model.lm_head.weight = model.input_embeddings().weight
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_tables(device)
    else:
        layers = _decoder_layers(model, cfg)
        # Dummy int4 weights are drawn for the whole model at once, below.
        whole = load_format == "dummy" and ahead is not None
        _materialize(model, device, dtype, skip=set() if whole else set(map(id, layers)))
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {n for n, _ in model.named_buffers() if n.rpartition(".")[2] in
                 ("qweight", "scale", "zero", "bias", "input_perm")}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    weights = _weights_for(cfg, model_path, load_format, seed, device, dtype)
    if load_format == "dummy" and ahead is not None:
        # Random packed weights instead of the full-precision projections.
        weights = ((n, t) for n, t in weights if not _is_projection_weight(n))
        loaded = _fill_int4_dummy(model, cfg, seed)
    else:
        loaded = set()
    if layer_loaded is not None:
        weights = _layer_by_layer(weights, layers,
                                  _checkpoint_names(cfg, model_path, load_format),
                                  layer_loaded, lambda layer: _materialize(layer, device, dtype))
    with torch.no_grad():
        loaded |= model.load_weights(weights, PackedParts(ahead) if ahead is not None else None)
    missing = expected - loaded
    if missing:
        raise ValueError(f"Checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}.")
    if (ahead is None or ahead.layout == "dense") and quantization in METHODS:
        with torch.no_grad():
            quantize_model(model, quantization)
    return model.eval()


_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def _decoder_layers(model: nn.Module, cfg: ModelConfig) -> nn.ModuleList:
    """The model's list of decoder layers (Llama's model.layers, GPT-2's transformer.h)."""
    found = [m for m in model.modules()
             if isinstance(m, nn.ModuleList) and len(m) == cfg.num_layers]
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} has no single list of {cfg.num_layers} "
                         "decoder layers to load one at a time.")
    return found[0]


def _materialize(module: nn.Module, device: torch.device, dtype: torch.dtype,
                 skip: set[int] = frozenset()) -> None:
    """Allocate `module`'s tensors still on the meta device (floating ones in `dtype`), but
    for the submodules whose ids are in `skip`. A tensor shared by several modules (a tied
    head, the layers' one rotary table) stays shared."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta, allocated)

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:  # the meta tensor is kept alive with it: ids stay unique
            new = torch.empty(t.shape, device=device,
                              dtype=dtype if t.is_floating_point() else t.dtype)
            made[id(t)] = t, (nn.Parameter(new, requires_grad=False)
                              if isinstance(t, nn.Parameter) else new)
        return made[id(t)][1]

    def visit(m: nn.Module) -> None:
        if id(m) in skip:
            return
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = real(p)
        rebuilt = False
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name], rebuilt = real(b), True
        if rebuilt and isinstance(m, RotaryEmbedding):
            m.reset_tables(device)
        if rebuilt and isinstance(m, QuantizedLinear):
            m.restore_storage_dtypes()
        for child in m.children():
            visit(child)

    visit(module)


def _checkpoint_names(cfg: ModelConfig, model_path: Path, load_format: str) -> list[str]:
    """The names of the tensors the checkpoint holds (read from its index or its files'
    headers), or those of hf_parameter_shapes where it cannot tell (dummy, GGUF)."""
    if load_format != "dummy" and model_path.suffix != ".gguf" and load_format != "gguf":
        model_dir = model_path if model_path.is_dir() else model_path.parent
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            return list(json.loads(index.read_text())["weight_map"])
        from safetensors import safe_open
        names = []
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                names += list(f.keys())
        return names
    return list(hf_parameter_shapes(cfg))


def _layer_by_layer(weights, layers: nn.ModuleList, names: list[str], layer_loaded,
                    materialize):
    """`weights`, each decoder layer allocated before its first tensor and handed to
    `layer_loaded` once the tensors of `names` for it are all in (a layer whose names never
    all arrive is handed over at the end)."""
    pending: dict[int, set[str]] = {}
    for name in names:
        if (m := _LAYER_INDEX.search(name)) is not None:
            pending.setdefault(int(m.group(1)), set()).add(name)
    opened: set[int] = set()
    for name, tensor in weights:
        m = _LAYER_INDEX.search(name)
        i = int(m.group(1)) if m is not None else None
        if i is not None and i not in opened:
            materialize(layers[i])
            opened.add(i)
        yield name, tensor
        # Resumed: the consumer has copied the tensor into the layer.
        if i is not None and i in pending:
            pending[i].discard(name)
            if not pending[i]:
                del pending[i]
                layer_loaded(layers[i])
    for i in sorted(opened & pending.keys()):
        layer_loaded(layers[i])


_PROJECTION_NAMES = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.",
                     ".down_proj.")


def _is_projection_weight(name: str) -> bool:
    return name.endswith(".weight") and any(p in name for p in _PROJECTION_NAMES)


def _fill_int4_dummy(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> set[str]:
    """Random int4 weights for a quantized checkpoint's config with load_format="dummy":
    uniform codes around a zero point of 8, scaled so the weights' spread is the config's
    initializer_range. Returns the buffers filled."""
    gen = torch.Generator(device=next(model.buffers()).device).manual_seed(seed)
    filled = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=gen,
                                          dtype=torch.uint8, device=layer.qweight.device))
        layer.scale.fill_(cfg.initializer_range / 4.6)  # uniform codes 0..15: std ~4.6
        layer.zero.fill_(8)
        filled |= {f"{name}.qweight", f"{name}.scale", f"{name}.zero"}
        if layer.input_perm is not None:
            layer.input_perm.copy_(torch.arange(layer.in_features))
            filled.add(f"{name}.input_perm")
    return filled
