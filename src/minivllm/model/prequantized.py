"""Checkpoints quantized ahead, read into QuantizedLinear's layouts: GPTQ, AWQ and
compressed-tensors 4-bit (int4), and FP8 (fp8).

FP8: each projection's `weight` in float8_e4m3fn [out, in] with a `weight_scale`, one for
the tensor or one per output channel: quant_method "fp8" (vLLM's / AutoFP8's) without
block scales, or "compressed-tensors" (llm-compressor) with 8-bit float weights by tensor
or channel. An `input_scale` (static activation scales) is not used: activations get
per-token scales computed each step, as with quantization="fp8".
Block-wise FP8 (weight_block_size [128, 128], as DeepSeek and Qwen publish, the scales in
`weight_scale_inv` [out / 128, in / 128]; compressed-tensors' "block" strategy, in
`weight_scale`): the engine has no block-scaled kernels, so these weights are dequantized
at load, to the model dtype (layout "dense"), and run as a full-precision model, or
quantized again per channel with quantization="fp8".

Both store, per projection, int32 words of eight 4-bit weights, int32 words of eight
4-bit zero points and a [groups, out] scale tensor (fp16), for groups of `group_size`
inputs:
  GPTQ (quant_method "gptq", AutoGPTQ / GPTQModel): qweight [in / 8, out], packed along
       the input dimension (nibble j of word r is input 8r + j); qzeros [groups, out / 8],
       packed along the output dimension. checkpoint_format "gptq" (v1, the default)
       stores each zero point minus one; "gptq_v2" stores it as it is. g_idx [in] maps an
       input to its group: in input order (desc_act false), or in the order the inputs
       were quantized (desc_act true, "act-order"): there the inputs are reordered at
       load so that each group's are adjacent, and the layer reorders its input the same
       way each step (QuantizedLinear.input_perm).
  AWQ  (quant_method "awq", version "gemm"): qweight [in, out / 8] and qzeros
       [groups, out / 8], both packed along the output dimension in the order
       AWQ_ORDER (nibble i of word c is output 8c + AWQ_ORDER[i]).
  compressed-tensors (llm-compressor's W4A16, format "pack-quantized"): weight_packed
       [out, in / 8] packed along the input dimension (nibble j of word c is input 8c + j),
       each code stored as q + 8 for q in [-8, 7]; weight_scale [out, groups] (one group:
       [out, 1]); weight_shape [out, in]; weight_zero_point [out / 8, groups] packed along
       the output dimension (stored the same way) for an asymmetric scheme, none (zero) for
       a symmetric one; weight_g_idx with activation ordering (actorder "group": read
       as GPTQ's act-order g_idx).
Weight (k, n) = (q - zero) * scale of its group, as in the int4 layout (which holds it
as csrc_triton/int4_layout.py's bytes, [out, groups] scales and zero points).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantization import int4_half, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Each int4 format's tensors of a projection: those it needs, then those it may also have.
PARTS = {"gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
         "awq": (("qweight", "qzeros", "scales"), ()),
         "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"),
                                ("weight_zero_point", "weight_g_idx"))}
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj")


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "gptq", "awq", "compressed-tensors" (its int4) or "fp8"
    group_size: int = 0  # int4's; -1: one group over all inputs
    zero_offset: int = 0  # added to the stored zero points (GPTQ v1: 1)
    zero_points: bool = True  # stored (a symmetric compressed-tensors scheme has none)
    act_order: bool = False  # GPTQ desc_act: groups follow g_idx, not the input order
    block: tuple[int, int] | None = None  # block-wise FP8's [out, in] block
    bits: int = 4  # an integer scheme's (compressed-tensors: 4 or 8)

    @property
    def layout(self) -> str:
        if self.block is not None:
            return "dense"
        if self.method == "fp8":
            return "fp8"
        return "int8" if self.bits == 8 else "int4"


def checkpoint_quantization(raw_cfg: dict) -> CheckpointQuantization | None:
    """The checkpoint's quantization (config.json's quantization_config), validated; None
    for a full-precision checkpoint. ValueError says what cannot be read."""
    qc = raw_cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fp8":
        block = qc.get("weight_block_size")
        return CheckpointQuantization("fp8", block=_block(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method not in ("gptq", "awq"):
        raise ValueError(f"This checkpoint is quantized ({method!r}); minivllm reads GPTQ, "
                         "AWQ, compressed-tensors (W4A16, FP8) and FP8 checkpoints and "
                         "full-precision ones, which it can quantize at load "
                         "(quantization='fp8', 'int8' or 'int4').")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights: only 4 bits are read.")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: 'gptq' or 'gptq_v2' are read.")
        return CheckpointQuantization("gptq", group, 1 if fmt == "gptq" else 0,
                                      act_order=bool(qc.get("desc_act")))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or qc.get("zero_point") is False:
        raise ValueError(f"AWQ checkpoint of version {version!r} (zero_point "
                         f"{qc.get('zero_point')}): only 'gemm' with zero points is read.")
    return CheckpointQuantization("awq", group, 0)


def _compressed_tensors(qc: dict) -> CheckpointQuantization:
    """llm-compressor's config, read when its groups share one scheme of these: 8-bit float
    weights by tensor, channel or block (activations, if at all, to 8-bit floats); 4-bit
    integer weights by group or channel, packed ("pack-quantized"), activations left
    alone (W4A16); symmetric 8-bit integer weights by channel (W8A16, or W8A8 whose int8
    activations are not applied); and when no decoder projection is left unquantized."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups.")
    for entry in qc.get("ignore") or ():
        if any(p in entry for p in PROJECTION_NAMES):
            raise ValueError(f"compressed-tensors checkpoint that leaves {entry!r} unquantized: "
                             "only checkpoints with every decoder projection quantized are read.")
    schemes = set()
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if (w.get("type") == "float" and w.get("num_bits") == 8
                and w.get("strategy") in ("tensor", "channel", "block")
                and (a is None or (a.get("type") == "float" and a.get("num_bits") == 8))):
            schemes.add(("fp8", _block(w["block_structure"]) if w["strategy"] == "block"
                         else None))
        elif (w.get("type") == "int" and w.get("num_bits") == 4 and a is None
              and w.get("strategy") in ("group", "channel")
              and g.get("format", qc.get("format")) == "pack-quantized"):
            group = w.get("group_size") if w.get("strategy") == "group" else -1
            schemes.add(("int4", group, bool(w.get("symmetric", True)),
                         w.get("actorder") == "group"))
        elif (w.get("type") == "int" and w.get("num_bits") == 8
              and w.get("strategy") == "channel" and w.get("symmetric", True)
              and (a is None or (a.get("type") == "int" and a.get("num_bits") == 8))):
            schemes.add(("int8",))  # W8A16, or W8A8 run with its activations unquantized
        else:
            raise ValueError("compressed-tensors checkpoint with a scheme other than 8-bit "
                             "float weights by tensor or channel, 4-bit integer weights by "
                             "group or channel without activation quantization, or "
                             f"symmetric 8-bit integer weights by channel: {w or g}.")
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors checkpoint with several schemes: {sorted(schemes)}.")
    scheme = schemes.pop()
    if scheme[0] == "fp8":
        return CheckpointQuantization("fp8", block=scheme[1])
    if scheme[0] == "int8":
        return CheckpointQuantization("compressed-tensors", bits=8)
    _, group, symmetric, act_order = scheme
    return CheckpointQuantization("compressed-tensors", group, zero_points=not symmetric,
                                  act_order=act_order)


