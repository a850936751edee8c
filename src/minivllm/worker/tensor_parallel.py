"""Tensor parallelism: one model split over N processes, the engine in the first.

Rank 0 is the engine's own process: it schedules, samples and runs its shard of every
forward; ranks 1..N-1 are worker processes that hold the other shards and their part of
the KV cache. Before each forward rank 0 broadcasts the step's inputs (token ids,
positions, attention metadata); every rank runs the same forward on its shard, and the
row-parallel projections' partial sums are all-reduced, so that every rank ends the
forward with the same hidden states; the sampler runs on rank 0 only.

The split (Megatron's): q/k/v and gate/up column-parallel (each rank its heads and its
slice of the MLP's inner width), o and down row-parallel with an all-reduce; KV heads
split, or replicated where there are fewer than ranks. The embedding and the head are
split by vocabulary: each rank embeds the ids in its slice (zeros elsewhere, summed over
the ranks) and computes its slice of the logits, which rank 0 gathers. Each engine has
process groups of its own, so several engines can live in one process: gloo over TCP
carries the step inputs (and, on the CPU, the all-reduces); on GPUs each rank has a GPU of
its own (the engine's, then the next ones on its node) and the all-reduces go through
NCCL.

The graphed steps (worker/cuda_graph_runner.py, mixed_graph_runner.py) run on every rank:
each rank captures the same graphs, whose first kernels broadcast rank 0's step inputs
(NCCL, on the device) into every rank's static buffers, and whose all-reduces and logits
gather are NCCL kernels inside them. Rank 0 then tells the workers which graph to replay
with a header of a few ints (gloo); eager steps send their inputs as a pickled object.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import multiprocessing
import multiprocessing.util
import pickle
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(minutes=10)

# Every message from rank 0 to the workers starts with a header of _HEADER ints: the size
# of a pickled object that follows (>= 0), or -Replay and the replay's ints.
_HEADER = 8


class Replay(enum.IntEnum):
    """A graphed step the workers run in step with rank 0 (its inputs come by NCCL)."""

    DECODE = 1       # ints: the batch bucket
    MIXED = 2        # the token bucket
    MIXED_EAGER = 3  # tokens, sequences, sampled rows, longest query, longest sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """The process groups of `world` ranks rendezvousing at host:port: gloo (step inputs,
    and the CPU's all-reduces) and, for ranks on a GPU, NCCL (the GPUs' all-reduces)."""

    def __init__(self, rank: int, world: int, host: str, port: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.rank, self.world, self.device = rank, world, device
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=_TIMEOUT)
        self.pg = dist.ProcessGroupGloo(store, rank, world, _TIMEOUT)
        self.nccl = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        # NCCL's wait() orders the current stream after the sum; the host goes on.
        (self.nccl if t.is_cuda else self.pg).allreduce([t]).wait()
        return t

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype), in place."""
        (self.nccl if t.is_cuda else self.pg).broadcast([t], dist.BroadcastOptions()).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape on each), stacked in rank order: [world, *shape].
        One output tensor, not a list: NCCL gathers straight into it, also in a graph."""
        out = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        (self.nccl if t.is_cuda else self.pg)._allgather_base(out, t.contiguous()).wait()
        return out.view(self.world, *t.shape)

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's `ok` is true."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        self.pg.allreduce([flag], dist.AllreduceOptions(reduceOp=dist.ReduceOp.MIN)).wait()
        return bool(flag.item())

    def broadcast_arrays(self, arrays, table_rows: int) -> None:
        """Rank 0's step inputs (a cuda_graph_runner.PackedArrays, up to table row
        `table_rows`) into every rank's: two broadcasts on the device, which the graphs
        capture."""
        for t in arrays.filled(table_rows):
            self.broadcast_tensor(t)

    def _header(self, values: tuple[int, ...] = ()) -> list[int]:
        # On the CPU whatever the default device: a dropped LLM's workers are stopped
        # from its finalizer, which may run under a model build's meta device.
        header = torch.zeros(_HEADER, dtype=torch.int64, device="cpu")
        header[:len(values)] = torch.tensor(values, dtype=torch.int64, device="cpu")
        self.pg.broadcast([header], dist.BroadcastOptions()).wait()
        return header.tolist()

    def send_replay(self, kind: Replay, *ints: int) -> None:
        """Rank 0: tell the workers to run this graphed step."""
        self._header((-kind, *ints))

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank, its tensors on this rank's device (they travel
        pickled, through the host). Workers wait for messages with `receive`."""
        if self.rank != 0:
            return self.receive()
        obj = moved(obj, torch.device("cpu"))
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._header((data.numel(),))
        self.pg.broadcast([data], dist.BroadcastOptions()).wait()
        return obj

    def receive(self):
        """A worker: rank 0's next message, an object or ("replay", Replay, ints)."""
        header = self._header()
        if header[0] < 0:
            return ("replay", Replay(-header[0]), header[1:])
        data = torch.empty(header[0], dtype=torch.uint8)
        self.pg.broadcast([data], dist.BroadcastOptions()).wait()
        return moved(pickle.loads(data.numpy().tobytes()), self.device)


