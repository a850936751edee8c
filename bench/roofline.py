"""Each offline workload's floor on the H200: how fast W1, W2, W5 and W6 could run at the
measured peaks (800 TFLOP/s bf16 matmul, 4.28 TB/s HBM copy), so the engines' numbers read
as a share of what the hardware allows, not only as a ratio to each other.

    python -m bench.roofline [--model NAME ...] [--workloads w1,w2,w5,w6] [--out FILE.json]

Counted per request of prompt p and output o (p + o - 1 tokens go through the model; the
last output token is never fed back):
  FLOPs  linear layers 2 x (q,k,v,o,gate,up,down params) per token; attention 4 x heads x
         head_dim x (t+1) per layer for a token at position t (QK^T and PV); the LM head
         2 x vocab x hidden per sampled row only (the prompt's last token, then each decode).
  bytes  the weights (linear layers and the LM head matrix; the embedding lookup reads only
         rows) once per step; each decode reads its cached context's K and V (its own fresh
         K/V need not round-trip through HBM); every token's K and V written once.

`bound_s` = max(FLOPs / peak, bytes / bandwidth) with the fewest steps any schedule needs
(the longest output: the prefill step gives each request its first token): a strict lower
bound for any schedule without speculative decoding.
`ideal_s` times a prefill-then-decode schedule step by step, each step max(FLOPs / peak,
bytes / bandwidth): prefill chunks of at most 8192 tokens (prompts in order), then one
decode step per later output token over the requests still running. It is closer to what
an engine can reach but NOT a strict bound: a mixed step (prefill chunk beside decodes) can
hide the decodes' memory time under the chunk's compute.
Lengths are repetition 0's of bench/workloads.py (the head-to-head's requests). No torch
here, so bench/report.py can import it cheaply.

A mixture of experts (Mixtral, Qwen-MoE) counts per token the FLOPs of the k experts it is
routed to (plus a shared expert and the router), and per step the bytes of the experts its
tokens reach: for a step of n tokens, E (1 - (1 - k/E)^n) experts of each sparse layer,
the expectation under uniform routing (what dummy weights give); batch 1 reads k.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import workloads

PEAK_FLOPS = 800e12          # bf16 matmul, measured on the H200
HBM_BYTES_PER_S = 4.28e12    # copy bandwidth, as bench/gpu_check.py (which needs torch)
PREFILL_CHUNK = 8192
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
WORKLOADS = tuple(workloads(False, vocab=1))  # their names: W1, W2, W5, W6
PART_NAMES = {"linear": "linear FLOPs", "attention": "attention FLOPs",
              "lm_head": "LM head FLOPs", "weights": "weight bytes", "kv_read": "KV read bytes",
              "kv_write": "KV write bytes"}


@dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # Mixtures of experts: experts, top-k, an expert's intermediate size, a shared
    # expert's (0: none), and how many layers are sparse (the rest have a dense MLP).
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    sparse_layers: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> "Model":
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        moe = {}
        if experts:
            step = cfg.get("decoder_sparse_step", 1) or 1
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = dict(experts=experts, top_k=cfg.get("num_experts_per_tok", 2),
                       expert_intermediate=cfg.get("moe_intermediate_size",
                                                   cfg["intermediate_size"]),
                       shared_intermediate=cfg.get("shared_expert_intermediate_size", 0),
                       sparse_layers=sum(i not in dense and (i + 1) % step == 0
                                         for i in range(layers)))
        return cls(cfg["hidden_size"], layers, heads, cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   cfg["intermediate_size"], cfg["vocab_size"], **moe)

    def _params(self, experts_per_layer: float) -> float:
        """q, k, v, o and the MLPs over all layers (biases and norms are noise), with
        `experts_per_layer` experts of each sparse layer."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        dense = self.layers - self.sparse_layers
        sparse = (experts_per_layer * 3 * self.hidden * self.expert_intermediate
                  + 3 * self.hidden * self.shared_intermediate + self.hidden * self.experts)
        return (self.layers * (qkv + o) + dense * 3 * self.hidden * self.intermediate
                + self.sparse_layers * sparse)

    @property
    def linear_params(self) -> int:
        """The linear parameters a token multiplies (its k experts of a sparse layer)."""
        return int(self._params(self.top_k))

    def step_weight_params(self, tokens: int) -> int:
        """The linear parameters a step of `tokens` tokens reads (all of a dense model;
        the experts its tokens reach, expected under uniform routing)."""
        if not self.experts:
            return self.linear_params
        reached = self.experts * (1 - (1 - self.top_k / self.experts) ** max(tokens, 1))
        return int(self._params(reached))

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden  # read per step even when tied to the embedding

    def attention_flops(self, first: int, end: int) -> int:
        """Tokens at positions first..end-1 of one sequence, each attending to t+1 keys."""
        keys = (end * (end + 1) - first * (first + 1)) // 2
        return 4 * self.layers * self.heads * self.head_dim * keys

    def kv_elements_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim


def load_config(name: str) -> dict | None:
    path = MODEL_CONFIGS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


@functools.lru_cache(maxsize=None)
def request_lengths(workload: str, vocab: int, rep: int = 0) -> tuple[tuple[int, int], ...]:
    """((prompt_len, output_len), ...) of bench/workloads.py's requests."""
    w = workloads(False, vocab)[workload]
    return tuple((len(ids), out) for ids, out in w.requests(rep))


def step_s(flops: float, nbytes: float) -> float:
    return max(flops / PEAK_FLOPS, nbytes / HBM_BYTES_PER_S)


