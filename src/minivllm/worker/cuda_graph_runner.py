"""Decode steps replayed as CUDA graphs over bucketed batch sizes.

A decode batch of n sequences is padded to the smallest bucket >= n. Each bucket has one
graph, captured once, that reads its inputs from static buffers: token ids, sequence
lengths and block tables. Positions and KV slots are derived on the GPU from those, so a
step uploads three small arrays and replays. Padding rows have sequence length 0: their
slot is -1 (nothing stored) and their attention output is zero.

The step function (model + logits + greedy argmax) is captured per bucket, largest first,
all graphs sharing one memory pool. With MINIVLLM_COMPILE=1 it is first compiled once with
torch.compile over a dynamic batch dimension (worker/compilation.py), and every bucket's
graph is captured from that one compiled function.
"""

from __future__ import annotations

import logging
import time

import torch

from ..config import decode_prelude_enabled
from ..model.attention import AttentionMetadata
from .compilation import compile_step
from .sampler import argmax_rows
from .tensor_parallel import Replay

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, then steps of 16 (vLLM-like), capped."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_batch + 16, 16))
    out = sorted({s for s in sizes if s < max_batch} | {max_batch})
    return out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class PackedArrays:
    """A step's inputs packed in two flat buffers, so that a step uploads them in two
    copies, however many arrays it has (each copy costs the host a few microseconds, and
    under serving load the host limits the step). `int64` and `int32` name the arrays of
    each buffer with their lengths; the int32 buffer ends with the block tables
    [table_rows, max_blocks]. The named arrays are attributes (views of the buffers); on
    the host, `NAME_np` are numpy views of them, for cheap fills from Python lists."""

    def __init__(self, int64: dict[str, int], int32: dict[str, int], table_rows: int,
                 max_blocks: int, **where) -> None:
        self.int64 = torch.zeros(sum(int64.values()), dtype=torch.long, **where)
        self.table_start = sum(int32.values())
        self.max_blocks = max_blocks
        self.int32 = torch.zeros(self.table_start + table_rows * max_blocks,
                                 dtype=torch.int32, **where)
        views = {}
        for buf, fields in ((self.int64, int64), (self.int32, int32)):
            at = 0
            for name, size in fields.items():
                views[name] = buf[at:at + size]
                at += size
        views["tables"] = self.int32[self.table_start:].view(table_rows, max_blocks)
        vars(self).update(views)
        if self.int64.device.type == "cpu":
            for name, v in views.items():
                setattr(self, name + "_np", v.numpy())

    def filled(self, table_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a step reads: all of the int64 buffer, the int32 one up to table row
        `table_rows` (the rows past it belong to padding sequences, which have length 0
        and read no table)."""
        return self.int64, self.int32[:self.table_start + table_rows * self.max_blocks]

    def copy_to(self, dst: "PackedArrays", table_rows: int) -> None:
        """Queue the two copies of what a step reads into dst (same layout)."""
        for src, to in zip(self.filled(table_rows), dst.filled(table_rows)):
            to.copy_(src, non_blocking=True)


def decode_arrays(max_batch: int, max_blocks: int, **where) -> PackedArrays:
    """A decode step's inputs: token ids and the previous step's rows to take them from on
    the device (int64); sequence lengths and block tables (int32)."""
    return PackedArrays({"ids": max_batch, "index": max_batch}, {"lens": max_batch},
                        max_batch, max_blocks, **where)


class DecodeInputs:
    """Host-side staging and device-side static buffers.

    Two staging sets alternate: with pipelined decoding the host fills step N+1's inputs
    before step N's asynchronous copies are known to have run, so it must not overwrite
    the set that step N's copies read (the host last waited for step N-1, whose set is
    the one reused)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._staging = [decode_arrays(max_batch, max_blocks, pin_memory=pin)
                         for _ in range(2)]
        self._turn = 0
        # The static buffers the graphs read are views of one device-side set.
        self.buf = decode_arrays(max_batch, max_blocks, device=device)
        self.index, self.input_ids = self.buf.index, self.buf.ids
        self.seq_lens, self.block_tables = self.buf.lens, self.buf.tables
        self.max_blocks = max_blocks

    def fill(self, token_ids: list[int] | None, seq_lens: list[int], tables: list[list[int]],
             padded: int, device_tokens: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Stage n real rows, zero the padding rows up to `padded`, copy to the device.

        Token ids come from the host list, or (device_tokens = (tokens, rows)) straight from
        the previous step's sampled tokens on the device: input i = tokens[rows[i]]. That
        lets a step be launched before the previous step's tokens reach the host."""
        st = self._staging[self._turn]
        self._turn ^= 1
        n = len(seq_lens)
        if device_tokens is None:
            st.ids_np[:n] = token_ids
        else:
            prev, rows = device_tokens
            st.index_np[:n] = rows
        st.ids_np[n:padded] = 0  # padding rows' tokens (the gather below writes only :n)
        st.lens_np[:n] = seq_lens
        st.lens_np[n:padded] = 0
        table_rows = st.tables_np
        for i, t in enumerate(tables):
            table_rows[i, :len(t)] = t
        st.copy_to(self.buf, padded)
        if device_tokens is not None:
            torch.index_select(prev, 0, self.index[:n], out=self.input_ids[:n])


# The prelude's GEMM takes this many rows of the down projection: as many as the whole
# did for the graphs, at a fraction of its bytes (bench/results/2026-12-02-h200-kernels-
# launched-early/prelude-rows/).
PRELUDE_ROWS = 256


def make_prelude(model: torch.nn.Module, device: torch.device):
    """What DecodeGraphRunner.run launches before each graph replay: the first layer's
    down projection, its first PRELUDE_ROWS rows, on a zero row, output discarded.

    On the H200 a captured graph's kernels follow each other ~0.1 us apart while fewer
    than ~7 regular (non-graph) kernels have been launched since the last cuBLAS split-K
    GEMM, and ~0.45 us apart after that, whatever those kernels are. The engine launches a
    few between replays (token gather, sampling, prefill), so without this its replays ran
    in the slow state: ~90 us more per batch-1 step of 261 kernels. A memset, fill,
    elementwise, Triton or non-split GEMM launch does not restore it; this split-K GEMM
    does. Why the hardware behaves so is not known (docs/performance.md, "Graph replays
    slow down after regular launches"). None for a quantized model (its projections are
    not cuBLAS GEMMs).
    """
    weight = getattr(model.decode_prelude_linear(), "weight", None)
    if weight is None:
        return None  # a quantized projection: its GEMM is not cuBLAS's split-K kernel
    weight = weight[:PRELUDE_ROWS]
    x = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=device)
    linear = torch.nn.functional.linear  # the module's own call, without its hook checks
    return lambda: linear(x, weight)


