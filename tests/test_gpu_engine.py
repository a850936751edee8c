"""The engine on a real GPU (skipped without CUDA): every fast path gives the tokens of the
plain eager engine, in fp32 where rounding cannot flip a greedy choice."""

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from conftest import GPU_TEST_CONFIG as CONFIG, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _run(config_path, monkeypatch, env: dict, prompts, params, **kw):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    llm = LLM(str(config_path), load_format="dummy", dtype="float32", device="cuda",
              skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, num_kv_blocks=512, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.pool.all_free()
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name,env,kw", [
    ("fused eager", {"MINIVLLM_FUSED_OPS": "1"}, {"enforce_eager": True}),
    ("decode graphs", {"MINIVLLM_PIPELINE": "0"}, {"max_graph_tokens": 0}),
    ("mixed graphs", {"MINIVLLM_PIPELINE": "0"}, {}),
    ("pipelined", {"MINIVLLM_PIPELINE": "1"}, {}),
    # Steps past 64 tokens run eagerly through the mixed-step runner, launched ahead.
    ("long steps pipelined", {"MINIVLLM_PIPELINE": "1"}, {"max_graph_tokens": 64}),
    ("no prefix cache", {}, {"enable_prefix_caching": False}),
])
def test_fast_paths_match_eager(config_path, monkeypatch, name, env, kw):
    prompts = random_prompts(12, 4096, 3, 200, seed=41)
    prompts += [prompts[0][:150] + [9, 9, 9]]  # a shared prefix for the cache
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)] * 4
    params += [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    with monkeypatch.context() as m:
        want = _run(config_path, m, {"MINIVLLM_FUSED_OPS": "0", "MINIVLLM_PIPELINE": "0"},
                    prompts, params, enforce_eager=True)
    got = _run(config_path, monkeypatch, env, prompts, params, **kw)
    assert got == want, name


def test_long_steps_replay_graphs_on_the_gpu(tmp_path, monkeypatch):
    """Steps of 1,100 to 3,072 tokens: with buckets past 1,024 tokens, a tiny model's replay
    is measured faster than an eager step's launches, so its long steps replay graphs
    (padded); the tokens are the eager engine's."""
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**CONFIG, "max_position_embeddings": 4096}))
    prompts = random_prompts(4, 4096, 1100, 2900, seed=43)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(load_format="dummy", dtype="float32", device="cuda", skip_tokenizer_init=True,
              max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=3072,
              num_kv_blocks=256)
    with monkeypatch.context() as m:
        m.setenv("MINIVLLM_FUSED_OPS", "0")
        eager = LLM(str(config_path), enforce_eager=True, **kw)
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params,
                                                                use_tqdm=False)]
        del eager
    llm = LLM(str(config_path), **kw)
    runner = llm.engine.runner.mixed_runner
    assert runner.buckets[-4:] == [1536, 2048, 2560, 3072]
    assert runner.replay_pays  # a 4-layer model: its replays beat ~60 Python launches
    steps = []
    orig = runner.run
    runner.run = lambda host, *a: steps.append(len(host.input_ids)) or orig(host, *a)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(n > 1024 and runner.replay_bucket(n) is not None for n in steps), steps


def test_preemption_on_the_gpu(config_path, monkeypatch):
    prompts = random_prompts(10, 4096, 20, 60, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with monkeypatch.context() as m:
        want = _run(config_path, m, {}, prompts, params)
    llm = LLM(str(config_path), load_format="dummy", dtype="float32", device="cuda",
              skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16,
              num_kv_blocks=24, block_size=16)  # 384 tokens for 10 sequences of up to 100
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want


def _fp32_llm(config_path, monkeypatch, pipelined: str) -> LLM:
    """The dummy fp32 engine with its graphs, pipelined ("1") or step by step ("0")."""
    monkeypatch.setenv("MINIVLLM_PIPELINE", pipelined)
    return LLM(str(config_path), load_format="dummy", dtype="float32", device="cuda",
               skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16, num_kv_blocks=512)


def test_arrivals_join_pipelined_decodes_on_the_gpu(config_path, monkeypatch):
    """Requests added while decode steps are in flight join them in mixed-step graphs
    launched ahead (their decode rows read the pending tokens on the device): the same
    tokens as step-by-step decoding with the same graphs, fp32."""
    prompts = random_prompts(10, 4096, 3, 60, seed=43)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=25, ignore_eos=True)] * 5
    results = {}
    for pipelined in ("0", "1"):
        llm = _fp32_llm(config_path, monkeypatch, pipelined)
        eng, final = llm.engine, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(p, sp, request_id=f"r{i}")
            for _ in range(2 + i % 3):  # arrivals every few steps, decodes in flight
                final.update({o.request_id: o.outputs[0].token_ids for o in eng.step()
                              if o.finished})
        while eng.has_unfinished_requests():
            final.update({o.request_id: o.outputs[0].token_ids for o in eng.step()
                          if o.finished})
        eng.step()
        assert eng.scheduler.pool.all_free()
        results[pipelined] = final
    assert results["1"] == results["0"] and len(results["1"]) == 10