def floor(cfg: dict, lengths: list[tuple[int, int]], weight_bytes: float = 2,
          kv_bytes: float = 2) -> dict:
    """FLOPs, bytes, `bound_s` and `ideal_s` of serving `lengths` (see the module doc)."""
    m = Model.from_config(cfg)

    def weights_for(tokens: int) -> float:
        return (m.step_weight_params(tokens) + m.lm_head_params) * weight_bytes

    kv_token = m.kv_elements_per_token() * kv_bytes
    linear_token, lm_head_row = 2 * m.linear_params, 2 * m.lm_head_params
    tokens = sum(p + o - 1 for p, o in lengths)
    steps = max(1, max(o for _, o in lengths))
    flops = {"linear": linear_token * tokens,
             "attention": sum(m.attention_flops(0, p + o - 1) for p, o in lengths),
             "lm_head": lm_head_row * sum(o for _, o in lengths)}
    # A decode producing output j (1..o-1) reads the p + j - 1 cached tokens before its input.
    kv_read_tokens = sum((o - 1) * p + (o - 1) * (o - 2) // 2 for p, o in lengths)
    # The fewest steps: the prefill (every prompt) then decodes of all the requests.
    weights = weights_for(sum(p for p, _ in lengths))
    nbytes = {"weights": weights + weights_for(len(lengths)) * (steps - 1),
              "kv_read": kv_token * kv_read_tokens, "kv_write": kv_token * tokens}
    compute_s = sum(flops.values()) / PEAK_FLOPS
    memory_s = sum(nbytes.values()) / HBM_BYTES_PER_S

    ideal = 0.0
    chunk = {"tokens": 0, "flops": 0, "kv_read": 0}

    def flush() -> float:
        t = step_s(chunk["flops"], weights_for(chunk["tokens"])
                   + kv_token * (chunk["kv_read"] + chunk["tokens"]))
        chunk.update(tokens=0, flops=0, kv_read=0)
        return t

    for p, _ in lengths:
        done = 0
        while done < p:
            take = min(p - done, PREFILL_CHUNK - chunk["tokens"])
            chunk["tokens"] += take
            chunk["flops"] += linear_token * take + m.attention_flops(done, done + take)
            chunk["kv_read"] += done  # a later chunk of a prompt reads its earlier K/V
            done += take
            if done == p:
                chunk["flops"] += lm_head_row
            if chunk["tokens"] == PREFILL_CHUNK:
                ideal += flush()
    if chunk["tokens"]:
        ideal += flush()
    for s in range(1, steps):
        running = [p for p, o in lengths if o > s]
        context = sum(running) + len(running) * (s - 1)  # cached tokens before the inputs
        step_flops = (len(running) * (linear_token + lm_head_row)
                      + sum(m.attention_flops(p + s - 1, p + s) for p in running))
        ideal += step_s(step_flops, weights_for(len(running))
                        + kv_token * (context + len(running)))

    # The bound's side (compute or memory) and its largest part, as a share of the bound.
    side, parts = (("compute", {PART_NAMES[k]: v / PEAK_FLOPS for k, v in flops.items()})
                   if compute_s >= memory_s else
                   ("memory", {PART_NAMES[k]: v / HBM_BYTES_PER_S for k, v in nbytes.items()}))
    part = max(parts, key=parts.get)
    return {"requests": len(lengths), "prompt_tokens": sum(p for p, _ in lengths),
            "output_tokens": sum(o for _, o in lengths), "min_steps": steps,
            "flops": {**flops, "total": sum(flops.values())},
            "bytes": {**nbytes, "total": sum(nbytes.values())},
            "compute_s": compute_s, "memory_s": memory_s,
            "bound_s": max(compute_s, memory_s), "ideal_s": ideal,
            "dominant": f"{side}: {part} ({parts[part] / max(compute_s, memory_s):.0%})"}


def workload_floor(cfg: dict, workload: str, weight_bytes: float = 2,
                   kv_bytes: float = 2) -> dict:
    """`floor` of a bench/workloads.py workload (rep 0), with its metric at both times."""
    metric = workloads(False, cfg["vocab_size"])[workload].metric
    res = floor(cfg, list(request_lengths(workload, cfg["vocab_size"])), weight_bytes,
                kv_bytes)
    tokens = res["prompt_tokens" if metric == "prompt_tok_per_s" else "output_tokens"]
    return {"workload": workload, "rep": 0, "metric": metric, **res,
            "bound_value": tokens / res["bound_s"], "ideal_value": tokens / res["ideal_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+",
                    default=["qwen2.5-0.5b-instruct", "qwen3-0.6b", "llama-3.1-8b"],
                    help="stems of bench/model_configs/*.json")
    ap.add_argument("--workloads", default="w1,w2,w5,w6")
    ap.add_argument("--weight-bytes", type=float, default=2, help="per parameter (fp8: 1)")
    ap.add_argument("--kv-bytes", type=float, default=2, help="per KV element (fp8: 1)")
    ap.add_argument("--out", help="JSON file for every figure")
    args = ap.parse_args(argv)
    chosen = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    result = {}
    for name in args.model:
        cfg = load_config(name)
        if cfg is None:
            raise SystemExit(f"no model config {name!r} under {MODEL_CONFIGS}")
        rows = result[name] = [workload_floor(cfg, w, args.weight_bytes, args.kv_bytes)
                               for w in chosen]
        print(f"\n{name} (weights {args.weight_bytes:g} B/param, KV {args.kv_bytes:g} B)")
        print(f"{'workload':8} {'metric':16} {'bound':>10} {'ideal':>10}  dominant (bound)")
        for r in rows:
            print(f"{r['workload']:8} {r['metric']:16} {r['bound_value']:10,.0f} "
                  f"{r['ideal_value']:10,.0f}  {r['dominant']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
