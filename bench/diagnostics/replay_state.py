"""Which actions make a captured decode graph replay slower, and which make it fast again
(GPU only).

On the H200 the batch-1 decode graph of Qwen2.5-0.5B replays ~10% slower (its kernels
further apart) once a few regular kernels have run since the last cuBLAS split-K GEMM;
the engine launches one such GEMM before each decode replay for that reason
(cuda_graph_runner.make_prelude; bench/results/2026-11-29-h200-graph-replay-gaps/). This
runs a sequence of actions in one process (a kernel launch, a GEMM, an eager step, a
recapture, an allocation, ...) and times the lone replay after each. Run it on a new GPU or driver to see whether the
behaviour, and so the prelude, still matters there.

    python -m bench.diagnostics.replay_state --actions base,kernel,kernel,down1,kernel [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
import triton.language as tl

import csrc_triton
from bench.common import write_result
from minivllm.model.attention import AttentionMetadata


def replays_us(graph, n: int) -> float:
    """Microseconds of device time per replay of `graph`, n replays back to back."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / n


W2_MODEL_CONFIG = "bench/model_configs/qwen2.5-0.5b-instruct.json"


def probe_llm(model_config: str = W2_MODEL_CONFIG):
    """The engine this probe takes apart: the Qwen2.5-0.5B config with dummy bf16 weights
    on the GPU, decode graphs for batches up to 8. Returns (llm, its decode graph runner,
    its block size)."""
    from minivllm import LLM

    llm = LLM(model_config, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              device="cuda", seed=0, max_model_len=2048, max_num_seqs=8)
    return llm, llm.engine.runner.graph_runner, llm.engine.config.block_size


def gpu_probe_parser(doc: str, model_config: bool = False):
    """--out FILE (and --model-config)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    if model_config:
        ap.add_argument("--model-config", default=W2_MODEL_CONFIG)
    return ap


def has_cuda(probe: str) -> bool:
    """False (and says so) on a machine without a CUDA device."""
    if not torch.cuda.is_available():
        print(f"{probe}: no CUDA device")
        return False
    return True


ITERS = 300


@triton.jit
def _touch(x_ptr):
    """One program that rewrites one value: the smallest Triton launch."""
    tl.store(x_ptr, tl.load(x_ptr))


_cudart = None


def cuda_memset_async(tensor: torch.Tensor, value: int = 0) -> None:
    """cudaMemsetAsync over the tensor's bytes on the current stream (a memset operation,
    not the fill kernel that tensor.zero_() launches)."""
    import ctypes
    global _cudart
    if _cudart is None:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcudart" in line)
        _cudart = ctypes.CDLL(path)
        _cudart.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                            ctypes.c_void_p]
    err = _cudart.cudaMemsetAsync(tensor.data_ptr(), value,
                                  tensor.numel() * tensor.element_size(),
                                  torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(f"cudaMemsetAsync failed with error {err}")


def replay_profile(graph, replays: int = 20) -> dict:
    """Kernel time per replay by kernel name, and the replay's time not covered by any
    kernel (gaps between kernels): does a slower replay run slower kernels, or wait
    longer between them?"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    spans, per = [], {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
            t = per.setdefault(e.name[:60], [0.0, 0])
            t[0] += e.time_range.end - e.time_range.start
            t[1] += 1
    named = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    gaps: dict[str, float] = {}  # "previous kernel -> next kernel": summed idle time
    for (_, end, prev), (start, _, nxt) in itertools.pairwise(named):
        if 0 <= start - end < 50:  # not the host's pause between replays
            key = f"{prev} -> {nxt}"
            gaps[key] = gaps.get(key, 0.0) + start - end
    spans.sort()
    kernel_us = sum(b - a for a, b in spans)
    wall = spans[-1][1] - spans[0][0] if spans else 0.0
    return {"kernels_per_replay": len(spans) / replays,
            "kernel_us_per_replay": round(kernel_us / replays, 1),
            "wall_us_per_replay": round(wall / replays, 1),
            "by_kernel_us_per_replay": {k: round(v[0] / replays, 2) for k, v in
                                        sorted(per.items(), key=lambda kv: -kv[1][0])},
            "gap_us_per_replay_by_transition": {k: round(v / replays, 2) for k, v in
                                                sorted(gaps.items(), key=lambda kv: -kv[1])}}