def moved(obj, device: torch.device):
    """`obj` with every tensor in it (in tuples, lists and dataclasses such as
    AttentionMetadata) on `device`; tensors already there are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(moved(o, device) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def rank_device(cfg, rank: int) -> torch.device:
    """Where `rank` runs: the CPU, or on GPUs the engine's GPU plus the rank's place on its
    node (rank 0 on cuda:0, rank 1 on cuda:1, ... by default)."""
    from ..config import resolve_device
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return device
    per_node = cfg.tensor_parallel_size // max(cfg.nnodes, 1)
    return torch.device("cuda", (device.index or 0) + rank % per_node)


# ---- splitting a model ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: query heads [q0, q0 + q), KV heads [kv0, kv0 +
    kv); of an MLP of inner width W, the columns [rank * W / world, ...)."""

    q0: int
    q: int
    kv0: int
    kv: int
    rank: int
    world: int

    def columns(self, width: int) -> tuple[int, int]:
        """(first, count) of this rank's inner columns of an MLP `width` wide."""
        if width % self.world:
            raise ValueError(f"tensor_parallel_size={self.world} must divide the MLPs' "
                             f"width ({width}).")
        size = width // self.world
        return self.rank * size, size

    @classmethod
    def of(cls, cfg, rank: int, world: int) -> "Shard":
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        if hq % world:
            raise ValueError(f"tensor_parallel_size={world} must divide the attention heads "
                             f"({hq}).")
        if hkv >= world:
            if hkv % world:
                raise ValueError(f"tensor_parallel_size={world} must divide the KV heads "
                                 f"({hkv}), or be a multiple of them.")
            kv, kv0 = hkv // world, rank * (hkv // world)
        else:
            if world % hkv:
                raise ValueError(f"tensor_parallel_size={world} must be a multiple of the "
                                 f"KV heads ({hkv}) when larger.")
            kv, kv0 = 1, rank // (world // hkv)
        q = hq // world
        shard = cls(rank * q, q, kv0, kv, rank, world)
        widths = [cfg.intermediate_size]
        if cfg.moe:
            widths += [cfg.moe["intermediate_size"], cfg.moe["shared_intermediate_size"] or world]
        for width in widths:
            shard.columns(width)
        return shard


