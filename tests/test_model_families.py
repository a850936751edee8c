"""The model families beyond Llama and Qwen: tiny random models made by transformers, greedy
fp32 output token for token equal to its `generate` (prompts of different lengths in one
batch, sliding windows shorter than prompt + output, preemption and prefix caching on, the
block pool whole after); and every config field of each family either used or knowingly
ignored."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.families import MODEL_TYPES, unread_fields
from conftest import hf_greedy, random_prompts

MAX_NEW = 12
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "mistral": dict(_BASE, model_type="mistral", sliding_window=16, head_dim=16,
                    tie_word_embeddings=False),
    "phi3": dict(_BASE, model_type="phi3", sliding_window=24, tie_word_embeddings=False,
                 original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                  "long_factor": [2.0 + 0.3 * i for i in range(8)],
                                  "original_max_position_embeddings": 32}),
    "gemma": dict(_BASE, model_type="gemma", head_dim=32, num_key_value_heads=1,
                  hidden_activation="gelu_pytorch_tanh", attention_bias=True),
    "gemma2": dict(_BASE, model_type="gemma2", head_dim=32, sliding_window=16,
                   attn_logit_softcapping=20.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3": dict(_BASE, model_type="gemma3_text", head_dim=32, sliding_window=16,
                   query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}),
    "mixtral": dict(_BASE, model_type="mixtral", sliding_window=16, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False),
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=False,
                      tie_word_embeddings=True),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
                      tie_word_embeddings=False, attention_bias=True),  # o's bias too
    "gpt2": dict(model_type="gpt2", n_embd=64, n_head=4, n_layer=3, n_positions=256,
                 vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def make_model(family: str, folder) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(FAMILIES[family])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
            else:  # GPT-2's smaller weights need more spread for clear greedy choices
                p.normal_(0.0, 0.2 if family == "gpt2" else 0.08)
    model.eval().save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"family-{family}")
        make_model(family, d)
        dirs[family] = d
    return dirs


# Lengths from 3 to 28: prompt + output crosses the 16-token windows and Phi-3's 32
# original positions (LongRoPE's switch) in decode.
PROMPTS = random_prompts(6, 256, 3, 28, seed=5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family_dirs, family):
    want = hf_greedy(family_dirs[family], PROMPTS, MAX_NEW)
    assert len({t for r in want for t in r}) > 3, want
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for kw in (dict(max_model_len=128),
               dict(max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4),
               dict(max_model_len=48, block_size=4, num_kv_blocks=12, max_num_seqs=6)):  # preempts
        llm = LLM(str(family_dirs[family]), skip_tokenizer_init=True, **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want, kw
        # Again, now from the prefix cache.
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert again == want, kw
        assert llm.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_every_config_field_is_used_or_knowingly_ignored(model_type):
    """transformers' config of each supported family has no field this engine neither
    reads nor lists as not changing the computation."""
    from transformers import AutoConfig
    from minivllm.model.families import ARCHITECTURES
    family = ARCHITECTURES[MODEL_TYPES[model_type]]
    fields = set(AutoConfig.for_model(model_type).to_dict())
    unknown = unread_fields(family, dict.fromkeys(fields))
    assert not unknown, f"{model_type}: fields neither used nor ignored: {unknown}"


def test_an_unread_config_field_is_named_at_load(family_dirs, caplog):
    import json

    from minivllm.config import ModelConfig
    config = json.loads((family_dirs["mistral"] / "config.json").read_text())
    with caplog.at_level("WARNING", logger="minivllm"):
        ModelConfig.from_dict(config)
        assert "does not read" not in caplog.text
        ModelConfig.from_dict({**config, "attn_logit_softcapping": 30.0})
    assert "does not read" in caplog.text and "attn_logit_softcapping" in caplog.text


@pytest.mark.parametrize("cfg,needle", [
    (dict(model_type="gemma2", use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(model_type="gpt2", scale_attn_by_inverse_layer_idx=True), "inverse_layer_idx"),
    (dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
    (dict(model_type="falcon"), "Unsupported model architecture"),
])
def test_unsupported_settings_are_refused(cfg, needle):
    from transformers import AutoConfig
    from minivllm.config import ModelConfig
    model_type = cfg.pop("model_type")
    try:
        raw = AutoConfig.for_model(model_type, **cfg).to_dict()
    except ValueError:
        raw = {"model_type": model_type, **cfg}
    raw.update(cfg)
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict(raw)


def test_blocks_out_of_the_window_go_back_to_the_pool(family_dirs):
    """Mistral's window of 16: past it a sequence holds ~window / block_size + 1 blocks
    however long it runs (the rest are HOLEs), the output is still transformers', and the
    pool is whole after; forks (n=2) and preemption keep the count right."""
    from minivllm.engine.scheduler import HOLE
    prompt = random_prompts(1, 256, 30, 30, seed=9)
    want = hf_greedy(family_dirs["mistral"], prompt, 60)
    llm = LLM(str(family_dirs["mistral"]), skip_tokenizer_init=True, max_model_len=128,
              block_size=4)
    engine = llm.engine
    assert engine.scheduler.sliding_window == 16
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request(prompt[0], params, request_id="long")
    held = []
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        for seq in engine.scheduler.running:
            held.append(len(seq.block_table) - seq.num_dropped_blocks)
            assert seq.block_table[:seq.num_dropped_blocks] == [HOLE] * seq.num_dropped_blocks
    assert outputs["long"].outputs[0].token_ids == want[0]
    assert max(held[len(held) // 2:]) <= 16 // 4 + 2  # flat, not growing with the output
    assert engine.scheduler.pool.all_free()
    # Samples forked from a prompt longer than the window, and a pool small enough to preempt.
    small = LLM(str(family_dirs["mistral"]), skip_tokenizer_init=True, max_model_len=96,
                block_size=4, num_kv_blocks=24)
    prompts = random_prompts(4, 256, 20, 40, seed=3)
    refs = hf_greedy(family_dirs["mistral"], prompts, 30)
    outs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30,
                                                  ignore_eos=True, n=2), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in refs]
    assert small.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_path_in_the_interpreter(family_dirs, monkeypatch, family):
    """The GPU model path (the Triton attention kernels run by the interpreter, with their
    windows and soft-capping, and the padded decode path) gives the torch path's tokens:
    a prompt longer than the 16-token windows beside a short one (two lengths in one
    batch), blocks of 4 freed behind it."""
    from test_decode_graph_cpu import _attach_graph_runner
    # 17 + 5 tokens: each prefill token is a program of every interpreted kernel, so only
    # the one prompt that must cross the windows is long.
    prompts = random_prompts(1, 256, 17, 17, seed=8) + random_prompts(1, 256, 5, 5, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=48, block_size=4, max_num_seqs=4)
    want = LLM(str(family_dirs[family]), **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(str(family_dirs[family]), **kw)
    _attach_graph_runner(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dummy_weights(family_dirs, family):
    """load_format="dummy" fills every parameter from the config alone (the benchmarks'
    configs in bench/model_configs/ load the same way)."""
    llm = LLM(str(family_dirs[family]), skip_tokenizer_init=True, max_model_len=32,
              load_format="dummy")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("method,dtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8),
                                          ("int4", torch.uint8)])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantization_covers_the_experts(family_dirs, family, method, dtype):
    """quantization="fp8" / "int8" / "int4" stores the experts in e4m3 / int8 / packed
    4 bits (they dominate a mixture's bytes), and the model still decodes close to its
    full-precision self."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full = LLM(str(family_dirs[family]), skip_tokenizer_init=True, max_model_len=64)
    quant = LLM(str(family_dirs[family]), skip_tokenizer_init=True, max_model_len=64,
                quantization=method)
    moe = next(m for m in quant.engine.runner.model.modules() if hasattr(m, "w13_scale"))
    assert moe.w13.dtype == dtype and moe.w13_scale is not None
    want = [o.outputs[0].token_ids for o in full.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in quant.generate(PROMPTS, params, use_tqdm=False)]
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert same >= 0.5 * sum(len(w) for w in want)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_families(family_dirs, family):
    """Split over two processes (gloo), every family gives one process's greedy tokens:
    Gemma's sandwich norms and soft-caps, sliding windows with freed blocks, the experts
    split by their inner columns (one all-reduce a mixture), a shared expert, GPT-2's
    fused c_attn and biases everywhere."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=64, block_size=4)
    want = LLM(str(family_dirs[family]), **kw).generate(PROMPTS[:4], params, use_tqdm=False)
    llm = LLM(str(family_dirs[family]), tensor_parallel_size=2, **kw)
    got = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.pool.all_free()


def test_gpt2_refuses_quantization_with_the_reason(family_dirs):
    """GPT-2's Conv1D projections are not quantized: asking for it is an error, not a
    model silently left in full precision."""
    with pytest.raises(ValueError, match="GPT-2 is not quantized"):
        LLM(str(family_dirs["gpt2"]), skip_tokenizer_init=True, max_model_len=64,
            quantization="int8")


@pytest.mark.parametrize("qc,method", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
     "GPTQ"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "FP8")])
def test_a_mixture_quantized_ahead_is_refused_with_the_reason(family_dirs, tmp_path, qc,
                                                              method):
    """A GPTQ or block-wise FP8 mixture of experts: its quantized experts have no loader
    or kernel yet; the error says so before any weight is read, and what to load instead."""
    import json
    config = json.loads((family_dirs["mixtral"] / "config.json").read_text())
    config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"mixture of experts quantized with {method}"):
        LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=64, load_format="dummy")
