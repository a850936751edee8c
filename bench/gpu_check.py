"""Everything the GPU path must show, in one run on the H200 (or a tiny smoke run on a CPU).

Sections (each writes its own JSON under --out-dir, so a partial run still reports):
  parity     fp32 greedy output vs HF transformers on dummy-weight models (Qwen2.5-0.5B,
             Qwen3-0.6B, Llama-3.2-1B configs), 8 prompts x 64 tokens
  graphs     CUDA-graph decode vs eager decode, same dtype (fp32 and bf16; no torch.compile
             unless GPU_CHECK_GRAPHS_COMPILE=1)
  bf16       bf16 vs HF bf16: share of identical prompts, first divergence position
  w2         single-stream latency: batch 1, 128 prompt, 256 output tokens
  sweep      decode step ms at batch 1, 8, 64, 256, context 1024, against the HBM floor
  w1         offline throughput: 256 requests, in/out uniform in [100, 1024]
  hf         peers: HF generate eager and static cache + compile on W2; HF generate_batch

    python -m bench.gpu_check --sections parity,graphs,bf16,w2,sweep,w1,hf --out-dir DIR
    python -m bench.gpu_check --smoke      # tiny models on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import environment
from bench.workloads import VOCAB_LIMIT  # this module lowers its own copy for smoke runs

REPO = Path(__file__).resolve().parent.parent
# Copies of ../shared/models (the device machine sees only the repository).
MODELS_DIR = Path(os.environ.get("MINIVLLM_MODEL_CONFIGS", REPO / "bench" / "model_configs"))
PARITY_MODELS = ["qwen2.5-0.5b-instruct", "qwen3-0.6b", "llama-3.2-1b"]
HBM_BYTES_PER_S = 4.28e12

SMOKE_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def log(*a):
    print(*a, flush=True, file=sys.stderr)


class Ctx:
    def __init__(self, args):
        self.smoke = args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.out_dir = Path(args.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(args.tmp_dir)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def model_config_path(self, name: str) -> Path:
        if not (MODELS_DIR / f"{name}.json").exists():
            # Checked in smoke runs too: they stand in a tiny model for a real config, and
            # must not hide a wrong name (a W2 run on the H200 was lost to one).
            raise ValueError(f"no model config {name!r} under {MODELS_DIR}")
        if self.smoke:
            p = self.tmp / f"smoke-{name}.json"
            cfg = dict(SMOKE_CONFIG)
            if "qwen3" in name:
                cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32)
            if "llama" in name:
                cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
                           tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 512})
            p.write_text(json.dumps(cfg))
            return p
        return MODELS_DIR / f"{name}.json"

    def save(self, name: str, payload: dict) -> None:
        payload = {"section": name, "environment": environment(), **payload}
        (self.out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
        log(f"[saved {name}]")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    top = min(vocab, VOCAB_LIMIT)
    return [[rng.randrange(10, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_llm(ctx, name, dtype, **kw):
    from minivllm import LLM

    kw.setdefault("max_model_len", 2048)
    return LLM(str(ctx.model_config_path(name)), load_format="dummy", dtype=dtype,
               skip_tokenizer_init=True, device=ctx.device, seed=0, **kw)


def hf_model(ctx, name, dtype):
    """HF transformers model holding exactly minivllm's dummy weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minivllm.config import ModelConfig, load_config_json
    from minivllm.model.loader import dummy_weights

    path = ctx.model_config_path(name)
    raw = load_config_json(path)
    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                      if k != "model_type"})
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    state = {k: v for k, v in dummy_weights(ModelConfig.from_dict(raw), 0, dtype, ctx.device)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.eval()


def hf_greedy(model, prompts, new_tokens):
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ours, ref):
    div = [first_divergence(a, b) for a, b in zip(ours, ref)]
    return {"identical": sum(d is None for d in div), "total": len(div),
            "first_divergence": div}


def mini_greedy(llm, prompts, new_tokens):
    from minivllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- sections ---------------------------------------------------------------------

