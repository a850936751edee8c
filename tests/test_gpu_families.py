"""Every model family on a real GPU (skipped without CUDA): the tiny random models of
tests/test_model_families.py in fp32, through the engine's fast paths (CUDA graphs for
decode and mixed steps, pipelined steps, the Triton attention with windows and soft-caps,
the grouped expert GEMMs, the fused kernels), give transformers' greedy tokens; their bf16
runs finish with the block pool whole."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from conftest import hf_greedy
from test_model_families import FAMILIES, MAX_NEW, PROMPTS, make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"gpu-family-{family}")
        make_model(family, d)
        dirs[family] = d
    return dirs


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(),
                                dict(block_size=16, max_num_batched_tokens=32)],
                         ids=["eager", "graphs", "chunked"])
def test_fp32_greedy_matches_transformers_on_the_gpu(family_dirs, family, kw):
    want = hf_greedy(family_dirs[family], PROMPTS, MAX_NEW)
    llm = LLM(str(family_dirs[family]), skip_tokenizer_init=True, device="cuda",
              dtype="float32", max_model_len=128, num_kv_blocks=64, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_runs_with_sampling_and_frees_its_blocks(family_dirs, family):
    llm = LLM(str(family_dirs[family]), skip_tokenizer_init=True, device="cuda",
              dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_NEW,
                             ignore_eos=True)] * 3
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert llm.engine.scheduler.pool.all_free()
