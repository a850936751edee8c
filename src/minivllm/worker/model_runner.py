"""Turns a ScheduledBatch into tensors, runs the model, and samples.

Inputs are one flat batch of tokens: for each scheduled sequence, its next
num_new_tokens tokens with their positions and KV slots. Logits are computed only for the
rows that are needed: the last token of each sequence that samples this step, and, for
requests that asked for prompt logprobs, every prompt position in the chunk.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import (EngineConfig, ModelConfig, compile_enabled, cuda_graphs_enabled,
                      fused_ops_enabled)
from ..engine.scheduler import ScheduledBatch
from ..engine.sequence import Sequence
from ..model.attention import AttentionMetadata
from ..model.loader import load_model
from ..model.quantization import QuantizedLinear, check_device
from .cuda_graph_runner import DecodeGraphRunner
from .kv_cache import KVCache, cpu_num_blocks, gpu_num_blocks
from .mixed_graph_runner import MixedGraphRunner
from .sampler import SampledRows, Sampler, SamplerGraphs, SamplerOutput, argmax_rows
from .tensor_parallel import (BroadcastingModel, ShardModel, TensorParallel, check_tp,
                              load_shard, local_config)

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobChunk:
    """Prompt logprobs for positions first_position .. of one sequence's chunk: for each,
    (logprob of the actual next prompt token, its rank, top-N ids, top-N logprobs)."""

    seq: Sequence
    first_position: int  # the prompt index of the token these logprobs are for
    entries: list[tuple[float, int, list[int], list[float]]]


@dataclass
class StepResult:
    # Parallel lists over sampling rows: which sequence each sampled token belongs to.
    row_seqs: list[Sequence]
    sampled: SamplerOutput
    prompt_logprobs: list[PromptLogprobChunk]


class PendingDecode:
    """A step launched on the device whose tokens have not been read yet: its sampled
    rows, copied to the host behind the step's kernels. The next step can be launched
    first, reading its input tokens straight from `device_tokens`."""

    def __init__(self, seqs: list[Sequence], sampled: SampledRows) -> None:
        self.seqs = seqs
        self.sampled = sampled
        self.device_tokens = sampled.tokens
        self.rows = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self._read: SamplerOutput | None = None

    def read(self) -> SamplerOutput:
        if self._read is None:
            want = ([s.params.logprobs for s in self.seqs] if self.sampled.logprob_rows
                    else None)
            self._read = self.sampled.read(want)
        return self._read

    def tokens_by_seq(self) -> dict[int, int]:
        """Its tokens by sequence id (waits for them)."""
        tokens = self.read().token_ids
        return {seq_id: tokens[i] for seq_id, i in self.rows.items()}


# From this many tokens of a sequence in a step, its slots are computed with numpy (a long
# prompt chunk: 8192 tokens took ~1.4 ms in a Python loop here, 0.1 ms this way).
_VECTOR_MIN_TOKENS = 64


@dataclass
class HostInputs:
    """One step's inputs as host lists (see ModelRunner.host_inputs)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # not padded
    sample_indices: list[int] = field(default_factory=list)
    row_seqs: list[Sequence] = field(default_factory=list)
    # Per sampling row: the index in its sequence of the token it draws.
    row_positions: list[int] = field(default_factory=list)
    # Per sampling row, the drafts before its position (counted by its penalties); None
    # when nothing is drafted. Drafted rows' tokens are counted once accepted (counted).
    row_extras: list[list[int]] | None = None
    row_counted: list[bool] | None = None
    prompt_lp_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    max_query_len: int = 0

    def add_chunk(self, seq: Sequence, start: int, end: int, block_size: int) -> int:
        """Append tokens start..end of seq (ids, positions, KV slots) as one more sequence
        of the step; returns the flat index of its first token."""
        self.input_ids.extend(seq.token_ids[start:end])
        self.positions.extend(range(start, end))
        table, bs = seq.block_table, block_size
        if end - start >= _VECTOR_MIN_TOKENS:
            pos = np.arange(start, end)
            self.slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
        else:
            self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        tok0 = self.query_start_loc[-1]
        self.query_start_loc.append(tok0 + end - start)
        self.seq_lens.append(end)
        self.block_tables.append(table)
        return tok0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: list[int]       # flat-token index of each sampling row's logits
    host: HostInputs                # the sampling rows (row_seqs, row_positions, ...)
    prompt_lp_spans: list[tuple[Sequence, int, int, int]]  # seq, token start, first pos, count


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of a host list: numpy's conversion of a long list is ~4x faster than
    torch.tensor's (8192 ints: 0.23 vs 1.0 ms on the development machine)."""
    if len(values) < _VECTOR_MIN_TOKENS:
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values))).to(device)


