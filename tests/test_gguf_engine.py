"""The engine serves a GGUF file directly (weights dequantized, tokenizer from the GGUF)."""

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_llm_on_the_gguf_file_matches_the_converted_folder(default_model_dir):
    from minivllm.default_model import default_gguf_path

    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    gguf = LLM(str(default_gguf_path()), max_model_len=512)
    folder = LLM(str(default_model_dir), max_model_len=512)
    a = gguf.chat(question, params, use_tqdm=False)[0]
    b = folder.chat(question, params, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert "Paris" in a.outputs[0].text
