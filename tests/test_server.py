"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 (free
port, background thread), the real `openai` SDK and httpx, no mocks.

The model is a tiny random Llama with the real SmolLM2 tokenizer and chat template, so
text, chat templates and stop strings behave as with the real model, fast.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from minivllm.engine.engine_core import engine_idle as engine_idle_check
from conftest import sse_events
from minivllm.server.testing import ServerThread, make_tiny_chat_model, wait_until_healthy

MODEL = "tiny-chat"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


# Every test runs against both owners of the engine: a thread of the server's process
# (AsyncLLMEngine's default) and a process of its own (what `minivllm serve` uses).
@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(request, tiny_chat_dir):
    with ServerThread(dict(model=str(tiny_chat_dir), max_model_len=MAX_MODEL_LEN,
                           max_num_seqs=64, num_kv_blocks=2048),
                      served_model_names=[MODEL, "alias"],
                      engine_process=request.param == "engine-process") as s:
        yield s


def engine_idle(server) -> bool:
    return server.engine.submit(engine_idle_check).result(10)


def wait_idle(server, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine_idle(server):
            return True
        time.sleep(0.02)
    return False


def greedy(**kw) -> dict:
    return dict(model=MODEL, temperature=0.0, **kw)


def count_tokens(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


# ---- plain endpoints ---------------------------------------------------------------------

def test_models_health_version(client, http, server, tiny_chat_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    schema = http.get("/openapi.json").json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "503"} <= set(responses)
    assert "ErrorResponse" in json.dumps(responses["400"])
    # Bad input is documented as the 400 it gets, never FastAPI's 422; operation ids are
    # unique (client generators need them so).
    operations = [op for path in schema["paths"].values() for op in path.values()]
    assert not any("422" in op["responses"] for op in operations)
    ids = [op["operationId"] for op in operations]
    assert len(ids) == len(set(ids))
    assert {"get", "delete"} <= set(schema["paths"]["/v1/responses/{response_id}"])


def test_default_served_name_is_the_folder_name(tiny_chat_dir):
    from minivllm.server.api_server import default_model_name

    class Fake:
        model_path = tiny_chat_dir
    assert default_model_name(Fake) == tiny_chat_dir.name


# ---- completions -------------------------------------------------------------------------

def test_completion_non_streaming(client, http):
    r = client.completions.create(prompt="The capital of France is", max_tokens=8,
                                  **greedy())
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == count_tokens(http, "The capital of France is")
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_a_completion_without_max_tokens_stops_at_16(client, http):
    """OpenAI's and vLLM's default for /v1/completions; "max_tokens": null runs on, to
    the room the prompt leaves."""
    r = client.completions.create(prompt="Once upon a time", extra_body={"ignore_eos": True},
                                  **greedy())
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    prompt = "word " * (MAX_MODEL_LEN - 40)
    r = http.post("/v1/completions", json=greedy(prompt=prompt, max_tokens=None,
                                                 ignore_eos=True))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] > 16 and usage["total_tokens"] == MAX_MODEL_LEN


def test_completion_streaming_equals_non_streaming(client):
    kw = greedy(prompt="Once upon a time", max_tokens=12)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_ends_with_done(http):
    r = http.post("/v1/completions", json=greedy(prompt="Hi", max_tokens=4, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


def test_batched_prompts_n_and_choice_indices(client, http):
    prompts = ["Hello there", "A list of fruits:", "1, 2, 3,"]
    singles = [client.completions.create(prompt=p, max_tokens=6, **greedy()).choices[0].text
               for p in prompts]
    r = client.completions.create(prompt=prompts, max_tokens=6, n=2, **greedy())
    assert sorted(c.index for c in r.choices) == list(range(6))
    for c in r.choices:
        assert c.text == singles[c.index // 2]
    assert r.usage.prompt_tokens == sum(count_tokens(http, p) for p in prompts)
    assert r.usage.completion_tokens == 6 * 6
    # Streaming: per-index texts equal, one finish_reason per choice.
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for c in client.completions.create(prompt=prompts, max_tokens=6, n=2, stream=True,
                                       **greedy()):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
    assert texts == {c.index: c.text for c in r.choices}
    assert finishes == {i: 1 for i in range(6)}


def test_token_id_prompts(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_text = client.completions.create(prompt="Hello there", max_tokens=5, **greedy())
    by_ids = client.completions.create(prompt=ids, max_tokens=5, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(prompt=[ids, ids[:1]], max_tokens=5, **greedy())
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == by_text.choices[0].text
    assert two.usage.prompt_tokens == len(ids) + 1


def test_sampled_n_choices_differ_and_seed_reproduces(client):
    kw = dict(model=MODEL, prompt="Tell me", max_tokens=8, temperature=1.0, n=3)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=4321, **kw)
    ta, tb, tc = ([ch.text for ch in sorted(x.choices, key=lambda ch: ch.index)]
                  for x in (a, b, c))
    assert ta == tb
    assert ta != tc
    assert len(set(ta)) > 1  # the n samples are different samples


def test_seed_is_independent_of_other_requests(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                      max_retries=0) as aclient:
            kw = dict(model=MODEL, prompt="Seeded", max_tokens=8, temperature=0.9, seed=7)
            alone = (await aclient.completions.create(**kw)).choices[0].text
            crowd = [aclient.completions.create(model=MODEL, prompt=f"Noise {i}",
                                                max_tokens=8, temperature=1.0)
                     for i in range(6)]
            results = await asyncio.gather(aclient.completions.create(**kw), *crowd)
            return alone, results[0].choices[0].text

    alone, together = asyncio.run(main())
    assert alone == together


def test_completion_logprobs_and_echo(client, http):
    prompt = "The quick brown fox"
    n_prompt = count_tokens(http, prompt)
    r = client.completions.create(prompt=prompt, max_tokens=5, logprobs=3, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0.0
        assert 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tlp)  # greedy: the chosen one is the best
    e = client.completions.create(prompt=prompt, max_tokens=5, logprobs=2, echo=True,
                                  **greedy())
    ch = e.choices[0]
    assert ch.text == prompt + r.choices[0].text
    assert len(ch.logprobs.tokens) == n_prompt + 5
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert all(x is not None for x in ch.logprobs.token_logprobs[1:])
    assert "".join(ch.logprobs.tokens) == ch.text
    assert e.usage.prompt_tokens == n_prompt
    # echo without logprobs, and streamed echo
    plain = client.completions.create(prompt=prompt, max_tokens=5, echo=True, **greedy())
    assert plain.choices[0].text == ch.text and plain.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=prompt, max_tokens=5, echo=True, stream=True, **greedy()))
    assert streamed == ch.text
    # streamed logprobs cover exactly the generated tokens
    toks = []
    for c in client.completions.create(prompt=prompt, max_tokens=5, logprobs=1, stream=True,
                                       **greedy()):
        if c.choices[0].logprobs:
            toks += c.choices[0].logprobs.tokens
    assert toks == lp.tokens


def test_stop_strings_never_leak(client):
    base = client.completions.create(prompt="Write something:", max_tokens=24, **greedy())
    text = base.choices[0].text
    # A stop string taken from the middle of the greedy text, first occurring at k.
    k = max(4, len(text) // 2)
    stop = text[k:k + 4]
    k = text.index(stop)
    kw = greedy(prompt="Write something:", max_tokens=24, stop=[stop])
    r = client.completions.create(**kw)
    assert r.choices[0].text == text[:k]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert "".join(chunks) == text[:k]
    assert all(stop not in "".join(chunks[:i + 1]) for i in range(len(chunks)))
    inc = client.completions.create(extra_body={"include_stop_str_in_output": True}, **kw)
    assert inc.choices[0].text == text[:k] + stop
    # Chat too.
    msgs = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(messages=msgs, max_tokens=24, **greedy())
    ctext = full.choices[0].message.content
    cstop = ctext[len(ctext) // 2:len(ctext) // 2 + 3]
    ck = ctext.index(cstop)
    cr = client.chat.completions.create(messages=msgs, max_tokens=24, stop=cstop, **greedy())
    assert cr.choices[0].message.content == ctext[:ck]
    assert cr.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=msgs, max_tokens=24, stop=cstop, stream=True, **greedy()))
    assert streamed == ctext[:ck]


def test_vllm_extension_fields_and_unknown_fields(client):
    r = client.completions.create(
        prompt="Hello", max_tokens=6, **greedy(),
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True,
                    "min_tokens": 6, "stop_token_ids": [2], "skip_special_tokens": False,
                    "include_stop_str_in_output": False, "some_unknown_field": {"x": 1}},
        user="someone", presence_penalty=0.5, frequency_penalty=0.5, top_p=0.9)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_max_tokens_defaults_to_the_rest_of_the_context(client):
    ids = [100 + (i % 500) for i in range(MAX_MODEL_LEN - 3)]
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


# ---- chat --------------------------------------------------------------------------------

def test_chat_non_streaming_and_streaming(client, http):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(messages=msgs, max_tokens=10, **greedy())
    assert full.object == "chat.completion"
    ch = full.choices[0]
    assert ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"messages": msgs}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        messages=msgs, max_tokens=10, stream=True, stream_options={"include_usage": True},
        **greedy()))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ch.message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == n_prompt + 10


