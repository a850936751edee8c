"""The CUDA-graph decode path's bucketing, padding and static buffers, run without a GPU,
and the Triton attention backend end to end under TRITON_INTERPRET=1."""


import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import decode_prelude_enabled
from minivllm.worker.cuda_graph_runner import (DecodeGraphRunner, DecodeInputs, bucket_for,
                                               decode_buckets, make_prelude)
from conftest import random_prompts


def test_buckets():
    b = decode_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256
    assert b == sorted(set(b))
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    assert bucket_for(3, b) == 4 and bucket_for(17, b) == 24 and bucket_for(256, b) == 256
    assert bucket_for(257, b) is None


def test_decode_inputs_pad_rows():
    inp = DecodeInputs(8, 6, torch.device("cpu"))
    inp.fill([5, 6, 7, 8, 9], [10, 20, 30, 40, 50], [[1], [2, 3], [4], [5], [6, 7, 8, 9]], 8)
    inp.fill([11, 12, 13], [3, 17, 33], [[4], [5, 6], [7, 8, 9]], 4)
    assert inp.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inp.seq_lens[:4].tolist() == [3, 17, 33, 0]  # padding row: length 0
    assert inp.block_tables[1, :2].tolist() == [5, 6]
    assert inp.block_tables[2, :3].tolist() == [7, 8, 9]


def _attach_graph_runner(llm):
    runner = llm.engine.runner
    cfg = llm.engine.config
    runner.graph_runner = DecodeGraphRunner(
        runner.model, runner.kv_cache.layers, max_batch=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), block_size=cfg.block_size,
        max_model_len=cfg.max_model_len, device=torch.device("cpu"),
        use_compile=False, use_graphs=False)
    return runner.graph_runner


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_decode_path_matches_eager(tiny_model_dirs, family):
    prompts = random_prompts(5, 256, 3, 40, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=14, ignore_eos=True,
                             logprobs=2)] * 2 + [SamplingParams(temperature=0.0, max_tokens=3)]
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4, max_num_seqs=6)
    eager = LLM(str(tiny_model_dirs[family]), **kw)
    want = eager.generate(prompts, params, use_tqdm=False)
    padded = LLM(str(tiny_model_dirs[family]), **kw)
    graphs = _attach_graph_runner(padded)
    calls = []
    orig = graphs.run
    graphs.run = lambda *a: calls.append(len(a[1])) or orig(*a)
    got = padded.generate(prompts, params, use_tqdm=False)
    assert 5 in calls  # a batch of 5 padded to the bucket of 6
    for w, g in zip(want, got):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        if w.outputs[0].logprobs:
            for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert a.keys() == b.keys()
    assert padded.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("family,fused", [("qwen3", True), ("llama", True), ("qwen2", True),
                                          ("qwen3", False)])