def main(argv=None) -> int:
    ap = gpu_probe_parser(__doc__, model_config=True)
    ap.add_argument("--actions", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    if not has_cuda("replay_state"):
        return 1
    from minivllm import SamplingParams

    llm, gr, bs = probe_llm(args.model_config)
    table = [list(range(-(-256 // bs)))]
    keep: list = []  # everything an action allocates stays alive
    existing = gr.inputs.buf.int64  # a device buffer the step already has
    steps = 256
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    prompt = list(range(100, 228))

    def w2_us() -> float:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        return 1e6 * (time.perf_counter() - t0 - (m.first_token_time - m.arrival_time)) / (steps - 1)

    actions = {
        "base": lambda: None,
        "sleep": lambda: time.sleep(1.0),
        # a tiny device tensor: usually served from a cached block, no cudaMalloc
        "dev_small": lambda: keep.append(torch.zeros(1, dtype=torch.long, device="cuda")),
        # 1 GiB: larger than any cached block, so the allocator must cudaMalloc a segment
        "dev_segment": lambda: keep.append(torch.empty(1 << 30, dtype=torch.uint8,
                                                       device="cuda")),
        "pinned": lambda: keep.append(torch.zeros(1, dtype=torch.long, pin_memory=True)),
        # a kernel on an existing buffer, no allocation (add 0: the values stay)
        "kernel": lambda: existing.add_(0),
        # a kernel this process has not launched yet (lazy module loading), no allocation
        "new_kernel": lambda: torch.cumsum(existing[:8], 0, out=existing[8:16]),
        # an engine step that is not a batch-1 decode: a prefill, one output token
        "prefill": lambda: llm.generate([prompt], SamplingParams(max_tokens=1),
                                        use_tqdm=False),
        "profile": lambda: replay_profile(gr.graphs[1]),
        "empty_cache": torch.cuda.empty_cache,
        "recapture": gr.capture,
        "w2": w2_us,  # the engine's W2 itself, wall us per token
    }
    streams = {"replay": torch.cuda.current_stream()}
    mat = torch.zeros(3, 64, 64, dtype=torch.bfloat16, device="cuda")
    pinned = torch.zeros(1, dtype=torch.long, pin_memory=True)
    torch.cuda.synchronize()

    def engine_like_loop() -> float:
        """Device us per step of the engine's pipelined pattern: each step's input token
        gathered on the device from the previous step's output, then the replay."""
        gr.run([7], [256], table)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ITERS):
            gr.run(None, [256], table, (gr.greedy_out, [0]))
        end.record()
        torch.cuda.synchronize()
        return 1000 * start.elapsed_time(end) / ITERS

    layer0 = gr.model.model.layers[0]
    hidden = torch.zeros(1, gr.model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    gate_up = layer0.mlp.gate_up_proj(hidden)
    torch.cuda.synchronize()

    def twice(fn):
        return lambda: (fn(), fn())

    cfg = gr.model.config
    inter = torch.zeros(1, cfg.intermediate_size, dtype=torch.bfloat16, device="cuda")
    q0 = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    kv0 = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")

    memset_target = torch.zeros(64, dtype=torch.int32, device="cuda")

    def step_metadata():
        """The decode step's own positions and attention metadata, computed eagerly."""
        inp = gr.inputs
        lens, tables = inp.seq_lens[:1], inp.block_tables[:1]
        positions = (lens.long() - 1).clamp(min=0)
        blocks = tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        slots = torch.where(lens > 0, blocks * bs + positions % bs, torch.full_like(positions, -1))
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.arange(2, dtype=torch.int32, device="cuda"),
            seq_lens=lens, block_tables=tables, max_query_len=1,
            max_seq_len=gr.max_model_len, decode_counters=gr.decode_counters)
        return positions, meta

    def layers(n: int) -> None:
        """The eager step's metadata, embedding and first n decoder layers."""
        positions, meta = step_metadata()
        x, residual = gr.model.model.embed_tokens(gr.inputs.input_ids[:1]), None
        for layer, kv in list(zip(gr.model.model.layers, gr.kv_layers))[:n]:
            x, residual = layer(x, residual, positions, kv, meta)

    def attention_only() -> None:
        _, meta = step_metadata()
        layer0.self_attn.attn.attend(q0, gr.kv_layers[0], meta)

    def rotary_only() -> None:
        positions, meta = step_metadata()
        rot = layer0.self_attn.rotary
        csrc_triton.rotary_embedding(positions, q0.clone(), kv0.clone(), rot.cos_table,
                                     rot.sin_table, v=kv0, k_cache=gr.kv_layers[0][0],
                                     v_cache=gr.kv_layers[0][1],
                                     slot_mapping=meta.slot_mapping)

    def tail() -> None:
        logits = gr.model.compute_logits(hidden)
        gr.logits_out[:1].copy_(logits)
        gr.greedy_out[:1].copy_(logits.argmax(dim=-1))

    def d2h_event() -> None:
        pinned.copy_(gr.greedy_out[:1], non_blocking=True)
        torch.cuda.Event().record()

    def eager_step() -> None:
        inp = gr.inputs
        gr.step_fn(inp.input_ids[:1], inp.seq_lens[:1], inp.block_tables[:1])

    actions.update({
        # from here on the measured replays run on a stream of their own (the actions'
        # kernels stay on the default stream)
        "side_stream": lambda: streams.update(replay=torch.cuda.Stream()),
        "default_stream": lambda: streams.update(replay=torch.cuda.current_stream()),
        "eager_step": eager_step,  # the batch-1 step's kernels, not from the graph
        # one kernel of each kind, on buffers that exist already
        "copy_d2d": lambda: existing[8:16].copy_(existing[:8]),
        "index_select": lambda: torch.index_select(gr.greedy_out, 0, gr.inputs.index[:1],
                                                   out=gr.inputs.input_ids[:1]),
        "argmax": lambda: torch.argmax(gr.logits_out[:1], dim=-1, out=gr.greedy_out[:1]),
        "gemm": lambda: torch.matmul(mat[0], mat[1], out=mat[2]),
        "triton": lambda: _touch[(1,)](existing),
        "d2h_event": d2h_event,  # no kernel: a copy to pinned memory and an event
        "engine_like": engine_like_loop,
        # two launches of one kernel the graph has too (same function, same shapes)
        "gate_up2": twice(lambda: layer0.mlp.gate_up_proj(hidden)),
        "silu2": twice(lambda: csrc_triton.silu_and_mul(gate_up)),
        "lm_head2": twice(lambda: gr.model.compute_logits(hidden)),
        # the eager step's own last kernels: the LM head, its fp32 copy, argmax, the copy
        # of the argmax into greedy_out
        "tail": tail,
        "layers0": lambda: layers(0),
        "layers1": lambda: layers(1),
        "layers24": lambda: layers(len(gr.model.model.layers)),
        "attn": attention_only,
        "rotary": rotary_only,
        "qkv2": twice(lambda: layer0.self_attn.qkv_proj(hidden)),
        "down2": twice(lambda: layer0.mlp.down_proj(inter)),
        "memset": lambda: cuda_memset_async(memset_target),
        "zero": lambda: memset_target.zero_(),
        "down1": lambda: layer0.mlp.down_proj(inter),
        "tail_copy": lambda: gr.greedy_out[:1].copy_(existing[:1]),
        "eager_step2": lambda: gr.step_fn(gr.inputs.input_ids[:2], gr.inputs.seq_lens[:2],
                                          gr.inputs.block_tables[:2]),
        # many launches of one small kernel in a burst, as many as an eager step has
        **{f"burst{n}": (lambda n=n: [existing.add_(0) for _ in range(n)])
           for n in (8, 32, 128, 261)},
    })
    rows = []
    for name in args.actions.split(","):
        reserved = torch.cuda.memory_reserved()
        value = actions[name]()
        torch.cuda.synchronize()
        gr.inputs.fill([7], [256], table, 1)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams["replay"]):
            for _ in range(20):
                gr.graphs[1].replay()
            replay = replays_us(gr.graphs[1], ITERS)
        row = {"action": name, "replay_256_us": round(replay, 1),
               "side_stream": streams["replay"] != torch.cuda.default_stream(),
               "reserved_delta_mib": round((torch.cuda.memory_reserved() - reserved) / 2**20, 1)}
        if name == "w2":
            row["engine_w2_us_per_token"] = round(value, 1)
        if name == "profile":
            row["profile"] = value
        if name == "engine_like":
            row["engine_like_us_per_step"] = round(value, 1)
        rows.append(row)
        print(f"{args.label} after {name:12s}: replay {replay:7.1f} us  reserved "
              f"{row['reserved_delta_mib']:+.1f} MiB"
              + (f"  engine W2 {value:.1f} us/token" if name == "w2" else "")
              + (f"  engine-like loop {value:.1f} us/step" if name == "engine_like" else "")
              + (f"  profile: {value['kernels_per_replay']:.0f} kernels "
                 f"{value['kernel_us_per_replay']} us, span {value['wall_us_per_replay']} us"
                 if name == "profile" else ""), flush=True)
    write_result("replay_state", {"label": args.label, "actions": args.actions, "rows": rows},
                 args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