def test_chat_template_kwargs_may_set_the_generation_prompt(http):
    """vLLM lets chat_template_kwargs carry add_generation_prompt; it wins over the field."""
    msgs = [{"role": "user", "content": "Hi"}]
    usage = [http.post("/v1/chat/completions", json=greedy(
        messages=msgs, max_tokens=1, **kw)).json()["usage"]["prompt_tokens"]
        for kw in ({}, {"chat_template_kwargs": {"add_generation_prompt": False}})]
    assert usage[1] < usage[0]


def test_chat_list_of_parts_and_max_completion_tokens(client):
    """Text parts are joined one per line, as vLLM joins them."""
    as_text = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello\nworld"}], max_tokens=6, **greedy())
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                {"type": "text", "text": "world"}]}],
        max_completion_tokens=6, **greedy())
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.completion_tokens == 6


def test_chat_n_and_logprobs(client):
    msgs = [{"role": "user", "content": "Pick a number"}]
    r = client.chat.completions.create(messages=msgs, max_tokens=5, n=3, temperature=1.0,
                                       seed=3, logprobs=True, top_logprobs=2, model=MODEL)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5
        for t in content:
            assert len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert "".join(t.token for t in content) == c.message.content
    # Streaming: one role chunk and one finish_reason per choice.
    roles, finishes, texts = {}, {}, {}
    for c in client.chat.completions.create(messages=msgs, max_tokens=5, n=2, stream=True,
                                            logprobs=True, **greedy()):
        for ch in c.choices:
            if ch.delta.role:
                roles[ch.index] = roles.get(ch.index, 0) + 1
            if ch.finish_reason:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert roles == {0: 1, 1: 1} and finishes == {0: 1, 1: 1}
    assert texts[0] == texts[1]