def _compare_with_hf(ctx, section: str, dtype: str, seed: int) -> None:
    """Greedy output of minivllm (CUDA graphs, no compile) against HF transformers on the
    same dummy weights, 8 prompts per model config."""
    os.environ["MINIVLLM_COMPILE"] = "0"  # compile is covered by the `graphs` section
    rows = []
    n_new = 8 if ctx.smoke else 64
    for name in PARITY_MODELS:
        prompts = random_prompts(8, 16, 200, 10000, seed=seed)
        llm = make_llm(ctx, name, dtype, max_num_seqs=8, num_kv_blocks=2048)
        ours = mini_greedy(llm, prompts, n_new)
        del llm
        free_memory()
        hf = hf_model(ctx, name, getattr(torch, dtype))
        ref = hf_greedy(hf, prompts, n_new)
        del hf
        free_memory()
        r = {"model": name, "dtype": dtype, **compare(ours, ref)}
        rows.append(r)
        log(f"{section} {name}: {r['identical']}/{r['total']} identical; "
            f"{r['first_divergence']}")
    ctx.save(section, {"new_tokens": n_new, "rows": rows})


def section_parity(ctx):
    _compare_with_hf(ctx, "parity", "float32", seed=1)


def section_graphs(ctx):
    rows = []
    n_new = 8 if ctx.smoke else 64
    os.environ["MINIVLLM_COMPILE"] = os.environ.get("GPU_CHECK_GRAPHS_COMPILE", "0")
    name = "qwen2.5-0.5b-instruct"
    prompts = random_prompts(20, 16, 300, 10000, seed=2)

    def run(dtype: str, **kw) -> list:
        llm = make_llm(ctx, name, dtype, max_num_seqs=32, num_kv_blocks=4096, **kw)
        out = mini_greedy(llm, prompts, n_new)
        del llm
        free_memory()
        return out

    for dtype in ("float32", "bfloat16"):
        # The prompts (~3,000 tokens) prefill in one eager step in every configuration;
        # only the decode steps differ.
        eager = run(dtype, enforce_eager=True)
        graphs = run(dtype)
        # The same decode step, padded to the same bucket with the same split-KV count,
        # run without a graph: the graph replay itself should change nothing, in any dtype.
        # (The enforce_eager engine runs unpadded batches, whose bf16 GEMMs and attention
        # splits may round differently.)
        old = os.environ.get("MINIVLLM_CUDA_GRAPHS")
        os.environ["MINIVLLM_CUDA_GRAPHS"] = "0"
        try:
            unreplayed = run(dtype)
        finally:
            if old is None:
                os.environ.pop("MINIVLLM_CUDA_GRAPHS", None)
            else:
                os.environ["MINIVLLM_CUDA_GRAPHS"] = old
        for ref_name, ref in (("enforce_eager engine", eager),
                              ("same padded decode step, not replayed", unreplayed)):
            r = {"model": name, "dtype": dtype, "reference": ref_name, **compare(graphs, ref)}
            rows.append(r)
            log(f"graphs vs {ref_name} {dtype}: {r['identical']}/{r['total']}; "
                f"{r['first_divergence']}")
    ctx.save("graphs", {"new_tokens": n_new, "rows": rows})


def section_bf16(ctx):
    _compare_with_hf(ctx, "bf16", "bfloat16", seed=3)


@contextlib.contextmanager
def scoped_env(overrides: dict[str, str]):
    """Set these environment variables (engine switches, read when an engine is built)
    for the block, then put back what was there."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def section_w2(ctx):
    from minivllm import SamplingParams

    name = "qwen2.5-0.5b-instruct"
    n_out = 16 if ctx.smoke else 256
    prompt = random_prompts(1, 128, 128, 10000, seed=4)[0]
    rows = []
    # name: (label, engine kwargs, environment)
    all_variants = {
        "compile": ("minivllm (compile + CUDA graphs)", {}, {"MINIVLLM_COMPILE": "1"}),
        "graphs": ("minivllm (CUDA graphs, no compile)", {}, {}),
        "not-pipelined": ("minivllm (CUDA graphs, no compile, not pipelined)", {},
                          {"MINIVLLM_PIPELINE": "0"}),
        "eager": ("minivllm eager", {"enforce_eager": True}, {}),
        "no-prelude": ("minivllm (CUDA graphs, no split-K GEMM before each decode "
                       "replay)", {}, {"MINIVLLM_DECODE_PRELUDE": "0"}),
    }
    variants = os.environ.get("GPU_CHECK_W2_VARIANTS", "compile,graphs,not-pipelined,eager")
    variants = variants.split(",")
    if os.environ.get("GPU_CHECK_SKIP_COMPILE") and "compile" in variants:
        variants.remove("compile")
    flags = {"MINIVLLM_COMPILE": "0", "MINIVLLM_PIPELINE": "1", "MINIVLLM_DECODE_PRELUDE": "1"}
    for variant in variants:
        label, kw, env = all_variants[variant]
        with scoped_env({**flags, **env}):
            llm = make_llm(ctx, name, "bfloat16", max_num_seqs=8, num_kv_blocks=1024, **kw)
            params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            llm.generate([prompt], params, use_tqdm=False)  # warm-up
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                sync()
                times.append(time.perf_counter() - t0)
            m = out.metrics
            ttft = m.first_token_time - m.arrival_time
            total = min(times)
            main = label == "minivllm (CUDA graphs, no compile)"
            host = _host_profile(llm, prompt, params) if main else None
            timeline = _device_timeline(llm, prompt, params) if main and not ctx.smoke else None
            rows.append({"engine": label, "seconds": total, "tok_per_s": n_out / total,
                         "ms_per_token": 1000 * (total - ttft) / (n_out - 1),
                         "ttft_ms": 1000 * ttft, "env": env,
                         "device_timeline": timeline,
                         "host_profile": host})
            log(f"W2 {label}: {n_out / total:.0f} tok/s, {rows[-1]['ms_per_token']:.3f} ms/token")
            del llm
            free_memory()
    ctx.save("w2", {"workload": {"prompt": 128, "output": n_out, "batch": 1,
                                 "model": name, "dtype": "bfloat16"}, "rows": rows})


def _host_profile(llm, prompt, params, top=30):
    """cProfile of one W2 generation: where the host's time per token goes (the GPU part
    of a step is ~1 ms at batch 1, so host work above that shows up as lost time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls": v[1],
             "tottime_ms": 1000 * v[2], "cumtime_ms": 1000 * v[3]} for k, v in rows]


