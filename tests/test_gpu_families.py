"""Every model family on a real GPU (skipped without CUDA): the tiny random models of
tests/test_model_families.py in fp32, through the engine's fast paths (CUDA graphs for
decode and mixed steps, pipelined steps, the Triton attention with windows and soft-caps,
the grouped expert GEMMs, the fused kernels), give transformers' greedy tokens; their bf16
runs finish with the block pool whole. On two GPUs, tensor parallelism (a rank a GPU, the
all-reduces through NCCL, eager and inside CUDA graphs) gives one GPU's greedy tokens for
every family it splits."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from conftest import hf_greedy
from test_model_families import FAMILIES, MAX_NEW, PROMPTS, family_dirs  # noqa: F401

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
FP32 = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=128,
            num_kv_blocks=64)
SAMPLED = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_NEW,
                          ignore_eos=True)] * 3


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(),
                                dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=8)],
                         ids=["eager", "graphs", "chunked"])
def test_fp32_greedy_matches_transformers_on_the_gpu(family_dirs, family, kw):  # noqa: F811
    llm = LLM(str(family_dirs[family]), **FP32, **kw)
    assert greedy(llm) == hf_greedy(family_dirs[family], PROMPTS, MAX_NEW)
    assert llm.engine.scheduler.pool.all_free()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_runs_with_sampling_and_frees_its_blocks(family_dirs, family):  # noqa: F811
    llm = LLM(str(family_dirs[family]), **{**FP32, "dtype": "bfloat16"})
    outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert llm.engine.scheduler.pool.all_free()


@two_gpus
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])
def test_tp2_matches_one_gpu_in_fp32(family_dirs, family):  # noqa: F811
    """Eagerly, and as CUDA graphs with the NCCL broadcasts, all-reduces and gather
    inside them (every rank captures; a failed capture on any rank would leave none)."""
    want = greedy(LLM(str(family_dirs[family]), **FP32))
    for kw in (dict(enforce_eager=True), dict()):
        llm = LLM(str(family_dirs[family]), tensor_parallel_size=2, **FP32, **kw)
        if not kw:
            runner = llm.engine.runner
            assert runner.graph_runner.graphs and runner.mixed_runner.graphs
        assert greedy(llm) == want
        assert llm.engine.scheduler.pool.all_free()


@two_gpus
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_tp2_bf16_sampled(family_dirs, quantization):  # noqa: F811
    llm = LLM(str(family_dirs["mistral"]), tensor_parallel_size=2, quantization=quantization,
              **{**FP32, "dtype": "bfloat16"})
    outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert llm.engine.scheduler.pool.all_free()