class ModelRunner:
    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, model_path,
                 device: torch.device, dtype: torch.dtype, attention_backend: str,
                 reserved: tuple[int, int] = (0, 0), proposals: bool = False) -> None:
        """reserved: (bytes, bytes per KV block) of GPU memory that the KV cache leaves to
        something else (a draft model with a KV cache of as many blocks). proposals: a
        draft model's runner, whose sampler proposes drafts (worker/sampler.py)."""
        self.cfg = engine_cfg
        self.reserved = reserved
        self.model_cfg = model_cfg
        self.device = device
        self.dtype = dtype
        self.block_size = engine_cfg.block_size
        torch.manual_seed(engine_cfg.seed)
        # Start-up, part by part (seconds): logged once the engine is ready.
        self.startup: dict[str, float] = {}
        # What the process held before this engine (another engine, say): not its memory.
        self._memory_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        check_device(engine_cfg.quantization, device)
        world = engine_cfg.tensor_parallel_size
        check_tp(model_cfg, engine_cfg, device)
        self.tp = None
        if world > 1:  # the workers load their shards meanwhile
            self.tp = TensorParallel(engine_cfg, (engine_cfg, model_cfg, model_path, dtype,
                                                  attention_backend))
        if self.tp is not None:
            self.model = BroadcastingModel(load_shard(
                model_cfg, model_path, engine_cfg, dtype, device, attention_backend,
                self.tp.group, fused_ops_enabled(attention_backend)), self.tp.group)
        else:
            self.model = load_model(model_cfg, model_path, load_format=engine_cfg.load_format,
                                    dtype=dtype, device=device,
                                    max_positions=engine_cfg.max_model_len,
                                    attention_backend=attention_backend,
                                    fused_ops=fused_ops_enabled(attention_backend),
                                    seed=engine_cfg.seed, quantization=engine_cfg.quantization)
        if fused_ops_enabled(attention_backend) and not fused_ops_work(device, dtype):
            logger.warning("The fused Triton kernels failed their self-check on this device; "
                           "running the model with plain PyTorch ops instead.")
            for module in self.model.modules():
                if hasattr(module, "fused_ops"):
                    module.fused_ops = False
        self.startup["weights_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.kv_dtype = engine_cfg.kv_dtype(dtype)
        if (self.kv_dtype == torch.float8_e4m3fn and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise ValueError("kv_cache_dtype='fp8' needs a GPU with fp8 (compute capability "
                             "8.9 or newer) for its kernels; leave kv_cache_dtype='auto'.")
        # The sampler's per-sequence state and work buffers: allocated before the KV cache
        # is sized, which then leaves room for them.
        self.max_rows = engine_cfg.max_num_seqs * (1 + engine_cfg.num_speculative_tokens)
        self.sampler = Sampler(model_cfg.vocab_size, device, engine_cfg.seed,
                               max_rows=self.max_rows, num_slots=engine_cfg.max_num_seqs,
                               kx=engine_cfg.num_speculative_tokens, proposals=proposals)
        if device.type == "cuda":
            self.sampler.check_kernels()
        self.num_blocks = self._decide_num_blocks()
        kv_cfg = model_cfg
        if self.tp is not None:
            self.tp.group.broadcast_object(self.num_blocks)
            kv_cfg = local_config(model_cfg, 0, world)
        self.kv_cache = KVCache(kv_cfg, self.num_blocks, self.block_size, self.kv_dtype,
                                device)
        self.startup["kv_cache_s"] = time.perf_counter() - t0
        self.graph_runner: DecodeGraphRunner | None = None
        self.mixed_runner: MixedGraphRunner | None = None
        # (path, tokens, sequences) of the last step launched, for the engine's step trace.
        self.last_step: tuple[str, int, int] | None = None
        # The torch reference backend reads lengths on the host: it cannot be captured.
        if (device.type == "cuda" and not engine_cfg.enforce_eager
                and attention_backend == "triton"):
            self.setup_step_runners()

    def weight_bytes(self) -> int:
        """The model's weights in memory: its state (quantized projections as stored, tied
        tensors once; not the rotary tables, which are derived)."""
        tensors = {t.data_ptr(): t for t in self.model.state_dict().values()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def quantization_label(self) -> str:
        """' (int8)' and the like when the projections are quantized, else ''."""
        methods = {m.method for m in self.model.modules() if isinstance(m, QuantizedLinear)}
        return f" ({', '.join(sorted(methods))})" if methods else ""

    def setup_step_runners(self) -> None:
        """The decode steps (batch buckets) and prefill/mixed steps (token buckets) over
        static buffers, captured as CUDA graphs on a GPU (their memory comes on top of the
        KV cache sized before); under tensor parallelism every rank builds the same. The
        CPU runs them eagerly (tests)."""
        group = None if self.tp is None else self.tp.group
        model = self.model
        if group is not None:
            group.broadcast_object(("runners",))
            model = ShardModel(self.model.inner, group)
        self.graph_runner, self.mixed_runner = step_runners(
            model, self.kv_cache.layers, self.cfg, self.device, group)
        for name, runner in (("decode", self.graph_runner), ("mixed", self.mixed_runner)):
            for part, secs in (runner.timings if runner else {}).items():
                self.startup[f"{name}_{part}"] = secs
        if cuda_graphs_enabled() and self.sampler.kernels:
            t0 = time.perf_counter()
            self.sampler.graphs = SamplerGraphs(self.sampler, self.graph_runner.logits_out,
                                                self.graph_runner.greedy_out)
            self.sampler.graphs.capture()
            self.startup["sampler_capture_s"] = time.perf_counter() - t0

    # ---- sizing -----------------------------------------------------------------------

    def _decide_num_blocks(self) -> int:
        cfg = self.cfg
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type != "cuda":
            return cpu_num_blocks(self.model_cfg, self.block_size, self.kv_dtype,
                                  cfg.max_num_seqs, cfg.max_model_len)
        peak = self._profile_peak_memory()
        return gpu_num_blocks(self.model_cfg, self.block_size, self.kv_dtype, self.device,
                              cfg.gpu_memory_utilization, peak, *self.reserved)

    def profile_batch(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, KVCache]:
        """A worst-case prefill: max_num_batched_tokens tokens, as sequences no longer
        than max_model_len (positions must stay inside the rotary table), each with its
        own blocks in a scratch cache."""
        n, limit, bs = self.cfg.max_num_batched_tokens, self.cfg.max_model_len, self.block_size
        lens = [min(limit, n - start) for start in range(0, n, limit)]
        blocks_per_seq = -(-max(lens) // bs)
        scratch = KVCache(self.model_cfg, blocks_per_seq * len(lens), bs, self.kv_dtype,
                          self.device)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                  for i in range(len(lens))]
        positions = [p for length in lens for p in range(length)]
        slots = [tables[i][p // bs] * bs + p % bs for i, length in enumerate(lens)
                 for p in range(length)]
        qsl = [0]
        for length in lens:
            qsl.append(qsl[-1] + length)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc_host=qsl, seq_lens_host=lens)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        return ids, pos, meta, scratch

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Run the model once at the full token budget and report this engine's peak
        memory (weights and activations; not what the process held before it)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        ids, pos, meta, scratch = self.profile_batch()
        hidden = self.model(ids, pos, scratch.layers, meta)
        self.model.compute_logits(hidden[-self.cfg.max_num_seqs:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._memory_before
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    # ---- one step ---------------------------------------------------------------------

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """The step's inputs as host lists: one flat token batch with positions and
        slots, per-sequence offsets, lengths and block tables, and the logits rows."""
        bs = self.block_size
        h = HostInputs()
        drafting = any(s.num_drafts for s in batch.seqs)
        if drafting:
            h.row_extras, h.row_counted = [], []
        qsl = h.query_start_loc
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            tok0 = h.add_chunk(seq, start, end, bs)
            req = seq.request
            if req.wants_prompt_logprobs and seq.index == 0 and start < seq.num_prompt_tokens - 1:
                # Logits at position p predict prompt token p + 1; record each only once.
                first = max(start, len(req.prompt_logprobs or [None]) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    h.prompt_lp_spans.append((seq, tok0 + first - start, first + 1,
                                              last - first))
            if not batch.samples(i):
                continue
            length = len(seq.token_ids)
            if seq.num_drafts:
                # Speculative: the target's token at every draft position and after.
                k = seq.num_drafts
                drafts = seq.token_ids[length - k:]
                h.sample_indices.extend(range(qsl[-1] - 1 - k, qsl[-1]))
                h.row_seqs.extend([seq] * (k + 1))
                h.row_positions.extend(range(length - k, length + 1))
                h.row_extras.extend(drafts[:j] for j in range(k + 1))
                h.row_counted.extend([False] * (k + 1))
                continue
            # A prompt's last chunk with forks pending: one row per sample, all from these
            # logits.
            samples = req.seqs if seq.forks_pending else [seq]
            for sample in samples:
                h.sample_indices.append(qsl[-1] - 1)
                h.row_seqs.append(sample)
                h.row_positions.append(length)
                if drafting:
                    h.row_extras.append([])
                    h.row_counted.append(True)
        h.max_query_len = max(batch.num_new_tokens)
        return h

    def prepare(self, batch: ScheduledBatch, host: HostInputs | None = None) -> ModelInputs:
        h = host or self.host_inputs(batch)
        max_blocks = max(len(t) for t in h.block_tables)
        tables = [t + [0] * (max_blocks - len(t)) for t in h.block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_long_tensor(h.slots, dev),
            query_start_loc=torch.tensor(h.query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(h.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=h.max_query_len,
            max_seq_len=max(h.seq_lens),
            query_start_loc_host=h.query_start_loc,
            seq_lens_host=h.seq_lens,
        )
        return ModelInputs(
            input_ids=_long_tensor(h.input_ids, dev),
            positions=_long_tensor(h.positions, dev),
            meta=meta, sample_indices=h.sample_indices, host=h,
            prompt_lp_spans=h.prompt_lp_spans)

    @torch.inference_mode()
    def logits_of_chunks(self, chunks: list[tuple[Sequence, int, int]],
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model over chunks (seq, start, end) of sequences' tokens, writing their
        KV, and return (logits, argmax) at each chunk's last token: a draft model's
        catch-up and drafting steps (worker/draft_model.py). At most max_num_batched_tokens
        tokens, one chunk per sequence."""
        if all(end - start == 1 for _, start, end in chunks) and (
                self.graph_runner is not None and self.graph_runner.can_run(len(chunks))):
            return self.graph_runner.run([s.token_ids[start] for s, start, _ in chunks],
                                         [end for _, _, end in chunks],
                                         [s.block_table for s, _, _ in chunks])
        h = HostInputs()
        for seq, start, end in chunks:
            h.add_chunk(seq, start, end, self.block_size)
            h.sample_indices.append(h.query_start_loc[-1] - 1)
            h.row_seqs.append(seq)
        h.max_query_len = max(end - start for _, start, end in chunks)
        if self.mixed_runner is not None and self.mixed_runner.can_run(
                len(h.input_ids), len(h.seq_lens), len(h.sample_indices)):
            return self.mixed_runner.run(h)
        inputs = self.prepare(None, h)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers,
                            inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.sample_indices]).float()
        return logits, argmax_rows(logits)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        if (self.graph_runner is not None and batch.is_decode_only
                and self.graph_runner.can_run(len(batch))):
            self.last_step = ("decode_graph", len(batch), len(batch))
            return self._execute_decode_graph(batch)
        host = self.host_inputs(batch)
        if (self.mixed_runner is not None and not host.prompt_lp_spans and host.sample_indices
                and self.mixed_runner.can_run(len(host.input_ids), len(host.seq_lens),
                                              len(host.sample_indices))):
            logits, greedy = self.mixed_runner.run(host)
            kind = "mixed_graph" if self.mixed_runner.last_graphed else "long"
            self.last_step = (kind, len(host.input_ids), len(host.seq_lens))
            return StepResult(host.row_seqs, self._sample_now(logits, greedy, host), [])
        self.last_step = ("eager", len(host.input_ids), len(host.seq_lens))
        return self._execute_eager(self.prepare(batch, host))

    @torch.inference_mode()
    def _execute_eager(self, inputs: ModelInputs) -> StepResult:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers,
                            inputs.meta)
        prompt_lps = self._prompt_logprobs(hidden, inputs)
        if not inputs.sample_indices:
            return StepResult([], SamplerOutput([], []), prompt_lps)
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        return StepResult(inputs.host.row_seqs, self._sample_now(logits, None, inputs.host),
                          prompt_lps)

    def _sample_now(self, logits: torch.Tensor, greedy: torch.Tensor | None,
                    host: HostInputs) -> SamplerOutput:
        """The rows' tokens (and logprobs), waited for."""
        return self.sampler.sample_now(logits, greedy, host.row_seqs, host.row_positions,
                                       host.row_extras, host.row_counted)

    def can_launch_async(self, batch: ScheduledBatch) -> bool:
        """Whether launch_decode can queue this batch without waiting: a decode batch the
        decode graphs take, or a mixed batch the mixed-step graphs take whose sequences
        sample at most one row each and want no prompt logprobs, with at least one row."""
        if batch.is_decode_only:
            return self.graph_runner is not None and self.graph_runner.can_run(len(batch))
        if self.mixed_runner is None or not self.mixed_runner.can_run(
                batch.num_tokens, len(batch), len(batch)):
            return False
        if any(s.forks_pending or s.request.wants_prompt_logprobs for s in batch.seqs):
            return False
        return any(batch.samples(i) for i in range(len(batch)))

    @torch.inference_mode()
    def launch_decode(self, batch: ScheduledBatch, prev: PendingDecode | None) -> PendingDecode:
        """Queue a decode step and its sampling without waiting for them. With `prev`,
        the batch's input tokens are the ones `prev` sampled (their host copies may still
        be in flight): every sequence of the batch must have been in `prev`. A mixed batch
        (see can_launch_async) goes to the mixed-step graphs; its sequences that carry a
        token of `prev` take it from the device."""
        if not batch.is_decode_only:
            return self._launch_mixed(batch, prev)
        seqs = batch.seqs
        rows = None
        if prev is not None:
            try:
                rows = [prev.rows[s.seq_id] for s in seqs]
            except KeyError:
                # A sequence not in prev knows its last token (a prompt's one-token last
                # chunk): the decode graphs take every row's token from prev, the
                # mixed-step graphs only the placeholders'.
                return self._launch_mixed(batch, prev)
        self.last_step = ("decode_pipelined", len(seqs), len(seqs))
        lens = [len(s.token_ids) for s in seqs]
        tables = [s.block_table for s in seqs]
        if prev is None:
            logits, greedy = self.graph_runner.run([s.token_ids[-1] for s in seqs], lens,
                                                   tables)
        else:
            logits, greedy = self.graph_runner.run(None, lens, tables,
                                                   (prev.device_tokens, rows))
        return self._new_pending(seqs, logits, greedy, lens)

    def _new_pending(self, seqs: list[Sequence], logits: torch.Tensor,
                     greedy: torch.Tensor, positions: list[int]) -> PendingDecode:
        """The launched step's tokens (sampled on the device), copied back behind it."""
        return PendingDecode(seqs, self.sampler.sample(logits, greedy, seqs, positions))

    @torch.inference_mode()
    def _launch_mixed(self, batch: ScheduledBatch, prev: PendingDecode | None) -> PendingDecode:
        """A mixed step (new prompts joining decodes) launched like a pipelined decode step:
        the decode rows whose last token is still a placeholder (a negative id: the
        pending step's token) read it from prev's device tokens."""
        host = self.host_inputs(batch)
        fix = None
        if prev is not None:
            positions, rows = [], []
            for i, seq in enumerate(batch.seqs):
                if seq.token_ids[-1] < 0:
                    # The placeholder is the sequence's last token, and the last of its
                    # chunk (a running sequence's one new token).
                    positions.append(host.query_start_loc[i + 1] - 1)
                    rows.append(prev.rows[seq.seq_id])
            if positions:
                fix = (prev.device_tokens, positions, rows)
        logits, greedy = self.mixed_runner.run(host, fix)
        kind = "mixed" if self.mixed_runner.last_graphed else "long"
        self.last_step = (kind + "_pipelined", len(host.input_ids), len(host.seq_lens))
        return self._new_pending(host.row_seqs, logits, greedy, host.row_positions)

    @torch.inference_mode()
    def _execute_decode_graph(self, batch: ScheduledBatch) -> StepResult:
        seqs = batch.seqs
        lens = [s.num_tokens for s in seqs]  # also the positions of the tokens drawn
        logits, greedy = self.graph_runner.run([s.token_ids[-1] for s in seqs], lens,
                                               [s.block_table for s in seqs])
        return StepResult(seqs, self.sampler.sample_now(logits, greedy, seqs, lens), [])

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         inputs: ModelInputs) -> list[PromptLogprobChunk]:
        chunks = []
        for seq, tok_start, first_pos, count in inputs.prompt_lp_spans:
            logits = self.model.compute_logits(hidden[tok_start:tok_start + count]).float()
            lp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(seq.token_ids[first_pos:first_pos + count], device=lp.device)
            tok_lp = lp.gather(1, targets[:, None])
            ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
            n = seq.params.prompt_logprobs
            if n:
                top_vals, top_ids = lp.topk(n, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            else:
                top_vals = top_ids = [[] for _ in range(count)]
            entries = [(v, r, ids, vals) for v, r, ids, vals
                       in zip(tok_lp[:, 0].tolist(), ranks, top_ids, top_vals)]
            chunks.append(PromptLogprobChunk(seq, first_pos, entries))
        return chunks


def step_runners(model: torch.nn.Module, kv_layers, cfg: EngineConfig, device: torch.device,
                 group=None) -> tuple[DecodeGraphRunner, MixedGraphRunner | None]:
    """The decode and mixed-step runners of `model`, warmed up and (on a GPU) captured.
    Both write a step's logits and argmax to the same buffers (the sampler's graphs read
    them), outside the graphs' memory pools: per-graph outputs would stay allocated, one
    [rows, vocab] block per bucket. group: the TPGroup under tensor parallelism, where
    every rank calls this alike (no torch.compile there: its collectives are the
    process group's calls)."""
    use_compile = compile_enabled() and group is None
    use_graphs = cuda_graphs_enabled()
    max_rows = cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)
    rows = max(cfg.max_num_seqs, min(max_rows, cfg.max_num_batched_tokens))
    logits_out = torch.empty(rows, model.config.vocab_size,
                             dtype=model.lm_head.weight.dtype, device=device)
    greedy_out = torch.empty(rows, dtype=torch.long, device=device)
    decode = DecodeGraphRunner(
        model, kv_layers,
        max_batch=min(cfg.max_num_seqs, cfg.max_cudagraph_batch_size or cfg.max_num_seqs),
        max_blocks=cfg.max_blocks_per_seq(), block_size=cfg.block_size,
        max_model_len=cfg.max_model_len, device=device, use_compile=use_compile,
        use_graphs=use_graphs, logits_out=logits_out, greedy_out=greedy_out, tp=group)
    logger.info("Decode step: %s, %s...", "torch.compile" if use_compile else "eager",
                "capturing CUDA graphs" if use_graphs else "no CUDA graphs")
    decode.capture()
    max_tokens = min(cfg.max_graph_tokens, cfg.max_num_batched_tokens)
    if max_tokens <= 0 or not use_graphs:
        return decode, None
    logger.info("Mixed steps (up to %d tokens): capturing CUDA graphs...", max_tokens)
    mixed = MixedGraphRunner(
        model, kv_layers, max_tokens=max_tokens, max_seqs=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), max_model_len=cfg.max_model_len, device=device,
        use_graphs=True, max_rows=max_rows, max_eager_tokens=cfg.max_num_batched_tokens,
        logits_out=logits_out, greedy_out=greedy_out, tp=group)
    mixed.capture()
    return decode, mixed


def fused_ops_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Run each fused kernel once on small inputs against the PyTorch ops it replaces. A
    kernel that fails to compile or disagrees on this device turns fusion off instead of
    breaking the engine."""
    import csrc_triton

    from ..model.layers import RMSNorm, RotaryEmbedding

    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(5, 64, device=device, generator=g).to(dtype)
        res = torch.randn(5, 64, device=device, generator=g).to(dtype)
        norm = RMSNorm(64, 1e-6).to(device=device, dtype=dtype)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(csrc_triton.rms_norm(x, norm.weight, 1e-6), norm(x), **tol)
        out, new_res = csrc_triton.fused_add_rms_norm(x.clone(), res.clone(), norm.weight, 1e-6)
        torch.testing.assert_close(new_res, res + x, **tol)
        torch.testing.assert_close(out, norm(res + x), **tol)
        gate_up = torch.randn(5, 32, device=device, generator=g).to(dtype)
        torch.testing.assert_close(csrc_triton.silu_and_mul(gate_up),
                                   torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:],
                                   **tol)
        rope = RotaryEmbedding(32, 64, 10000.0, None)
        rope.reset_tables(device)
        q = torch.randn(5, 4, 32, device=device, generator=g).to(dtype)
        k = torch.randn(5, 2, 32, device=device, generator=g).to(dtype)
        pos = torch.tensor([3, 0, 7, 1, 63], device=device)
        q2, k2 = csrc_triton.rotary_embedding(pos, q, k, rope.cos_table, rope.sin_table)
        q_ref, k_ref = rope(pos, q, k)
        torch.testing.assert_close(q2, q_ref, **tol)
        torch.testing.assert_close(k2, k_ref, **tol)
        if dtype in (torch.float16, torch.bfloat16):  # layers.Linear's batch-1 GEMV
            w = torch.randn(24, 64, device=device, generator=g).to(dtype)
            torch.testing.assert_close(csrc_triton.linear_gemv(x[:1], w),
                                       torch.nn.functional.linear(x[:1], w), **tol)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any failure means: don't use them
        logger.exception("fused kernel self-check failed")
        return False