# ---- tokenize / detokenize ---------------------------------------------------------------

def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert len(r["token_strs"]) == r["count"]
    d = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]
    bad = http.post("/detokenize", json={"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert http.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404


# ---- errors ------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n must"),
    ({"prompt": "x", "n": 10_000}, 400, "n must"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ({"prompt": "x", "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "top_k": -3}, 400, "top_k"),
    ({"prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": "x", "stream_options": 3}, 400, "stream_options"),
    ({"prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
    ({"prompt": [1] * MAX_MODEL_LEN}, 400, "maximum context length"),
    ({"prompt": [-5, 3]}, 400, "vocabulary"),
    ({"prompt": [3, 49152]}, 400, "vocabulary"),
    ({"prompt": [[1, 2], [3, 10 ** 12]]}, 400, "vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [[]]}, 400, "empty"),
    ({"prompt": ["ok", 3]}, 400, "prompt must be"),
    ({"prompt": [1.5]}, 400, "prompt must be"),
    ({"prompt": [True]}, 400, "prompt must be"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-nope"}, 404, "The model `gpt-nope` does not exist."),
]


@pytest.mark.parametrize("body,status,needle", BAD_COMPLETIONS,
                         ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_completion_errors(http, body, status, needle):
    content = json.dumps(body, allow_nan=True)
    r = http.post("/v1/completions", content=content,
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"] or needle == err["param"], err


def test_a_sampling_error_names_its_field(http):
    for field, value in (("temperature", -1), ("top_p", 0), ("n", 0), ("top_k", -3),
                         ("presence_penalty", 3), ("min_tokens", 10)):
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "needs a string"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "role"),
    ({"messages": [5]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "x"}}]}]}, 400,
     "text content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400,
     "maximum context length"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     400, "Invalid json"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "(a"}},
     400, "Invalid regex"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {
        "regex": "a", "choice": ["a"]}}, 400, "exactly one"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"grammar": "r ::="}},
     400, "Invalid grammar"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "a",
      "response_format": {"type": "json_object"}}, 400, "one output constraint"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404,
     "The model `other` does not exist."),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ raise_exception('no') }}"},
     400, "chat template"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400,
     "only allowed when tools are specified"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "only allowed when tools are specified"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"parameters": {}}}]}, 400, "name is required"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "not in tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL, _TOOL]}, 400,
     "same name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objec"}}}], "tool_choice": "required"}, 400,
     "Invalid structural tag"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL],
      "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400,
     "one output constraint"),
]


