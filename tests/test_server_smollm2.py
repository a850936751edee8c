"""The server with the real default model (SmolLM2-135M-Instruct), end to end: a real
uvicorn server, the openai SDK, a chat answer that is actually right."""

from __future__ import annotations

import openai
import pytest

from minivllm.server.testing import ServerThread

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    # model=None: the default model, served under its folder's name.
    with ServerThread(dict(model=None, max_model_len=512, max_num_seqs=8)) as s:
        yield s


def test_default_model_answers_over_http(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    full = client.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=10,
                                          temperature=0.0)
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=QUESTION, max_tokens=10, temperature=0.0, stream=True, model=model.id))
    assert streamed == text
