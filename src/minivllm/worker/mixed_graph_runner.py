"""Prefill and mixed (prefill + decode) steps replayed as CUDA graphs, bucketed by tokens.

A step of T tokens over S sequences is padded to the smallest token bucket >= T and to
max_num_seqs sequences. Padding tokens have slot -1 (nothing stored); padding sequences
own no query tokens and have length 0. The attention kernel's grid is the bucket's row
tiles plus one per sequence (csrc_triton.paged_attention), so it depends only on the
bucket and max_num_seqs and the graph stays valid for any split of those tokens among
sequences: tiles that find no rows exit at once. Only the logits rows that are sampled
are computed.

With pipelined decoding a mixed step can be launched before the previous step's tokens
reach the host: the decode rows' input tokens are then gathered on the device from that
step's sampled tokens (`device_tokens`), and the host staging alternates between two sets
so that filling one step's inputs never overwrites a set whose copies may not have run.

A step is one replay instead of ~300 eager launches, which cost the host ~26 ms on the
H200 whatever the step's size: small steps (a few new prompts joining a batch of decodes)
dominate serving, and long ones (prompts of thousands of tokens, up to the step budget)
were host-bound on small models. Steps that would be padded too much (see
MAX_LONG_PADDING) and steps past the largest bucket run eagerly, unpadded, through staging
of their own, and are launched before the previous step is read back like any other.
"""

from __future__ import annotations

import logging
import time

import torch

from ..model.attention import AttentionMetadata
from .cuda_graph_runner import PackedArrays, bucket_for, capture_graphs
from .sampler import argmax_rows
from .tensor_parallel import Replay

logger = logging.getLogger(__name__)


# Buckets double up to DOUBLING_LIMIT tokens, then grow by LONG_BUCKET_STEP. A step of up
# to DOUBLING_LIMIT tokens always replays its bucket's graph. A longer one replays it where
# that was measured to pay (`capture`: the bucket's replay takes less time than the host
# needs to launch an eager step, as for a small model's, whose ~300 launches cost more than
# its GPU work), or where the bucket pads it by at most 1/MAX_LONG_PADDING of its tokens;
# otherwise it runs eagerly, unpadded (an 8B model's long step: its GPU work hides the
# launches, and padding would cost its share of the step).
DOUBLING_LIMIT = 1024
LONG_BUCKET_STEP = 512
MAX_LONG_PADDING = 16


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token buckets: powers of two from 16 to DOUBLING_LIMIT, then multiples of
    LONG_BUCKET_STEP; the last one max_tokens itself."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < DOUBLING_LIMIT else b + LONG_BUCKET_STEP
    return sizes + [max_tokens]


def _step_arrays(t: int, s: int, r: int, max_blocks: int, **where) -> PackedArrays:
    """A mixed step's inputs for up to t tokens, s sequences and r sampled rows: token ids,
    positions, KV slots, sampled rows, and the positions / previous-step rows of tokens
    taken from the device (int64); query offsets, lengths and block tables (int32)."""
    arrays = PackedArrays({"ids": t, "pos": t, "slots": t, "rows": r, "fix_pos": s,
                           "fix_rows": s}, {"qsl": s + 1, "lens": s}, s, max_blocks, **where)
    arrays.slots.fill_(-1)
    return arrays