def test_tool_choice_none_answers_in_plain_text(http):
    """With tool_choice "none" a request that lists tools is served (as text)."""
    for extra in ({"tools": [_TOOL], "tool_choice": "none"}, {"tool_choice": "none"}):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body,status,needle", BAD_CHATS,
                         ids=[str(i) for i in range(len(BAD_CHATS))])
def test_chat_errors(http, body, status, needle):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"] or needle == err["param"], err


def test_malformed_bodies_and_content_types(http, client):
    cases = [
        (b"{not json", "application/json", 400),
        (b"[1, 2, 3]", "application/json", 400),
        (b'"a string"', "application/json", 400),
        (b"null", "application/json", 400),
        (b"", "application/json", 400),
        (b"\xff\xfe\x00garbage", "application/json", 400),
        (b'{"prompt": "x"}', "text/plain", 415),
        (b"prompt=x", "application/x-www-form-urlencoded", 415),
    ]
    for body, ctype, status in cases:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = http.post(path, content=body, headers={"content-type": ctype})
            assert r.status_code == status, (body, ctype, r.status_code, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # A JSON body without any Content-Type is still read as JSON.
    r = http.post("/v1/completions", content=json.dumps(greedy(prompt="x", max_tokens=1)))
    assert r.status_code == 200, r.text
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = http.get("/no/such/path")
    assert r.status_code == 404 and "error" in r.json()
    # The SDK maps them to its exceptions.
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="missing", prompt="x", max_tokens=2)
    assert "The model `missing` does not exist." in str(e.value)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=10 ** 6)
    # Still serving, nothing left behind.
    assert http.get("/health").status_code == 200
    assert client.completions.create(prompt="ok", max_tokens=2, **greedy()).choices[0].text


# ---- metrics -----------------------------------------------------------------------------