def _block(size) -> tuple[int, int]:
    if not (isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(x, int) and x > 0 for x in size)):
        raise ValueError(f"FP8 block size {size!r}: two positive integers [out, in] are read.")
    return int(size[0]), int(size[1])


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int]) -> torch.Tensor:
    """Block-wise FP8 -> fp32 [out, in]: each [block] tile of e4m3 times its scale."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 checkpoint weight of dtype {weight.dtype}: e4m3 is read.")
    out_f, in_f = weight.shape
    need = (-(-out_f // block[0]), -(-in_f // block[1]))
    if tuple(scale.shape) != need:
        raise ValueError(f"Block scales of shape {tuple(scale.shape)} for a [{out_f}, {in_f}] "
                         f"weight in blocks of {list(block)}: {list(need)} expected.")
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * full[:out_f, :in_f]


def to_fp8_layout(parts: dict[str, torch.Tensor], out_features: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's fp8 weight and its per-tensor or per-channel scale -> (e4m3 [out,
    in], fp32 scale [out])."""
    weight, scale = parts["weight"], parts["weight_scale"].float().reshape(-1)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 checkpoint weight of dtype {weight.dtype}: e4m3 is read.")
    if scale.numel() == 1:
        scale = scale.expand(out_features)
    if scale.numel() != out_features:
        raise ValueError(f"weight_scale of {scale.numel()} values for {out_features} outputs.")
    return weight, scale.contiguous()


