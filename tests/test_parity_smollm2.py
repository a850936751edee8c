"""The real SmolLM2-135M-Instruct: greedy chat output equals Hugging Face token for token."""

import pytest
import torch

from minivllm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "What is 2+2?",
    "Name three colors.",
    "Explain what a KV cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a fun fact about octopuses.",
    "Write a Python function that adds two numbers.",
]
MAX_NEW = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    refs = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        refs.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    return refs


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_model_len=1024, max_num_seqs=8)


def _chat(llm, questions):
    return llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)


def test_batched_chat_matches_hf(llm, hf_reference):
    outs = _chat(llm, QUESTIONS)
    for out, (prompt_ids, ref) in zip(outs, hf_reference):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text
    assert llm.engine.scheduler.pool.all_free()


def test_one_at_a_time_matches_hf(llm, hf_reference):
    for q, (_, ref) in zip(QUESTIONS, hf_reference):
        out = _chat(llm, [q])[0]
        assert out.outputs[0].token_ids == ref