def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        lbl = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(lbl.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def test_metrics_move_as_requests_complete(http, client, server):
    assert wait_idle(server)
    before = http.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    b = before.text
    for name in ("minivllm:time_to_first_token_seconds", "minivllm:inter_token_latency_seconds",
                 "minivllm:e2e_request_latency_seconds", "minivllm:request_queue_time_seconds",
                 "minivllm:request_intake_seconds"):
        assert f"# TYPE {name} histogram" in b
    for name in ("minivllm:num_requests_running", "minivllm:num_requests_waiting",
                 "minivllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in b
    for name in ("minivllm:num_preemptions_total", "minivllm:prompt_tokens_total",
                 "minivllm:generation_tokens_total", "minivllm:request_success_total"):
        assert f"# TYPE {name} counter" in b
    r = client.completions.create(prompt="Count with me", max_tokens=7, **greedy())
    s = client.completions.create(prompt="Stop here", max_tokens=7, stop=[" "],
                                  **greedy())
    a = http.get("/metrics").text
    delta = lambda name, **lbl: _metric(a, name, **lbl) - _metric(b, name, **lbl)  # noqa: E731
    assert delta("minivllm:request_success_total", finished_reason="length") >= 1
    assert delta("minivllm:request_success_total") == 2
    assert delta("minivllm:prompt_tokens_total") == r.usage.prompt_tokens + s.usage.prompt_tokens
    assert delta("minivllm:generation_tokens_total") >= 7 + s.usage.completion_tokens
    assert delta("minivllm:time_to_first_token_seconds_count") == 2
    assert delta("minivllm:e2e_request_latency_seconds_count") == 2
    assert delta("minivllm:request_queue_time_seconds_count") == 2
    assert delta("minivllm:inter_token_latency_seconds_count") >= 6
    # Intake (app -> engine) happens before the engine's arrival stamp: short, not zero.
    assert delta("minivllm:request_intake_seconds_count") == 2
    assert 0 < delta("minivllm:request_intake_seconds_sum") < 2 * 1.0
    assert _metric(a, "minivllm:time_to_first_token_seconds_bucket", le="+Inf") == \
        _metric(a, "minivllm:time_to_first_token_seconds_count")
    assert _metric(a, "minivllm:kv_cache_usage_perc") == 0.0
    assert _metric(a, "minivllm:num_requests_running") == 0.0


# ---- concurrency and disconnects -----------------------------------------------------------

def test_32_concurrent_streams_match_alone(server, client):
    prompts = [f"Story number {i}:" for i in range(32)]
    alone = [client.completions.create(prompt=p, max_tokens=16, **greedy()).choices[0].text
             for p in prompts]
    sizes = []

    class Sizes:
        def on_step(self, now, outputs):
            sizes.append(len(outputs))

        def on_abort(self, rid):
            pass

    logger = Sizes()
    server.engine.stat_loggers.append(logger)

    async def one(aclient, p):
        text = ""
        finishes = 0
        stream = await aclient.completions.create(prompt=p, max_tokens=16, stream=True,
                                                  **greedy())
        async for c in stream:
            text += c.choices[0].text
            finishes += bool(c.choices[0].finish_reason)
        assert finishes == 1
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                      max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    try:
        together = asyncio.run(main())
    finally:
        server.engine.stat_loggers.remove(logger)
    assert together == alone
    assert max(sizes) >= 8, "concurrent requests should be batched together"
    assert wait_idle(server)


def test_disconnecting_clients_free_their_blocks(server, http):
    body = greedy(prompt="Go on and on", max_tokens=900, stream=True)
    body["ignore_eos"] = True

    async def disconnect_after_first_chunk(aclient):
        async with aclient.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return True  # leaving the block closes the connection
        return False

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as aclient:
            return await asyncio.gather(*(disconnect_after_first_chunk(aclient)
                                          for _ in range(20)))

    t0 = time.monotonic()
    assert all(asyncio.run(main()))
    assert wait_idle(server, timeout=3.0), "aborted requests must free their blocks"
    freed_after = time.monotonic() - t0
    assert freed_after < 10
    metrics = http.get("/metrics").text
    assert _metric(metrics, "minivllm:kv_cache_usage_perc") == 0.0
    assert _metric(metrics, "minivllm:num_requests_running") == 0.0
    t1 = time.monotonic()
    r = http.post("/v1/completions", json=greedy(prompt="Next", max_tokens=4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t1 < 2.0
    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={**greedy(prompt="Long", max_tokens=900), "ignore_eos": True})
    assert wait_idle(server, timeout=3.0)


def test_engine_step_failure_is_a_500_and_the_server_recovers(server, http):
    if server.engine_process:
        pytest.skip("the failure is injected by a closure, which cannot cross to a process")

    def arm(e):
        real = e.runner.execute

        def broken(batch):
            e.runner.execute = real  # fail once
            raise RuntimeError("injected step failure")
        e.runner.execute = broken

    server.engine.submit(arm).result(10)
    r = http.post("/v1/completions", json=greedy(prompt="boom", max_tokens=4))
    assert r.status_code == 500
    assert "injected step failure" in r.json()["error"]["message"]
    server.engine.submit(arm).result(10)
    r = http.post("/v1/chat/completions", json=greedy(
        messages=[{"role": "user", "content": "boom"}], max_tokens=4, stream=True))
    events = sse_events(r)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    ok = http.post("/v1/completions", json=greedy(prompt="fine", max_tokens=4))
    assert ok.status_code == 200
    assert wait_idle(server)


# ---- API key, waiting limit, shutdown --------------------------------------------------------

def test_api_key_and_waiting_limit(tiny_chat_dir):
    key = "sekret-key"
    with ServerThread(dict(model=str(tiny_chat_dir), max_model_len=4096,
                           max_num_seqs=1, num_kv_blocks=512),
                      max_waiting_requests=2, api_key=key,
                      served_model_names=[MODEL]) as s:
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=s.url, timeout=30) as h:
            assert h.get("/health").status_code == 200
            for path in ("/v1/models",):
                r = h.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = h.post("/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert h.post("/tokenize", json={"prompt": "x"}).status_code == 401
            assert h.get("/v1/models", headers=auth).status_code == 200
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
            good = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            assert good.completions.create(prompt="hi", max_tokens=2, **greedy()).choices

        async def main():
            long = {**greedy(prompt="hold the only slot", max_tokens=4000), "ignore_eos": True,
                    "stream": True}
            async with httpx.AsyncClient(base_url=s.url, timeout=30, headers=auth) as ac:
                started = asyncio.Event()

                async def hold_the_slot():
                    # Keep reading: leaving the stream early would close it (and abort it).
                    async with ac.stream("POST", "/v1/completions", json=long) as running:
                        async for line in running.aiter_lines():
                            if line.startswith("data: "):
                                started.set()

                holder = asyncio.ensure_future(hold_the_slot())
                await asyncio.wait_for(started.wait(), 20)
                # It runs; max_num_seqs=1, so the next ones wait.
                waiting = [asyncio.ensure_future(ac.post("/v1/completions", json={
                    **greedy(prompt=f"wait {i}", max_tokens=2)})) for i in range(2)]
                for _ in range(500):
                    if s.engine._num_not_started == 2:
                        break
                    await asyncio.sleep(0.01)
                assert s.engine._num_not_started == 2
                refused = await ac.post("/v1/completions",
                                        json=greedy(prompt="one too many", max_tokens=2))
                holder.cancel()  # disconnects: the waiting ones now run
                done = await asyncio.gather(*waiting)
                return refused, done

        refused, done = asyncio.run(main())
        assert refused.status_code == 503, refused.text
        assert "waiting" in refused.json()["error"]["message"]
        assert [d.status_code for d in done] == [200, 200]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread",
                                                               "engine-process"])
def test_graceful_shutdown_ends_open_streams(tiny_chat_dir, engine_process):
    s = ServerThread(dict(model=str(tiny_chat_dir), max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=256), drain_timeout=0.5,
                     served_model_names=[MODEL], engine_process=engine_process).start()
    try:
        body = {**greedy(prompt="never ending", max_tokens=1000), "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.Client(base_url=s.url, timeout=30) as h:
            with h.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                t0 = None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if t0 is None:
                        t0 = time.monotonic()
                        s.server.should_exit = True
        assert events[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]
                    if e["choices"][0]["finish_reason"]]
        assert finishes == ["abort"]
        assert time.monotonic() - t0 < 10
        s._thread.join(15)
        assert not s._thread.is_alive()
        assert not s.engine.is_running
        if engine_process:
            assert not s.engine._process.is_alive()
    finally:
        s.stop()


# ---- no tokenizer; the command line ---------------------------------------------------------

def test_server_without_tokenizer_streams_token_ids(tiny_model_dirs):
    """skip_tokenizer_init: token-id prompts work (chunks still stream, one per step, with
    empty text); anything that needs text is a clear 400."""
    with ServerThread(dict(model=str(tiny_model_dirs["llama"]), skip_tokenizer_init=True,
                           max_model_len=256, num_kv_blocks=64),
                      served_model_names=[MODEL]) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        body = {**greedy(prompt=[5, 6, 7], max_tokens=6, stream=True, logprobs=1,
                         stream_options={"include_usage": True}), "ignore_eos": True}
        events = sse_events(h.post("/v1/completions", json=body))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
        tokens = [t for e in events[:-2] for t in (e["choices"][0]["logprobs"] or {}).get(
            "tokens", [])]
        assert len(tokens) == 6 and all(t.startswith("token_id:") for t in tokens)
        r = h.post("/v1/completions", json=greedy(prompt="text", max_tokens=2))
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json=greedy(
            messages=[{"role": "user", "content": "x"}], max_tokens=2))
        assert r.status_code == 400