def _device_timeline(llm, prompt, params):
    """torch.profiler trace of one W2 generation: how busy the GPU is between the first and
    last kernel, and the largest idle gaps (a gap means the host did not queue the next
    step in time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        sync()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    if not spans:
        return None
    busy, gaps, cur_s, cur_e = 0.0, [], spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            gaps.append(a - cur_e)
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    wall = spans[-1][1] - spans[0][0]
    gaps.sort(reverse=True)
    return {"device_events": len(spans), "wall_us": wall, "busy_us": busy,
            "busy_fraction": busy / wall, "gaps_over_20us": sum(g > 20 for g in gaps),
            "gap_us_total": sum(gaps), "largest_gaps_us": gaps[:20]}


def section_sweep(ctx):
    from minivllm.config import ModelConfig, load_config_json

    name = "qwen2.5-0.5b-instruct"
    ctx_len = 64 if ctx.smoke else 1024
    batches = [1, 2] if ctx.smoke else [1, 8, 64, 256]
    points = [(b, ctx_len) for b in batches] + [(1, 32 if ctx.smoke else 256)]  # W2's range
    llm = make_llm(ctx, name, "bfloat16", max_num_seqs=max(batches),
                   num_kv_blocks=max(batches) * (-(-ctx_len // 16)) + 160)
    runner = llm.engine.runner
    gr = runner.graph_runner
    cfg = ModelConfig.from_dict(load_config_json(ctx.model_config_path(name)))
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    bs = llm.engine.config.block_size
    rows = []
    for b, ctx_len in points:
        blocks_per_seq = -(-ctx_len // bs)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        if gr is None:
            break
        args = ([7] * b, [ctx_len] * b, tables)
        for _ in range(3):
            gr.run(*args)
        sync()
        iters = 5 if ctx.smoke else 50
        t0 = time.perf_counter()
        for _ in range(iters):
            gr.run(*args)
        sync()
        ms = 1000 * (time.perf_counter() - t0) / iters
        kv_bytes = b * ctx_len * cfg.kv_bytes_per_token(torch.bfloat16)
        floor_ms = 1000 * (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
        rows.append({"batch": b, "context": ctx_len, "ms_per_step": ms, "hbm_floor_ms": floor_ms,
                     "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                     "floor_fraction": floor_ms / ms})
        if b == 1 and torch.cuda.is_available():
            rows[-1]["kernels"] = _replay_kernels(gr, args)
        log(f"sweep batch {b}: {ms:.3f} ms/step (floor {floor_ms:.3f} ms)")
    ctx.save("sweep", {"model": name, "dtype": "bfloat16", "rows": rows,
                       "note": "graph replay incl. host input staging, logits and argmax"})
    del llm
    free_memory()


def _replay_kernels(gr, args, steps=20):
    """Device time per kernel name over `steps` graph replays (what a step is made of)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gr.run(*args)
        sync()
    per = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            t = per.setdefault(e.name[:80], [0.0, 0])
            t[0] += e.time_range.end - e.time_range.start
            t[1] += 1
    top = sorted(per.items(), key=lambda kv: kv[1][0], reverse=True)[:15]
    return [{"name": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps}
            for k, v in top]