def test_repeated_prompts_behind_a_pending_step_on_the_gpu(config_path, monkeypatch):
    """One prompt per generate() call, each stopping on a token, so a step is still pending
    when the next call starts; each prompt twice, the second time all cached but its last
    token (block size 16, lengths 16k + 1). Same tokens as step-by-step decoding."""
    prompts = [random_prompts(1, 4096, n, n, seed=44 + n)[0] for n in (17, 33, 20)]
    results = {}
    for pipelined in ("0", "1"):
        llm = _fp32_llm(config_path, monkeypatch, pipelined)
        if pipelined == "0":
            free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True), use_tqdm=False)
            stops = [o.outputs[0].token_ids[5] for o in free]
        results[pipelined] = [
            llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12,
                                             stop_token_ids=[s]), use_tqdm=False)[0]
            .outputs[0].token_ids for _ in range(2) for p, s in zip(prompts, stops)]
        assert llm.engine.scheduler.pool.all_free()
    assert results["1"] == results["0"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_the_gpu(config_path, tmp_path, monkeypatch, method):
    """Verification steps replayed from the mixed-step graphs (and, with a draft model, its
    drafting steps from its own decode graphs), some sequences preempted: greedy tokens as
    the plain eager engine's, fp32; sampled ones as long as asked and reproducible."""
    rng = __import__("random").Random(44)
    prompts = []
    for i in range(10):
        phrase = [rng.randrange(3, 4096) for _ in range(5 + i)]
        prompts.append(phrase * 4)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    params += [SamplingParams(temperature=0.7, seed=3, max_tokens=30, ignore_eos=True)] * 2
    with monkeypatch.context() as m:
        want = _run(config_path, m, {"MINIVLLM_PIPELINE": "0"}, prompts, params,
                    enforce_eager=True)
    draft = tmp_path / "draft" / "config.json"
    draft.parent.mkdir()
    draft.write_text(json.dumps(dict(CONFIG, num_hidden_layers=2)))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    if method == "draft_model":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    runs = []
    for _ in range(2):
        llm = LLM(str(config_path), load_format="dummy", dtype="float32", device="cuda",
                  skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
                  num_kv_blocks=60, block_size=8, speculative_config=spec)
        runs.append([[c.token_ids for c in o.outputs]
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.scheduler.pool.all_free()
        assert llm.engine.stats["spec_decode_num_drafts"] > 0
        assert llm.engine.runner.last_step is not None
    assert runs[0][:8] == want[:8]
    assert runs[0] == runs[1]  # the seeded sampled ones too
    assert [len(t[0]) for t in runs[0][8:]] == [30, 30]


def test_argmax_kernel_on_the_gpu():
    """The graphed steps' argmax (csrc_triton.argmax_rows) at Llama-3.1-8B's and Qwen's
    vocabulary sizes, in a CUDA graph too."""
    from minivllm.worker.sampler import argmax_rows

    for vocab in (128256, 151936):
        x = torch.randn(9, vocab, device="cuda").to(torch.bfloat16)
        x[1, 3] = x[1, vocab - 256] = 60.0
        x[2] = 1.0
        x[3, 77] = float("nan")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        out = torch.empty(9, dtype=torch.long, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            argmax_rows(x, out=out)
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))