def test_cli_serve_subprocess_and_sigint(tiny_chat_dir):
    """`python -m minivllm.server` (what `minivllm serve` runs): flags, serving, and a clean
    exit on SIGINT."""
    import argparse
    import os
    import signal
    import socket
    import subprocess
    import sys

    from minivllm.server.launch import add_serve_arguments, engine_config_from_args

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args([])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    cfg = engine_config_from_args(add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--max-model-len", "64", "--max-num-seqs", "4", "--dtype", "float32",
         "--block-size", "32", "--seed", "3", "--enforce-eager", "--load-format", "dummy",
         "--max-graph-tokens", "512"]))
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.block_size, cfg.seed,
            cfg.enforce_eager, cfg.load_format, cfg.max_graph_tokens) == (
        "m", 64, 4, 32, 3, True, "dummy", 512)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.server", "--model", str(tiny_chat_dir), "--port",
         str(port), "--max-model-len", "512", "--num-kv-blocks", "64", "--api-key", "k",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ,
                                                               "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, proc, timeout=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].id == tiny_chat_dir.name
        r = client.chat.completions.create(model=tiny_chat_dir.name, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_echo_with_max_tokens_zero_scores_the_prompt(http):
    """lm-eval style scoring: echo + max_tokens=0 returns only the prompt's logprobs."""
    body = {"prompt": "The capital of France is", "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert choice["text"] == "The capital of France is"
    lps = choice["logprobs"]
    assert lps["token_logprobs"][0] is None
    assert len(lps["tokens"]) == data["usage"]["prompt_tokens"]
    assert all(isinstance(v, float) for v in lps["token_logprobs"][1:])
    assert data["usage"]["completion_tokens"] == 0
    r = http.post("/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = http.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 400


def test_return_token_ids(http, client):
    """vLLM's return_token_ids: choices carry the generated (and prompt) token ids, which
    decode to the text."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = http.post("/v1/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8] and len(choice["token_ids"]) == 6
    streamed = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.extend(c.get("token_ids", []))
    assert streamed == choice["token_ids"]
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]
    assert chat["token_ids"] and chat["prompt_token_ids"]


def test_text_prompts_get_the_tokenizers_ids(server, http):
    """Concurrent requests, several prompts in one request, with and without special
    tokens, and a chat prompt all get the ids of the frontend's tokenizer and of
    /tokenize."""
    tok = server.engine.tokenizer
    texts = [f"Prompt {i}: {'word ' * (i % 7)}and <|im_start|> inside" for i in range(24)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            async def one(i):
                body = {"prompt": [texts[i], texts[-1 - i]], "max_tokens": 1,
                        "return_token_ids": True, "add_special_tokens": i % 2 == 0}
                r = await ac.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return i, r.json()["choices"]
            return await asyncio.gather(*(one(i) for i in range(len(texts))))

    for i, choices in asyncio.run(main()):
        got = {c["index"]: c["prompt_token_ids"] for c in choices}
        for k, text in enumerate([texts[i], texts[-1 - i]]):
            assert got[k] == tok.encode(text, add_special_tokens=i % 2 == 0)
    t = http.post("/tokenize", json={"prompt": texts[3]}).json()
    assert t["tokens"] == tok.encode(texts[3])
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": texts[5]}], "max_tokens": 1,
        "return_token_ids": True}).json()["choices"][0]
    rendered = http.post("/tokenize", json={
        "messages": [{"role": "user", "content": texts[5]}]}).json()["tokens"]
    assert chat["prompt_token_ids"] == rendered


def test_prefix_cache_metrics_count_a_repeated_prompt(http, client, server):
    assert wait_idle(server)
    prompt = "A long shared preamble that several requests repeat word for word. " * 4
    client.completions.create(prompt=prompt, max_tokens=2, **greedy())
    assert wait_idle(server)
    before = http.get("/metrics").text
    client.completions.create(prompt=prompt, max_tokens=2, **greedy())
    assert wait_idle(server)
    after = http.get("/metrics").text
    hits = _metric(after, "minivllm:prefix_cache_hits_total") - \
        _metric(before, "minivllm:prefix_cache_hits_total")
    assert hits >= 16  # at least one whole block of the repeated prompt came from the cache


def test_logit_bias_forces_a_token(client):
    r = client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                  max_tokens=4, temperature=0, logit_bias={"42": 100},
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == [42, 42, 42, 42]