def capture_graphs(sizes: list[int], step, device: torch.device, tp=None,
                   warm_each: bool = False) -> dict[int, torch.cuda.CUDAGraph]:
    """One graph of step(size) per size, largest first, all in one memory pool (warm_each:
    each step run once more, waited for, before its capture). Under tensor parallelism
    (tp, the TPGroup) every rank captures the same graphs and the ranks agree on each: a
    capture that fails on any rank leaves every rank without graphs (their steps then run
    eagerly, the same collectives in the same order); on one GPU it raises."""
    graphs, pool = {}, None
    for size in sorted(sizes, reverse=True):
        graph = torch.cuda.CUDAGraph()
        try:
            if warm_each:
                step(size)
                torch.cuda.synchronize(device)
            with torch.cuda.graph(graph, pool=pool):
                step(size)
            ok = True
        except Exception:
            if tp is None:
                raise
            logger.exception("CUDA graph capture failed on rank %d (size %d).", tp.rank, size)
            ok = False
        if tp is not None and not tp.all_ok(ok):
            logger.warning("A CUDA graph capture failed under tensor parallelism: every rank "
                           "runs these steps without graphs.")
            return {}
        pool = pool or graph.pool()
        graphs[size] = graph
    return graphs


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_layers, *, max_batch: int, max_blocks: int,
                 block_size: int, max_model_len: int, device: torch.device,
                 use_compile: bool, use_graphs: bool, logits_out: torch.Tensor | None = None,
                 greedy_out: torch.Tensor | None = None, tp=None) -> None:
        """tp: the TPGroup under tensor parallelism (each step starts by receiving rank
        0's inputs; rank 0 announces each step's replay to the workers)."""
        self.model = model
        self.tp = tp
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.inputs = DecodeInputs(self.max_batch, max_blocks, device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.step_fn = self._decode_step
        if use_compile:
            self.step_fn = compile_step(self._decode_step)
        self.compiled = use_compile
        # Seconds spent on start-up: the first call of each bucket (compiles), the capture.
        self.timings: dict[str, float] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every bucket writes its logits and argmax here (given: shared with the mixed
        # steps), outside the graphs' memory pool: per-graph outputs would stay allocated,
        # one [bucket, vocab] block per bucket.
        vocab = model.config.vocab_size
        # The split-KV decode attention's per-(sequence, kv head) counters, zero between
        # steps: the last split program of each combines the splits (one launch fewer per
        # layer; see csrc_triton.paged_attention_decode).
        self.decode_counters = torch.zeros(
            self.max_batch * model.config.num_kv_heads, dtype=torch.int32, device=device)
        # In the model's dtype, written by the head itself: an fp32 copy cost a batch of 256
        # rows of Qwen's 151,936 logits 233 MB of traffic a step, for greedy rows that
        # never read them (the sampler converts what it reads).
        if logits_out is None:
            logits_out = torch.empty(self.max_batch, vocab, dtype=model.lm_head.weight.dtype,
                                     device=device)
            greedy_out = torch.empty(self.max_batch, dtype=torch.long, device=device)
        self.logits_out, self.greedy_out = logits_out, greedy_out
        # A decode step's query offsets are 0, 1, ..., batch: one buffer for every step.
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32,
                                            device=device)
        self.prelude = (make_prelude(model, device)
                        if self.use_graphs and decode_prelude_enabled() else None)

    def _positions_and_slots(self, seq_lens: torch.Tensor, block_tables: torch.Tensor):
        """Each row's position (seq_len - 1) and KV slot (-1 for a padding row): one Triton
        kernel in the graphs (csrc_triton.decode_slots), PyTorch ops elsewhere (a CPU,
        torch.compile)."""
        if self.use_graphs and not self.compiled:
            from csrc_triton import decode_slots
            batch = seq_lens.shape[0]
            positions = torch.empty(batch, dtype=torch.long, device=seq_lens.device)
            slots = torch.empty(batch, dtype=torch.long, device=seq_lens.device)
            decode_slots(seq_lens, block_tables, self.block_size, positions, slots)
            return positions, slots
        bs = self.block_size
        positions = (seq_lens.long() - 1).clamp(min=0)
        block_ids = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        slots = torch.where(seq_lens > 0, block_ids * bs + positions % bs,
                            torch.full_like(positions, -1))
        return positions, slots

    def _decode_step(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor) -> None:
        """One decode step; its logits and argmax land in logits_out / greedy_out."""
        batch = input_ids.shape[0]
        if self.tp is not None:
            self.tp.broadcast_arrays(self.inputs.buf, batch)
        positions, slots = self._positions_and_slots(seq_lens, block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=seq_lens, block_tables=block_tables,
            max_query_len=1, max_seq_len=self.max_model_len,
            decode_counters=self.decode_counters)
        hidden = self.model(input_ids, positions, self.kv_layers, meta)
        logits = self.model.compute_logits(hidden, out=self.logits_out[:batch])
        argmax_rows(logits, out=self.greedy_out[:batch])

    @torch.inference_mode()
    def capture(self) -> float:
        """Warm up (compiles) and capture one graph per bucket, largest first."""
        start = time.perf_counter()
        inp = self.inputs
        # Run every bucket once before capture: compilation and Triton autotuning happen
        # outside the graphs.
        try:
            for b in reversed(self.buckets):
                self.step_fn(inp.input_ids[:b], inp.seq_lens[:b], inp.block_tables[:b])
        except Exception:
            if not self.compiled:
                raise
            logger.exception("torch.compile of the decode step failed; capturing it eager.")
            self.step_fn, self.compiled = self._decode_step, False
            for b in reversed(self.buckets):
                self.step_fn(inp.input_ids[:b], inp.seq_lens[:b], inp.block_tables[:b])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        warm = time.perf_counter() - start
        self.timings = {"warm_up_s": warm}
        if not self.use_graphs:
            return warm
        self.graphs = capture_graphs(
            self.buckets, lambda b: self.step_fn(inp.input_ids[:b], inp.seq_lens[:b],
                                                 inp.block_tables[:b]),
            self.device, self.tp, warm_each=True)
        torch.cuda.synchronize(self.device)
        total = time.perf_counter() - start
        self.timings["capture_s"] = total - warm
        logger.info("Decode: %d CUDA graphs (batch %d..%d) in %.1fs: %s %.1fs, capture %.1fs.",
                    len(self.graphs), self.buckets[0], self.max_batch, total,
                    "torch.compile and warm-up" if self.compiled else "warm-up", warm,
                    total - warm)
        return total

    def can_run(self, n: int) -> bool:
        return n <= self.max_batch

    @torch.inference_mode()
    def run(self, token_ids: list[int] | None, seq_lens: list[int], tables: list[list[int]],
            device_tokens: tuple[torch.Tensor, list[int]] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decode step for n sequences; returns (logits [n, V], argmax [n]).
        The work is queued on the device; nothing here waits for it."""
        n = len(seq_lens)
        b = bucket_for(n, self.buckets)
        self.inputs.fill(token_ids, seq_lens, tables, b, device_tokens)
        if self.tp is not None:
            self.tp.send_replay(Replay.DECODE, b)
        self.replay(b)
        # Every bucket's step writes into these shared buffers (see __init__).
        return self.logits_out[:n], self.greedy_out[:n]

    def replay(self, b: int) -> None:
        """Bucket b's step over the static buffers: its graph, or the step run eagerly."""
        if b in self.graphs:
            if self.prelude is not None:
                self.prelude()
            self.graphs[b].replay()
        else:
            inp = self.inputs
            self.step_fn(inp.input_ids[:b], inp.seq_lens[:b], inp.block_tables[:b])