def w1_requests(smoke):
    rng = random.Random(0)
    n = 16 if smoke else 256
    hi = 64 if smoke else 1024
    lo = 8 if smoke else 100
    prompts = [[rng.randint(0, VOCAB_LIMIT - 1) for _ in range(rng.randint(lo, hi))]
               for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


W1_VARIANTS = {"default": {}, "no-prelude": {"MINIVLLM_DECODE_PRELUDE": "0"}}


def section_w1(ctx):
    """W1, once per engine variant in GPU_CHECK_W1_VARIANTS (default: "default"; e.g.
    "default,no-prelude,default" for an A/B in one call). Each variant: two full runs and
    the slice HF generate_batch gets. Rows of a non-default variant carry its env."""
    from minivllm import SamplingParams

    name = "qwen2.5-0.5b-instruct"
    prompts, outs = w1_requests(ctx.smoke)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    rows = []
    num_blocks = None
    for variant in os.environ.get("GPU_CHECK_W1_VARIANTS", "default").split(","):
        env = W1_VARIANTS[variant]
        with scoped_env(env):
            engine = "minivllm" + (f" ({variant})" if env else "")
            llm = make_llm(ctx, name, "bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
                           gpu_memory_utilization=0.5)
            num_blocks = llm.engine.runner.num_blocks
            llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
            for rep in range(2):
                sync()
                t0 = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                sync()
                secs = time.perf_counter() - t0
                n_out = sum(len(r.outputs[0].token_ids) for r in res)
                assert n_out == sum(outs)
                rows.append({"engine": engine, "run": rep, "seconds": secs, "output_tokens": n_out,
                             "output_tok_per_s": n_out / secs, "env": env,
                             "preemptions": llm.engine.scheduler.num_preemptions})
                log(f"W1 {engine} run {rep}: {n_out / secs:,.0f} output tok/s ({secs:.2f} s)")
            # The slice HF generate_batch gets in the `hf` section (its first 64 prompts, 128
            # new tokens each), so the two engines are also compared on the very same work.
            k = 8 if ctx.smoke else 64
            sync()
            t0 = time.perf_counter()
            res = llm.generate(prompts[:k], SamplingParams(temperature=0.0, max_tokens=128,
                                                           ignore_eos=True), use_tqdm=False)
            sync()
            secs = time.perf_counter() - t0
            n_out = sum(len(r.outputs[0].token_ids) for r in res)
            rows.append({"engine": engine, "workload": f"W1 first {k} requests, max_tokens=128",
                         "seconds": secs, "output_tokens": n_out, "output_tok_per_s": n_out / secs,
                         "env": env})
            log(f"W1 {engine} slice ({k} x 128): {n_out / secs:,.0f} output tok/s")
            del llm
            free_memory()
    ctx.save("w1", {"workload": {"requests": len(prompts), "model": name, "dtype": "bfloat16",
                                 "total_output_tokens": sum(outs),
                                 "total_prompt_tokens": sum(map(len, prompts))},
                    "num_kv_blocks": num_blocks, "rows": rows})


def section_hf(ctx):
    """Peers: HF generate (eager; static cache + torch.compile) on W2; generate_batch on
    a slice of W1 (the full W1 takes minutes at HF's speed)."""
    name = "qwen2.5-0.5b-instruct"
    n_out = 16 if ctx.smoke else 256
    prompt = random_prompts(1, 128, 128, 10000, seed=4)[0]
    model = hf_model(ctx, name, torch.bfloat16)
    ids = torch.tensor([prompt], device=model.device)
    rows = []

    def timed_generate(label, **kw):
        gen = lambda: model.generate(ids, attention_mask=torch.ones_like(ids),  # noqa: E731
                                     max_new_tokens=n_out, min_new_tokens=n_out,
                                     do_sample=False, pad_token_id=0, **kw)
        gen()
        gen()
        sync()
        t0 = time.perf_counter()
        gen()
        sync()
        secs = time.perf_counter() - t0
        rows.append({"engine": label, "workload": "W2", "seconds": secs,
                     "tok_per_s": n_out / secs})
        log(f"HF {label}: {n_out / secs:.0f} tok/s")

    peers = os.environ.get("GPU_CHECK_HF_PEERS", "eager,batch,static").split(",")
    if "eager" in peers:
        try:
            timed_generate("HF generate eager")
        except Exception as e:
            rows.append({"engine": "HF generate eager", "error": repr(e)})
        ctx.save("hf", {"model": name, "dtype": "bfloat16", "rows": rows})
    if "batch" in peers:
        _hf_generate_batch(ctx, model, rows)
        ctx.save("hf", {"model": name, "dtype": "bfloat16", "rows": rows})
    if not ctx.smoke and "static" in peers:  # last: compiling takes the longest
        try:
            # transformers >= 4.48 compiles the forward itself when generate runs with a
            # static cache on a GPU (generation_config.compile_config); wrapping forward in
            # torch.compile as well (what the first two H200 runs did, both past their time
            # limit) compiles twice. GPU_CHECK_HF_MANUAL_COMPILE=1 still does that.
            if os.environ.get("GPU_CHECK_HF_MANUAL_COMPILE"):
                model.forward = torch.compile(model.forward, mode="reduce-overhead",
                                              fullgraph=True)
            timed_generate("HF generate static cache + compile", cache_implementation="static")
        except Exception as e:
            rows.append({"engine": "HF generate static cache + compile", "error": repr(e)})
            log("HF static+compile failed:", repr(e)[:300])
        ctx.save("hf", {"model": name, "dtype": "bfloat16", "rows": rows})


def _hf_generate_batch(ctx, model, rows):
    from transformers import GenerationConfig

    try:
        # HF's generate_batch runs ~1k tok/s: the full W1 (~145k output tokens) would take
        # minutes, so it gets W1's first 64 prompts with max_new_tokens=128 for all.
        prompts, outs = w1_requests(ctx.smoke)
        k = 8 if ctx.smoke else 64
        sub_p, sub_o = prompts[:k], [min(o, 128) for o in outs[:k]]
        gc_ = GenerationConfig(max_new_tokens=max(sub_o), do_sample=False, eos_token_id=-1,
                               pad_token_id=0, use_cuda_graph=False,
                               num_blocks=4096, max_batch_tokens=8192)
        model.generate_batch(inputs=sub_p[:2], generation_config=gc_)  # warm-up
        sync()
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=sub_p, generation_config=gc_)
        sync()
        secs = time.perf_counter() - t0
        n_tok = sum(len(getattr(r, "generated_tokens", []) or []) for r in res.values())
        rows.append({"engine": "HF generate_batch", "workload": f"W1 first {k} requests, "
                     f"max_new_tokens={max(sub_o)} for all", "seconds": secs,
                     "output_tokens": n_tok, "output_tok_per_s": n_tok / secs})
        log(f"HF generate_batch: {n_tok / secs:,.0f} tok/s over {n_tok} tokens")
    except Exception as e:
        rows.append({"engine": "HF generate_batch", "error": repr(e)})
        log("HF generate_batch failed:", traceback.format_exc()[-1500:])