def check_tp(cfg, engine_cfg, device: torch.device) -> None:
    world = engine_cfg.tensor_parallel_size
    if world == 1:
        return
    if device.type == "cuda":
        last = rank_device(engine_cfg, world // max(engine_cfg.nnodes, 1) - 1)
        if last.index >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world} puts a rank on each GPU of a node "
                             f"from {device}: this host has {torch.cuda.device_count()} GPUs.")
    from ..model.prequantized import checkpoint_quantization
    ahead = checkpoint_quantization(cfg.raw or {})
    if ahead is not None and ahead.act_order:
        raise ValueError("A GPTQ checkpoint with act-order (desc_act) cannot be split over "
                         "tensor-parallel ranks: its groups gather inputs from the whole row.")
    Shard.of(cfg, 0, world)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + len(weight)) of an embedding (the last rank's
    padded with zeros): ids outside them embed as zeros, and the sum over the ranks is
    the whole table's lookup."""

    def __init__(self, weight: nn.Parameter, start: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return self.group.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def load_shard(model_cfg, model_path, engine_cfg, dtype, device, backend: str, group,
               fused_ops: bool = False) -> nn.Module:
    """This rank's shard: each decoder layer cut down as soon as its weights are in (so a
    rank never holds more than its shard and a layer or two of the whole model), quantized
    if asked once all are in (the scales are the shard's own: a row-parallel projection's
    come from its columns), then the vocabulary."""
    from ..model.loader import load_model
    s = Shard.of(model_cfg, group.rank, group.world)
    model = load_model(model_cfg, model_path, load_format=engine_cfg.load_format, dtype=dtype,
                       device=device, max_positions=engine_cfg.max_model_len,
                       attention_backend=backend, fused_ops=fused_ops, seed=engine_cfg.seed,
                       quantization=engine_cfg.quantization,
                       layer_loaded=lambda layer: shard_layer(layer, model_cfg, s, group))
    _shard_vocab(model, model_cfg, group)
    return model


def _column_parallel(linear: nn.Module, pieces: list[tuple[int, int]]) -> None:
    """`linear` cut to these (first, count) output rows, its bias likewise (a checkpoint's
    quantized layer: its weights, scales and zero points by output row too)."""
    from ..model.quantization import QuantizedLinear
    quantized = isinstance(linear, QuantizedLinear)
    for name in ("qweight", "scale", "zero", "bias") if quantized else ("weight", "bias"):
        t = getattr(linear, name, None)
        if t is not None:
            rows = torch.cat([t.data[a:a + n] for a, n in pieces])
            setattr(linear, name, rows if quantized else nn.Parameter(rows, requires_grad=False))
    linear.out_features = sum(n for _, n in pieces)


def _input_columns(linear: nn.Module, columns: tuple[int, int], s: Shard) -> nn.Module:
    """`linear` cut to its input columns (first, count) of a row-parallel product, its
    bias kept on rank 0 only (the sum over the ranks adds it once)."""
    from ..model.quantization import QuantizedLinear
    first, count = columns
    quantized = isinstance(linear, QuantizedLinear)  # its tensors are buffers
    if quantized:
        _quantized_input_columns(linear, first, count)
    else:
        linear.weight = nn.Parameter(linear.weight.data[:, first:first + count].contiguous(),
                                     requires_grad=False)
    linear.in_features = count
    if linear.bias is not None and s.rank:
        bias = torch.zeros_like(linear.bias)
        linear.bias = bias if quantized else nn.Parameter(bias, requires_grad=False)
    return linear


def _quantized_input_columns(linear: nn.Module, first: int, count: int) -> None:
    """A checkpoint's quantized layer cut to inputs [first, first + count): per-channel
    weights by column; 4-bit ones unpacked, cut at group boundaries, packed again (never
    act-order ones, which check_tp refuses)."""
    from ..model.quantization import int4_half, pack_int4, unpack_int4
    if linear.method != "int4":
        linear.qweight = linear.qweight[:, first:first + count].contiguous()
        return
    k, group = linear.in_features, linear.group_size
    codes = unpack_int4(linear.qweight, k, int4_half(group, k))[:, first:first + count]
    if group >= k:  # one group a row: each rank's part of it keeps the row's scale
        group = count
    elif first % group or count % group:
        raise ValueError(f"tensor_parallel_size splits a 4-bit layer's {k} inputs into "
                         f"parts of {count}, not a multiple of its groups of {group}.")
    else:
        groups = slice(first // group, (first + count) // group)
        linear.scale = linear.scale[:, groups].contiguous()
        linear.zero = linear.zero[:, groups].contiguous()
    linear.qweight = pack_int4(codes.contiguous(), int4_half(group, count))
    linear.group_size = group


def _shard_attention(module: nn.Module, cfg, s: Shard, group: TPGroup) -> None:
    """q/k/v column-parallel (this rank's heads), o row-parallel."""
    d = cfg.head_dim
    q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
    _column_parallel(module.qkv_proj, [(s.q0 * d, s.q * d), (q_all + s.kv0 * d, s.kv * d),
                                       (q_all + kv_all + s.kv0 * d, s.kv * d)])
    module.o_proj = RowParallel(_input_columns(module.o_proj, (s.q0 * d, s.q * d), s), group)
    module.num_heads, module.num_kv_heads = s.q, s.kv
    module.q_size, module.kv_size = s.q * d, s.kv * d
    module.attn.num_heads, module.attn.num_kv_heads = s.q, s.kv


def _shard_gpt2_block(block: nn.Module, cfg, s: Shard, group: TPGroup) -> None:
    """GPT-2's fused c_attn (q, k and v, as many heads each) by heads and its c_fc by
    columns; the two c_proj row-parallel."""
    attn, mlp, d, h = block.attn, block.mlp, cfg.head_dim, cfg.hidden_size
    _column_parallel(attn.c_attn, [(part * h + s.q0 * d, s.q * d) for part in range(3)])
    attn.c_proj = RowParallel(_input_columns(attn.c_proj, (s.q0 * d, s.q * d), s), group)
    attn.num_heads = attn.attn.num_heads = attn.attn.num_kv_heads = s.q
    columns = s.columns(cfg.intermediate_size)
    _column_parallel(mlp.c_fc, [columns])
    mlp.c_proj = RowParallel(_input_columns(mlp.c_proj, columns, s), group)


def _shard_gated(mlp: nn.Module, s: Shard) -> None:
    """gate/up column-parallel, down's input columns to match (its sum not reduced here)."""
    width = mlp.gate_up_proj.out_features // 2
    i0, i = s.columns(width)
    _column_parallel(mlp.gate_up_proj, [(i0, i), (width + i0, i)])
    _input_columns(mlp.down_proj, (i0, i), s)


def _shard_experts(moe: nn.Module, s: Shard) -> None:
    """Every expert's inner columns split like a dense MLP's; the router replicated."""
    width = moe.w13.shape[1] // 2
    i0, i = s.columns(width)
    w13, w2 = moe.w13.data, moe.w2.data
    moe.w13 = nn.Parameter(torch.cat([w13[:, i0:i0 + i], w13[:, width + i0:width + i0 + i]],
                                     dim=1).contiguous(), requires_grad=False)
    moe.w2 = nn.Parameter(w2[:, :, i0:i0 + i].contiguous(), requires_grad=False)
    if moe.shared_expert is not None:
        _shard_gated(moe.shared_expert, s)


def vocab_slice(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """(first id, rows) of `rank`'s slice of a vocabulary: equal slices, the last one
    padded past the vocabulary (so the ranks' logits gather as equal pieces)."""
    rows = -(-vocab // world)
    return rank * rows, rows


def _shard_vocab(model: nn.Module, cfg, group: TPGroup) -> None:
    """The embedding and the head cut to this rank's vocabulary slice (one tensor where
    they are tied)."""
    start, rows = vocab_slice(cfg.vocab_size, group.rank, group.world)

    def cut(w: torch.Tensor) -> nn.Parameter:
        part = w[start:start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], w.shape[1])])
        return nn.Parameter(part.contiguous(), requires_grad=False)

    embedding = model.input_embeddings()
    tied = model.lm_head.weight is embedding.weight
    weight = cut(embedding.weight.data)
    for module in model.modules():
        for name, child in list(module.named_children()):
            if child is embedding:
                setattr(module, name, VocabParallelEmbedding(weight, start, group))
    model.lm_head.weight = weight if tied else cut(model.lm_head.weight.data)
    model.lm_head.out_features = rows


def shard_layer(layer: nn.Module, cfg, s: Shard, group: TPGroup) -> None:
    """Cut a loaded decoder layer down to this rank's shard, in place: its attention (any
    module with qkv_proj, o_proj and attn) and its MLP (dense: down all-reduced; a mixture
    of experts: its whole output all-reduced once)."""
    from ..model.gpt2 import GPT2Block
    from ..model.layers import GatedMLP
    from ..model.moe import MoE
    for module in list(layer.modules()):
        if isinstance(module, GPT2Block):
            _shard_gpt2_block(module, cfg, s, group)
        if all(hasattr(module, a) for a in ("qkv_proj", "o_proj", "attn")):
            _shard_attention(module, cfg, s, group)
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, MoE):
            _shard_experts(mlp, s)
            module.mlp = RowParallel(mlp, group)
        elif isinstance(mlp, GatedMLP):
            _shard_gated(mlp, s)
            mlp.down_proj = RowParallel(mlp.down_proj, group)


