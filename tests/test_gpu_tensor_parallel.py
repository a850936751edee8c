"""Tensor parallelism on two GPUs (skipped with fewer): one rank a GPU, the all-reduces
through NCCL. In fp32 TP=2 gives TP=1's greedy tokens for every family it splits (sliding
windows, soft-caps, experts split by their inner columns); bf16 and sampled requests run to
the end with the block pool whole."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from test_model_families import FAMILIES, MAX_NEW, PROMPTS, make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

SPLIT = [f for f in FAMILIES if f != "gpt2"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {}
    for family in SPLIT:
        d = tmp_path_factory.mktemp(f"tp-family-{family}")
        make_model(family, d)
        dirs[family] = d
    return dirs


@pytest.mark.parametrize("family", SPLIT)
def test_tp2_matches_tp1_in_fp32(family_dirs, family):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=128,
              num_kv_blocks=64)
    want = [o.outputs[0].token_ids
            for o in LLM(str(family_dirs[family]), **kw).generate(PROMPTS, params,
                                                                 use_tqdm=False)]
    llm = LLM(str(family_dirs[family]), tensor_parallel_size=2, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.scheduler.pool.all_free()


def test_tp2_bf16_sampled_and_fp8(family_dirs):
    for quantization in (None, "fp8"):
        llm = LLM(str(family_dirs["mistral"]), skip_tokenizer_init=True, device="cuda",
                  dtype="bfloat16", max_model_len=128, num_kv_blocks=64,
                  tensor_parallel_size=2, quantization=quantization)
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_NEW,
                                 ignore_eos=True)] * 3
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
        assert llm.engine.scheduler.pool.all_free()