def to_int8_layout(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' 8-bit integer weights by channel -> (int8 [out, in], fp32 scale
    [out]): stored as int8 (`weight`, "int-quantized" / "naive-quantized"), or four to an
    int32 word along the input, each stored as q + 128 ("pack-quantized")."""
    if "weight" in parts:
        q = parts["weight"]
    else:
        out_f, in_f = (int(x) for x in parts["weight_shape"].reshape(-1).tolist())
        words = parts["weight_packed"]
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
        stored = (words[:, :, None] >> shifts) & 0xFF  # byte i of word c: input 4c + i
        q = (stored.reshape(words.shape[0], -1)[:out_f, :in_f] - 128).to(torch.int8)
    scale = parts["weight_scale"].float().reshape(-1)
    if scale.numel() != q.shape[0]:
        raise ValueError(f"weight_scale of {scale.numel()} values for {q.shape[0]} outputs.")
    return q.contiguous(), scale.contiguous()


def unpack_along_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int [8R, C]: nibble j of row r becomes row 8r + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, words.shape[1])


def unpack_along_columns(words: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> int [R, 8C]: nibble i of column c becomes column 8c + order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, nibble]
    inverse = [order.index(j) for j in range(8)]
    return q[:, :, inverse].reshape(words.shape[0], -1)


def to_int4_layout(quant: CheckpointQuantization, parts: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, ...]:
    """One projection's checkpoint tensors -> (packed uint8 in quantization.pack_int4's
    layout, scale [out, groups] fp32, zero [out, groups] uint8), and with act-order the
    input order of the packed rows (int64 [in]: packed input j is input perm[j])."""
    if quant.method == "compressed-tensors":
        return _compressed_int4_layout(quant, parts)
    scales = parts["scales"].float()
    if quant.method == "gptq":
        q = unpack_along_rows(parts["qweight"])
        zeros = unpack_along_columns(parts["qzeros"]) + quant.zero_offset
    else:
        q = unpack_along_columns(parts["qweight"], AWQ_ORDER)
        zeros = unpack_along_columns(parts["qzeros"], AWQ_ORDER)
    in_f, out_f = q.shape
    groups = scales.shape[0]
    zeros = zeros[:, :out_f]
    if in_f % groups:
        raise ValueError(f"{groups} groups of scales do not divide {in_f} inputs.")
    group = in_f // groups
    perm = _group_order(parts["g_idx"], in_f, group) if quant.act_order else None
    if perm is not None:
        q = q[perm.to(q.device)]
    layout = (pack_int4(q.t().contiguous().to(torch.uint8), int4_half(group, in_f)),
              scales.t().contiguous(), zeros.t().contiguous().to(torch.uint8))
    return layout if perm is None else layout + (perm,)


def _group_order(g_idx: torch.Tensor, in_f: int, group: int) -> torch.Tensor:
    """Act-order: the inputs ordered by group (int64 [in]), each group's `group` inputs
    adjacent (the last group may be short)."""
    g_idx = g_idx.long().cpu()
    perm = torch.argsort(g_idx, stable=True)
    if len(g_idx) != in_f or not torch.equal(g_idx[perm], torch.arange(in_f) // group):
        raise ValueError(f"g_idx does not put {group} inputs in each group of {in_f} inputs.")
    return perm


def _compressed_int4_layout(quant: CheckpointQuantization, parts: dict[str, torch.Tensor]
                            ) -> tuple[torch.Tensor, ...]:
    """compressed-tensors' W4A16 tensors -> the int4 layout: its stored codes (q + 8) and
    zero points (z + 8) are the layout's unsigned codes and zero points as they are."""
    out_f, in_f = (int(x) for x in parts["weight_shape"].reshape(-1).tolist())
    codes = unpack_along_columns(parts["weight_packed"])[:out_f, :in_f]
    group = quant.group_size if quant.group_size > 0 else in_f
    perm = _group_order(parts["weight_g_idx"], in_f, group) if quant.act_order else None
    if perm is not None:
        codes = codes[:, perm.to(codes.device)]
    scales = parts["weight_scale"].float().reshape(out_f, -1)
    if scales.shape[1] != -(-in_f // group):
        raise ValueError(f"weight_scale of {scales.shape[1]} groups for {in_f} inputs in "
                         f"groups of {group}.")
    if quant.zero_points:
        zeros = unpack_along_rows(parts["weight_zero_point"])[:out_f]
    else:
        zeros = torch.full_like(scales, 8)
    if zeros.shape != scales.shape:
        raise ValueError(f"weight_zero_point of shape {tuple(zeros.shape)} for scales of "
                         f"shape {tuple(scales.shape)}.")
    layout = (pack_int4(codes.contiguous().to(torch.uint8), int4_half(group, in_f)),
              scales.contiguous(), zeros.contiguous().to(torch.uint8))
    return layout if perm is None else layout + (perm,)


class PackedParts:
    """Collects each projection's parts as the checkpoint yields them (in any order) and
    hands back its layout once they have all come (qweight, qzeros and scales; FP8:
    weight and weight_scale)."""

    def __init__(self, quant: CheckpointQuantization) -> None:
        self.quant = quant
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def split(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        """'...q_proj.qweight' -> ('...q_proj', 'qweight'); None for other tensors (an FP8
        checkpoint's quantized weights are its float8 ones)."""
        prefix, _, part = name.rpartition(".")
        if self.quant.method == "fp8":
            if part in ("weight_scale", "weight_scale_inv", "input_scale") or (
                    part == "weight" and tensor.dtype == torch.float8_e4m3fn):
                return prefix, part
            return None
        if self.quant.layout == "int8":
            if part in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                        "input_scale", "input_zero_point") or (
                    part == "weight" and tensor.dtype == torch.int8):
                return prefix, part
            return None
        needed, optional = PARTS[self.quant.method]
        return (prefix, part) if part in needed + optional else None

    def add(self, prefix: str, part: str, tensor: torch.Tensor):
        """The layout of `prefix` once complete (block-wise FP8: the dequantized weight, a
        tensor), else None. Without act-order a GPTQ g_idx is checked on its own (the
        plain input order) and not kept; an FP8 input_scale is dropped."""
        if part in ("input_scale", "input_zero_point"):
            return None
        if part == "weight_zero_point" and (not self.quant.zero_points
                                            or self.quant.layout == "int8"):
            if tensor.any():  # a symmetric scheme's zero points are zero
                raise ValueError(f"{prefix}.weight_zero_point is not zero in a symmetric "
                                 "scheme.")
            return None
        if part in ("g_idx", "weight_g_idx") and not self.quant.act_order:
            group = self.quant.group_size if self.quant.group_size > 0 else len(tensor)
            if not torch.equal(tensor.long().cpu(), torch.arange(len(tensor)) // group):
                raise ValueError(f"{prefix}.g_idx is not the plain input order (desc_act): "
                                 "not read.")
            return None
        parts = self.pending.setdefault(prefix, {})
        parts[part if part != "weight_scale_inv" else "weight_scale"] = tensor
        layout = self._layout(parts)
        if layout is not None:
            del self.pending[prefix]
        return layout

    def _layout(self, parts: dict[str, torch.Tensor]):
        """The projection's layout once `parts` hold all it needs, else None."""
        quant, have = self.quant, parts.keys()
        if quant.block is not None:
            if {"weight", "weight_scale"} <= have:
                return dequantize_fp8_blocks(parts["weight"], parts["weight_scale"],
                                             quant.block)
            return None
        if quant.layout == "fp8":
            if {"weight", "weight_scale"} <= have:
                return to_fp8_layout(parts, parts["weight"].shape[0])
            return None
        if quant.layout == "int8":
            if "weight_scale" in have and ("weight" in have
                                           or {"weight_packed", "weight_shape"} <= have):
                return to_int8_layout(parts)
            return None
        needed = set(PARTS[quant.method][0])
        if quant.zero_points and quant.method == "compressed-tensors":
            needed.add("weight_zero_point")
        if quant.act_order:
            needed.add("weight_g_idx" if quant.method == "compressed-tensors" else "g_idx")
        return to_int4_layout(quant, parts) if needed <= have else None

    def check_done(self) -> None:
        if self.pending:
            name, parts = next(iter(self.pending.items()))
            raise ValueError(f"Checkpoint has an incomplete quantized projection {name!r} "
                             f"(only {sorted(parts)}).")