def test_triton_backend_in_interpreter_matches_torch(tiny_model_dirs, monkeypatch, family,
                                                     fused):
    """The GPU model path (Triton attention, and the fused norm/rotary/KV-store/SiLU
    kernels) run by Triton's interpreter gives the torch path's tokens."""
    pytest.importorskip("triton")
    # 5, 6 and 17 tokens (28 in all, not 37: each is a program of every interpreted kernel
    # in the prefill); the 17-token prompt spans two KV blocks and two attention tiles.
    prompts = random_prompts(3, 256, 5, 18, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=64, block_size=16, max_num_seqs=4)
    want = LLM(str(tiny_model_dirs[family]), **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("MINIVLLM_FUSED_OPS", "1" if fused else "0")
    llm = LLM(str(tiny_model_dirs[family]), **kw)
    assert llm.engine.runner.model.model.layers[0].self_attn.attn.backend == "triton"
    assert llm.engine.runner.model.model.fused_ops is fused
    _attach_graph_runner(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("budget,max_len", [(100, 64), (64, 64), (30, 64)])
def test_profile_batch_is_a_valid_prefill(tiny_model_dirs, budget, max_len):
    """The GPU memory-profiling batch must be a legal prefill (positions inside the rotary
    table, slots inside its scratch cache): checked here with the reference backend."""
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=max_len,
              max_num_batched_tokens=budget, max_num_seqs=4)
    runner = llm.engine.runner
    ids, pos, meta, scratch = runner.profile_batch()
    assert ids.shape[0] == budget and int(pos.max()) < max_len
    assert meta.query_start_loc_host[-1] == budget
    assert int(meta.slot_mapping.max()) < scratch.num_blocks * scratch.block_size
    with torch.inference_mode():
        hidden = runner.model(ids, pos, scratch.layers, meta)
    assert torch.isfinite(hidden).all()


def test_profile_batch_runs_through_triton_kernels(tiny_model_dirs, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    # 24 tokens: sequences of 16 (the whole rotary table) and 8; each token is a program of
    # every interpreted kernel.
    llm = LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=16,
              max_num_batched_tokens=24, max_num_seqs=4)
    ids, pos, meta, scratch = llm.engine.runner.profile_batch()
    with torch.inference_mode():
        hidden = llm.engine.runner.model(ids, pos, scratch.layers, meta)
    assert torch.isfinite(hidden).all()


@pytest.mark.slow
def test_compiled_decode_step_matches_eager(tiny_model_dirs, monkeypatch):
    """torch.compile of the decode step (Inductor's CPU backend here, the Triton kernels as
    opaque custom ops run by the interpreter) gives the same tokens as eager decoding."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("MINIVLLM_COMPILE", "1")  # so the model leaves fusion to Inductor
    prompts = random_prompts(3, 256, 5, 18, seed=31)  # 5, 6, 17: see the test above
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=64, block_size=16, max_num_seqs=4)
    want = LLM(str(tiny_model_dirs["qwen2"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["qwen2"]), **kw)
    runner, cfg = llm.engine.runner, llm.engine.config
    runner.graph_runner = DecodeGraphRunner(
        runner.model, runner.kv_cache.layers, max_batch=4, max_blocks=cfg.max_blocks_per_seq(),
        block_size=cfg.block_size, max_model_len=cfg.max_model_len,
        device=torch.device("cpu"), use_compile=True, use_graphs=False)
    runner.graph_runner.capture()
    assert runner.graph_runner.compiled
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_broken_fused_kernels_fall_back_to_torch_ops(tiny_model_dirs, monkeypatch):
    """A fused kernel that fails its self-check turns fusion off; the engine still runs."""
    pytest.importorskip("triton")
    import csrc_triton

    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("MINIVLLM_FUSED_OPS", "1")

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel on this device")

    monkeypatch.setattr(csrc_triton, "silu_and_mul", broken)
    kw = dict(skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2)
    llm = LLM(str(tiny_model_dirs["qwen2"]), **kw)
    assert llm.engine.runner.model.model.fused_ops is False
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_decode_fused_reduce_in_the_graph_runner(tiny_model_dirs, monkeypatch):
    """The decode graph runner hands the attention kernels
    its counters (the split-KV decode combines its splits in place); the tokens are the
    torch path's, and the counters are zero again after every step."""
    pytest.importorskip("triton")
    import csrc_triton

    # max_model_len 256 gives the graphed step two splits; each sequence of 18-24 tokens
    # (21 and 20, decoding to 23 and 22) spreads over both (its chunk is cdiv(len, 2)
    # rounded up to the kernel's 16-token tile: 16, the rest in the second split). Short
    # prompts: their prefill through the interpreted kernels is most of the test's time.
    prompts = random_prompts(2, 256, 18, 24, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=256, block_size=16, max_num_seqs=2)
    want = LLM(str(tiny_model_dirs["qwen2"]), **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(str(tiny_model_dirs["qwen2"]), **kw)
    graphs = _attach_graph_runner(llm)
    splits, fused = [], []
    orig = csrc_triton.paged_attention_decode

    def spy(*a, **k):
        splits.append(k.get("num_splits") or csrc_triton.decode_num_splits(
            a[0].shape[0], a[1].shape[2], a[6], a[0].device))
        fused.append(k.get("counters") is graphs.decode_counters)
        out = orig(*a, **k)
        assert not graphs.decode_counters.any()
        return out

    monkeypatch.setattr(csrc_triton, "paged_attention_decode", spy)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert fused and all(fused) and max(splits) > 1


def test_decode_prelude_switch_and_gemm(tiny_model_dirs, monkeypatch):
    """The GEMM launched before each decode replay (CUDA graphs only) is the first layer's
    down projection of a zero row: it reads the model and changes nothing.
    MINIVLLM_DECODE_PRELUDE=0 turns it off."""
    assert decode_prelude_enabled()
    monkeypatch.setenv("MINIVLLM_DECODE_PRELUDE", "0")
    assert not decode_prelude_enabled()
    monkeypatch.delenv("MINIVLLM_DECODE_PRELUDE")
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64)
    runner = llm.engine.runner
    assert runner.graph_runner is None or runner.graph_runner.prelude is None  # CPU: no graphs
    model = runner.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = make_prelude(model, torch.device("cpu"))()
    assert out.shape == (1, model.config.hidden_size) and not out.any()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