def local_config(cfg, rank: int, world: int):
    """The model config as one rank's KV cache sees it (its KV heads)."""
    s = Shard.of(cfg, rank, world)
    return dataclasses.replace(cfg, num_heads=s.q, num_kv_heads=s.kv)


# ---- rank 0 and the workers ----------------------------------------------------------------

def gathered_logits(model: nn.Module, group: TPGroup, hidden: torch.Tensor) -> torch.Tensor:
    """Every rank's slice of the logits of `hidden`'s rows, side by side: [rows, vocab]."""
    pieces = group.all_gather(model.compute_logits(hidden))  # [world, rows, slice]
    rows = pieces.shape[1]
    return pieces.transpose(0, 1).reshape(rows, -1)[:, :model.config.vocab_size]


class ShardModel(nn.Module):
    """This rank's shard as a whole model: its forward's all-reduces leave every rank with
    the same hidden states, and compute_logits gathers the ranks' vocabulary slices. Every
    rank makes the same calls: this is the model the graphed steps run."""

    def __init__(self, model: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = model
        self.group = group

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.inner(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        logits = gathered_logits(self.inner, self.group, hidden)
        return logits if out is None else out.copy_(logits)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


class BroadcastingModel(ShardModel):
    """Rank 0's model for eager steps: each forward first sends its inputs to the workers
    (which run the same forward on their shards), each compute_logits the rows to project
    (the workers add their slices of the vocabulary)."""

    def forward(self, input_ids, positions, kv_caches, meta):
        self.group.broadcast_object(("forward", input_ids, positions, meta))
        return super().forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden.contiguous()
        self.group.broadcast_object(("logits", tuple(hidden.shape), hidden.dtype))
        self.group.broadcast_tensor(hidden)
        return super().compute_logits(hidden, out)


def start_workers(ranks: range, world: int, host: str, port: int, build_args: tuple,
                  daemon: bool = True) -> list:
    """Worker processes for `ranks` (started before rank 0 joins the group)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in ranks:
        p = ctx.Process(target=worker_main, args=(rank, world, host, port, *build_args),
                        daemon=daemon, name=f"minivllm-tp{rank}")
        p.start()
        procs.append(p)
    return procs


def node_ranks(cfg) -> range:
    """The ranks node cfg.node_rank hosts (tensor_parallel_size split over nnodes)."""
    world, nodes = cfg.tensor_parallel_size, cfg.nnodes
    if nodes < 1 or world % nodes or not 0 <= cfg.node_rank < nodes:
        raise ValueError(f"tensor_parallel_size={world} must split evenly over nnodes={nodes}"
                         f", and node_rank must be in 0..{nodes - 1}.")
    per = world // nodes
    return range(cfg.node_rank * per, (cfg.node_rank + 1) * per)


def run_worker_node(cfg, model_cfg, model_path, dtype: torch.dtype, backend: str) -> None:
    """A node other than the engine's: start its ranks' workers and wait for them (they
    end when the engine stops)."""
    if cfg.master_port is None:
        raise ValueError("A worker node needs master_port (--master-port), the port the "
                         "engine's node listens on.")
    procs = start_workers(node_ranks(cfg), cfg.tensor_parallel_size, cfg.master_addr,
                          cfg.master_port, (cfg, model_cfg, model_path, dtype, backend),
                          daemon=False)
    for p in procs:
        p.join()


def stop_workers(group: TPGroup, procs: list) -> None:
    try:
        group.broadcast_object(None)
    except Exception:  # noqa: BLE001 - a worker already gone: nothing to stop
        pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def worker_main(rank: int, world: int, host: str, port: int, engine_cfg, model_cfg,
                model_path, dtype: torch.dtype, backend: str) -> None:
    """A worker: its shard of the model and of the KV cache, then every step rank 0 sends
    (an eager forward, a logits projection, the graphed steps' runners and their
    replays), until it sends None."""
    from ..config import fused_ops_enabled
    from .kv_cache import KVCache
    from .model_runner import step_runners
    device = rank_device(engine_cfg, rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    group = TPGroup(rank, world, host, port, device)
    model = load_shard(model_cfg, model_path, engine_cfg, dtype, device, backend, group,
                       fused_ops_enabled(backend) and device.type == "cuda")
    num_blocks = group.receive()
    kv = KVCache(local_config(model_cfg, rank, world), num_blocks, engine_cfg.block_size,
                 engine_cfg.kv_dtype(dtype), device)
    decode = mixed = None
    with torch.inference_mode():
        while True:
            try:
                step = group.receive()
            except RuntimeError as e:  # rank 0 is gone (its process ended or died)
                logger.info("Tensor-parallel worker %d: rank 0 is gone (%s); exiting.",
                            rank, str(e).splitlines()[0][:120])
                return
            if step is None:
                return
            if step[0] == "replay":
                kind, ints = step[1], step[2]
                if kind == Replay.DECODE:
                    decode.replay(ints[0])
                elif kind == Replay.MIXED:
                    mixed.replay(ints[0])
                else:
                    mixed.eager_step(*ints[:5])
            elif step[0] == "forward":
                model(*step[1:3], kv.layers, step[3])
            elif step[0] == "logits":  # rank 0's rows to project, then this rank's slice
                hidden = group.broadcast_tensor(torch.empty(step[1], dtype=step[2],
                                                            device=device))
                group.all_gather(model.compute_logits(hidden))
            else:  # "runners": build and capture the graphed steps, as rank 0 does
                decode, mixed = step_runners(ShardModel(model, group), kv.layers, engine_cfg,
                                             device, group)


def _while_workers_live(procs: list, join):
    """join() (the group's rendezvous, which waits for every rank), failing at once if a
    worker of this node dies first (a script without a main guard, say) instead of after
    the rendezvous's 10-minute timeout."""
    result: dict = {}

    def run() -> None:
        try:
            result["group"] = join()
        except BaseException as e:  # noqa: BLE001 - raised below
            result["error"] = e

    waiter = threading.Thread(target=run, name="minivllm-tp-join", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
        dead = [p for p in procs if not p.is_alive()]
        if dead and waiter.is_alive():
            for p in procs:
                p.kill()
            raise RuntimeError(f"Tensor-parallel worker {dead[0].name} exited (code "
                               f"{dead[0].exitcode}) before joining the group; its output "
                               "above says why.")
    if "error" in result:
        raise result["error"]
    return result["group"]


class TensorParallel:
    """Rank 0's side: the group, this node's workers, and their shutdown with the engine
    (the other nodes' workers end when they hear it)."""

    def __init__(self, cfg, build_args: tuple) -> None:
        if cfg.node_rank != 0:
            raise ValueError("The engine runs on node 0; other nodes run workers only "
                             "(minivllm serve --node-rank K).")
        ranks = node_ranks(cfg)
        port = cfg.master_port or free_port()
        if cfg.nnodes > 1 and cfg.master_port is None:
            raise ValueError("Several nodes meet at master_addr:master_port: set master_port.")
        self.procs = start_workers(range(1, ranks.stop), cfg.tensor_parallel_size,
                                   cfg.master_addr, port, build_args)
        self.group = _while_workers_live(self.procs, lambda: TPGroup(
            0, cfg.tensor_parallel_size, cfg.master_addr, port, rank_device(cfg, 0)))
        # Also at exit, before multiprocessing terminates the workers (daemons).
        self.stop = multiprocessing.util.Finalize(self, stop_workers,
                                                  (self.group, self.procs), exitpriority=0)