def section_profile(ctx):
    """Where a decode step's GPU time goes: torch.profiler over eager decode steps (the
    kernels a graph replays are the same), top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    from minivllm import SamplingParams

    name = "qwen2.5-0.5b-instruct"
    rows = []
    for batch in ([2] if ctx.smoke else [1, 64]):
        llm = make_llm(ctx, name, "bfloat16", max_num_seqs=max(batch, 2), num_kv_blocks=4096,
                       enforce_eager=True)
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for p in random_prompts(batch, 512, 512, 10000, seed=9):
            eng.add_request(p, params)
        for _ in range(4):
            eng.step()  # prefill and a few decodes outside the profile
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if torch.cuda.is_available() else [])
        steps = 2 if ctx.smoke else 10
        with profile(activities=activities) as prof:
            for _ in range(steps):
                eng.step()
            sync()
        events = prof.key_averages()
        dev_attr = "device_time_total" if hasattr(events[0], "device_time_total") \
            else "cuda_time_total"
        top = sorted(events, key=lambda e: getattr(e, dev_attr, 0), reverse=True)[:25]
        rows.append({"batch": batch, "steps": steps, "top_kernels": [
            {"name": e.key[:120], "device_ms_per_step": getattr(e, dev_attr, 0) / 1000 / steps,
             "calls_per_step": e.count / steps,
             "cpu_ms_per_step": e.cpu_time_total / 1000 / steps} for e in top]})
        log(f"profile batch {batch}: " + "; ".join(
            f"{k['name'][:40]} {k['device_ms_per_step']:.3f}ms x{k['calls_per_step']:.0f}"
            for k in rows[-1]["top_kernels"][:6]))
        del llm, eng
        free_memory()
    ctx.save("profile", {"model": name, "dtype": "bfloat16", "rows": rows,
                         "note": "eager decode steps, enforce_eager=True, context ~512"})


# Engine configurations probed one per process (a CUDA fault in one cannot hide the
# others), each compared with the plain eager engine on the same fp32 greedy workload.
FEATURES = {
    "eager": ({"enforce_eager": True}, {"MINIVLLM_FUSED_OPS": "0", "MINIVLLM_PIPELINE": "0"}),
    "eager-fused": ({"enforce_eager": True}, {"MINIVLLM_FUSED_OPS": "1"}),
    "decode-graphs": ({"max_graph_tokens": 0},
                      {"MINIVLLM_FUSED_OPS": "1", "MINIVLLM_PIPELINE": "0"}),
    "mixed-graphs": ({}, {"MINIVLLM_FUSED_OPS": "1", "MINIVLLM_PIPELINE": "0"}),
    "pipelined": ({}, {"MINIVLLM_FUSED_OPS": "1", "MINIVLLM_PIPELINE": "1"}),
    "compiled": ({}, {"MINIVLLM_COMPILE": "1", "MINIVLLM_PIPELINE": "1"}),
}


def section_feature(ctx):
    """One feature configuration (GPU_CHECK_FEATURE names it; its environment variables
    are set by the caller, see run_gpu_check.sh)."""
    name = os.environ.get("GPU_CHECK_FEATURE", "eager")
    kwargs, _ = FEATURES[name]
    prompts = random_prompts(3 if ctx.smoke else 24, 8, 12 if ctx.smoke else 300, 10000,
                             seed=7)
    n_new = 4 if ctx.smoke else 48
    t0 = time.perf_counter()
    llm = make_llm(ctx, "qwen2.5-0.5b-instruct", "float32", max_num_seqs=16,
                   max_num_batched_tokens=512, num_kv_blocks=2048, **kwargs)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = mini_greedy(llm, prompts, n_new)
    ctx.save(f"feature_{name}", {"feature": name, "engine_kwargs": kwargs,
                                 "env": FEATURES[name][1], "build_s": build,
                                 "generate_s": time.perf_counter() - t0, "tokens": tokens})


def section_features_compare(ctx):
    base_path = ctx.out_dir / "feature_eager.json"
    if not base_path.exists():
        raise RuntimeError("the eager baseline did not run")
    base = json.loads(base_path.read_text())["tokens"]
    rows = []
    for name in FEATURES:
        path = ctx.out_dir / f"feature_{name}.json"
        if not path.exists():
            rows.append({"feature": name, "status": "did not run or crashed"})
            continue
        d = json.loads(path.read_text())
        r = {"feature": name, "status": "ran", "build_s": d["build_s"],
             "generate_s": d["generate_s"], **compare(d["tokens"], base)}
        rows.append(r)
    for r in rows:
        log(f"feature {r['feature']:14s} {r['status']:22s} "
            f"{r.get('identical', '-')}/{r.get('total', '-')} identical to eager; "
            f"build {r.get('build_s', 0):.1f}s generate {r.get('generate_s', 0):.2f}s")
    ctx.save("features", {"dtype": "float32", "rows": rows})


SECTIONS = {"parity": section_parity, "graphs": section_graphs, "bf16": section_bf16,
            "w2": section_w2, "sweep": section_sweep, "w1": section_w1, "hf": section_hf,
            "feature": section_feature, "features_compare": section_features_compare,
            "profile": section_profile}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "gpu"))
    ap.add_argument("--tmp-dir", default="/tmp/minivllm-gpu-check")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke on a CPU")
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ctx = Ctx(args)
    if args.smoke:
        global VOCAB_LIMIT
        VOCAB_LIMIT = 500
    failed = []
    base_compile = os.environ.get("MINIVLLM_COMPILE")
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        log(f"=== {name}")
        os.environ.pop("MINIVLLM_COMPILE", None)
        if base_compile is not None:
            os.environ["MINIVLLM_COMPILE"] = base_compile
        try:
            SECTIONS[name](ctx)
        except Exception:
            failed.append(name)
            log(traceback.format_exc())
            (ctx.out_dir / f"{name}.error.txt").write_text(traceback.format_exc())
        log(f"=== {name} took {time.perf_counter() - t0:.1f}s")
        free_memory()
    if failed:
        log("FAILED sections:", failed)
        sys.exit(1)


if __name__ == "__main__":
    main()