class _MixedStaging:
    """One set of host staging arrays (`arrays`), and an event after the copies that read
    them."""

    def __init__(self, t: int, s: int, r: int, max_blocks: int, pin: bool) -> None:
        self.arrays = _step_arrays(t, s, r, max_blocks, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None
        self._recorded = False

    def wait(self) -> None:
        """Before refilling: the copies that read this set the last time have run."""
        if self._recorded:
            self.event.synchronize()

    def copied(self) -> None:
        if self.event is not None:
            self.event.record()
            self._recorded = True


class _StepBuffers:
    """The device arrays a step reads (`buf`; the graphs capture their addresses) and two
    sets of host staging for them, alternating: filling one step's inputs must not
    overwrite a set whose copies may not have run yet."""

    def __init__(self, t: int, s: int, r: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.staging = [_MixedStaging(t, s, r, max_blocks, pin) for _ in range(2)]
        self.turn = 0
        self.buf = _step_arrays(t, s, r, max_blocks, device=device)

    def next_staging(self) -> _MixedStaging:
        staging = self.staging[self.turn]
        self.turn ^= 1
        staging.wait()
        return staging


class MixedGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_layers, *, max_tokens: int, max_seqs: int,
                 max_blocks: int, max_model_len: int, device: torch.device,
                 use_graphs: bool, max_rows: int | None = None,
                 max_eager_tokens: int | None = None, logits_out: torch.Tensor | None = None,
                 greedy_out: torch.Tensor | None = None, tp=None) -> None:
        """max_tokens: the largest graph bucket; max_eager_tokens: the largest step, run
        eagerly past the buckets (default max_tokens: none). max_rows: the most sampled
        rows a step has (default max_seqs: one per sequence; a speculative step samples
        1 + k per sequence). tp: as for DecodeGraphRunner."""
        self.model = model
        self.tp = tp
        self.kv_layers = kv_layers
        self.max_model_len = max_model_len
        self.device = device
        self.buckets = mixed_buckets(max_tokens)
        self.max_graph_tokens = self.buckets[-1]
        self.max_tokens = max(self.max_graph_tokens, max_eager_tokens or 0)
        self.max_seqs = max_seqs
        self.max_rows = min(self.max_tokens, max_rows or max_seqs)
        self.use_graphs = use_graphs and device.type == "cuda"
        s, r = max_seqs, self.max_rows
        # Bucketed steps read `graph_io.buf`; eager ones have buffers of their own, so a
        # graph step's upload stays its bucket's size.
        self.graph_io = _StepBuffers(self.max_graph_tokens, s, min(r, self.max_graph_tokens),
                                     max_blocks, device)
        self.eager_io = (_StepBuffers(self.max_tokens, s, r, max_blocks, device)
                         if self.max_tokens > min(self.max_graph_tokens, DOUBLING_LIMIT)
                         else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replay_pays: set[int] = set()  # long buckets whose replay beats an eager step
        self.last_graphed = False  # whether the last step run replayed a graph
        # Shared by every step (kept out of the graphs' pool; see DecodeGraphRunner).
        vocab = model.config.vocab_size
        if logits_out is None:
            logits_out = torch.empty(r, vocab, dtype=model.lm_head.weight.dtype,
                                     device=device)
            greedy_out = torch.empty(r, dtype=torch.long, device=device)
        self.logits_out, self.greedy_out = logits_out, greedy_out
        self.timings: dict[str, float] = {}

    def can_run(self, num_tokens: int, num_seqs: int, num_rows: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs \
            and num_rows <= self.max_rows

    def _rows(self, t: int) -> int:
        # A step of t tokens samples at most t rows (each sample row is one of its tokens):
        # the head need not project all max_rows rows for a small bucket.
        return min(t, self.max_rows)

    def _step(self, t: int) -> None:
        """A bucket's step, as its graph captures it: every sequence slot, bounds for the
        query and context lengths."""
        b = self.graph_io.buf
        if self.tp is not None:
            self.tp.broadcast_arrays(b, self.max_seqs)
        meta = AttentionMetadata(
            slot_mapping=b.slots[:t], query_start_loc=b.qsl, seq_lens=b.lens,
            block_tables=b.tables, max_query_len=t, max_seq_len=self.max_model_len)
        self._forward(b, t, meta, self._rows(t))

    def eager_step(self, t: int, n: int, r: int, max_query_len: int,
                   max_seq_len: int) -> None:
        """A step past the buckets, unpadded: its own t tokens, n sequences, r sampled rows
        and lengths (the attention picks its tiles by them, as for any eager step)."""
        b = self.eager_io.buf
        if self.tp is not None:
            self.tp.broadcast_arrays(b, n)
        meta = AttentionMetadata(
            slot_mapping=b.slots[:t], query_start_loc=b.qsl[:n + 1], seq_lens=b.lens[:n],
            block_tables=b.tables[:n], max_query_len=max_query_len, max_seq_len=max_seq_len)
        self._forward(b, t, meta, r)

    def _forward(self, b, t: int, meta: AttentionMetadata, r: int) -> None:
        hidden = self.model(b.ids[:t], b.pos[:t], self.kv_layers, meta)
        logits = self.model.compute_logits(hidden[b.rows[:r]], out=self.logits_out[:r])
        argmax_rows(logits, out=self.greedy_out[:r])

    @torch.inference_mode()
    def capture(self) -> float:
        """Warm up every bucket (Triton compiles per tile shape), then capture, largest
        first, all graphs in one memory pool. Warm-up inputs are all padding. Then time an
        eager step's launches and each long bucket's replay (see DOUBLING_LIMIT)."""
        start = time.perf_counter()
        for t in reversed(self.buckets):
            self._step(t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        warm = time.perf_counter() - start
        self.timings = {"warm_up_s": warm}
        if not self.use_graphs:
            return warm
        # The warm-up's activations go back to the device: the graphs' pool, captured next,
        # needs as much again, and the KV cache was sized for one step's activations.
        torch.cuda.empty_cache()
        self.graphs = capture_graphs(self.buckets, self._step, self.device, self.tp)
        torch.cuda.synchronize(self.device)
        launch_s = self._time_long_replays()
        secs = time.perf_counter() - start
        self.timings["capture_s"] = secs - warm
        logger.info("Mixed steps: %d CUDA graphs (%d..%d tokens) in %.1fs: warm-up %.1fs, "
                    "capture %.1fs. An eager step's launches take %.1f ms; %d of the %d "
                    "buckets past %d tokens replay faster and take any step.", len(self.graphs),
                    self.buckets[0], self.max_graph_tokens, secs, warm, secs - warm,
                    launch_s * 1e3, len(self.replay_pays),
                    sum(t > DOUBLING_LIMIT for t in self.buckets), DOUBLING_LIMIT)
        return secs

    def _time_long_replays(self) -> float:
        """Fill replay_pays: the long buckets whose replay (all padding: the GEMMs' work
        for every token, which is what padding costs) takes less time than the host takes
        to launch an eager step. Returns that launch time (the least of three; the kernels
        are compiled by now, and the idle GPU keeps up with a 16-token step)."""
        def seconds(fn, wait: bool) -> float:
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            fn()
            if wait:
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - t0

        launch_s = min(seconds(lambda: self._step(self.buckets[0]), wait=False)
                       for _ in range(3))
        for t in self.buckets:
            if t > DOUBLING_LIMIT and t in self.graphs:
                self.graphs[t].replay()  # the first replay also uploads the graph
                if seconds(self.graphs[t].replay, wait=True) < launch_s:
                    self.replay_pays.add(t)
        return launch_s

    @torch.inference_mode()
    def run(self, host, device_tokens: tuple[torch.Tensor, list[int], list[int]] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """host: the step's HostInputs. Returns (logits, argmax) of its sample rows.
        device_tokens = (tokens, positions, rows): input token positions[i] of this step is
        tokens[rows[i]], a token of the previous step still on the device (the host list
        holds a placeholder there)."""
        n_tok, n_seq, n_rows = len(host.input_ids), len(host.seq_lens), len(host.sample_indices)
        bucket = self.replay_bucket(n_tok)
        graphed = self.last_graphed = bucket is not None
        t = bucket if graphed else n_tok
        io = self.graph_io if graphed else self.eager_io
        staging = io.next_staging()
        st = staging.arrays
        st.ids_np[:n_tok] = host.input_ids
        st.pos_np[:n_tok] = host.positions
        st.slots_np[:n_tok] = host.slots
        st.slots_np[n_tok:t] = -1
        st.ids_np[n_tok:t] = 0
        st.pos_np[n_tok:t] = 0
        st.qsl_np[:n_seq + 1] = host.query_start_loc
        st.qsl_np[n_seq + 1:] = n_tok  # padding sequences own no tokens
        st.lens_np[:n_seq] = host.seq_lens
        st.lens_np[n_seq:] = 0
        tables = st.tables_np
        for i, table in enumerate(host.block_tables):
            tables[i, :len(table)] = table
        st.rows_np[:n_rows] = host.sample_indices
        st.rows_np[n_rows:] = 0
        if device_tokens is not None:
            prev, positions, rows = device_tokens
            k = len(positions)
            st.fix_pos_np[:k] = positions
            st.fix_rows_np[:k] = rows
        b = io.buf
        st.copy_to(b, n_seq)
        if device_tokens is not None:
            b.ids.index_copy_(0, b.fix_pos[:k], prev.index_select(0, b.fix_rows[:k]))
        staging.copied()
        if graphed:
            if self.tp is not None:
                self.tp.send_replay(Replay.MIXED, t)
            self.replay(t)
        else:
            sizes = (t, n_seq, n_rows, host.max_query_len, max(host.seq_lens))
            if self.tp is not None:
                self.tp.send_replay(Replay.MIXED_EAGER, *sizes)
            self.eager_step(*sizes)
        return self.logits_out[:n_rows], self.greedy_out[:n_rows]

    def replay(self, t: int) -> None:
        """Token bucket t's step over the static buffers: its graph, or the step run
        eagerly."""
        if t in self.graphs:
            self.graphs[t].replay()
        else:
            self._step(t)

    def replay_bucket(self, num_tokens: int) -> int | None:
        """The bucket whose graph a step of num_tokens replays, or None: it runs eagerly."""
        if num_tokens > self.max_graph_tokens:
            return None
        bucket = bucket_for(num_tokens, self.buckets)
        if (num_tokens <= DOUBLING_LIMIT or bucket in self.replay_pays
                or (bucket - num_tokens) * MAX_LONG_PADDING <= num_tokens):
            return bucket
        return None
