"""bench/roofline.py: FLOPs and bytes counted by hand on a tiny model, and the floors'
shape on the real configs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import roofline  # noqa: E402

TINY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32}


def test_one_request_by_hand():
    # Per layer: q,k,v 8 x (2+1+1) x 4 = 128, o 8 x 8 = 64, gate/up/down 3 x 8 x 16 = 384.
    linear, lm_head = 2 * (128 + 64 + 384), 32 * 8
    res = roofline.floor(TINY, [(4, 3)])
    # Prompt 4, output 3: 6 tokens go through (positions 0..5), 3 rows are sampled.
    assert res["flops"]["linear"] == 2 * linear * 6 == 13824
    assert res["flops"]["attention"] == 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4 + 5 + 6) == 1344
    assert res["flops"]["lm_head"] == 2 * lm_head * 3 == 1536
    # 3 steps of weights; K+V 2 x 2 layers x 1 head x 4 x 2 B = 32 B a token; the two
    # decodes read 4 and 5 cached tokens; 6 tokens written.
    weights = 2 * (linear + lm_head)
    assert res["bytes"] == {"weights": 3 * weights, "kv_read": 32 * 9, "kv_write": 32 * 6,
                            "total": 3 * weights + 32 * 15}
    assert res["bound_s"] == pytest.approx((3 * weights + 32 * 15) / 4.28e12)
    # Every step of this schedule is memory-bound and reads the same bytes as the bound.
    assert res["ideal_s"] == pytest.approx(res["bound_s"])
    fp8 = roofline.floor(TINY, [(4, 3)], weight_bytes=1, kv_bytes=1)
    assert fp8["bytes"]["total"] == res["bytes"]["total"] / 2


def test_chunked_prefill_by_hand():
    # Two 6000-token prompts, one output each: chunks of 8192 and 3808 tokens; the second
    # chunk reads the first 2192 tokens of prompt 2 back. 1000-byte KV elements (16 kB a
    # token) make every step memory-bound, so the times are bytes alone.
    res = roofline.floor(TINY, [(6000, 1), (6000, 1)], kv_bytes=1000)
    weights = 2 * (2 * (128 + 64 + 384) + 32 * 8)
    assert res["min_steps"] == 1 and res["bytes"]["kv_read"] == 0
    assert res["bound_s"] == pytest.approx((weights + 16000 * 12000) / 4.28e12)
    assert res["ideal_s"] == pytest.approx(
        (2 * weights + 16000 * (8192 + 3808 + 2192)) / 4.28e12)


def test_longer_outputs_cost_more():
    short, long = (roofline.floor(TINY, [(100, o)]) for o in (10, 20))
    for key in ("weights", "kv_read", "kv_write", "total"):
        assert long["bytes"][key] > short["bytes"][key]
    assert long["bound_s"] > short["bound_s"] and long["ideal_s"] > short["ideal_s"]


@pytest.mark.parametrize("model", ["qwen2.5-0.5b-instruct", "qwen3-0.6b", "llama-3.1-8b"])
def test_ideal_never_beats_the_bound(model):
    cfg = roofline.load_config(model)
    for w in roofline.WORKLOADS:
        res = roofline.workload_floor(cfg, w)
        assert res["ideal_s"] >= res["bound_s"] * (1 - 1e-12)
        assert res["ideal_value"] <= res["bound_value"] * (1 + 1e-12)


def test_llama_8b_figures():
    cfg = roofline.load_config("llama-3.1-8b")
    m = roofline.Model.from_config(cfg)
    # All 8.03e9 parameters (the untied embedding too) are the familiar 16.06 GB in bf16;
    # a step reads all but the embedding table (a gather of a few rows): 15.01 GB.
    assert 2 * (m.linear_params + 2 * m.lm_head_params) == pytest.approx(16.06e9, rel=1e-3)
    step_bytes = 2 * (m.linear_params + m.lm_head_params)
    assert step_bytes == pytest.approx(15.01e9, rel=1e-3)
    w2 = roofline.workload_floor(cfg, "W2")
    assert w2["dominant"].startswith("memory: weight bytes")
    # 256 steps of weights plus a little K/V: just under 4.28e12 / 15.01e9 = 285 tok/s
    # (267 tok/s if the embedding were read every step too).
    assert 0.99 * 4.28e12 / step_bytes < w2["bound_value"] < 4.28e12 / step_bytes
    w5 = roofline.workload_floor(cfg, "W5")
    assert w5["dominant"].startswith("compute: linear FLOPs")
    assert w5["compute_s"] > 10 * w5["memory_s"]


def test_moe_reads_the_experts_its_tokens_reach():
    """A mixture of experts: batch 1 reads the k routed experts of each sparse layer, a
    large batch all of them; FLOPs count k experts per token."""
    from bench.roofline import Model, load_config
    m = Model.from_config(load_config("qwen3-30b-a3b"))
    expert = 3 * m.hidden * m.expert_intermediate
    assert m.step_weight_params(1) == m.linear_params
    full = m.step_weight_params(100_000)
    assert abs(full - m.step_weight_params(1) - m.sparse_layers * (m.experts - m.top_k)
               * expert) < m.sparse_layers * expert * 1e-3
    dense = Model.from_config(load_config("llama-3.1-8b"))
    assert dense.step_weight_params(1) == dense.step_weight_params(256) == dense.linear_params
