"""OpenAI / vLLM compatibility details, end to end on a real uvicorn server (127.0.0.1, free
port, background thread) with the real `openai` SDK and httpx, no mocks:

- stream_options without stream=true is a 400 (OpenAI's and vLLM's answer);
- GET /tokenizer_info (vLLM's), enough for lm-eval's remote tokenizer;
- generation_config.json sampling defaults (vLLM's --generation-config auto|vllm|FOLDER),
  on the server and offline (LLM.get_default_sampling_params).

The model is the tiny random Llama with the real SmolLM2 tokenizer (as in test_server.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading

import httpx
import jinja2
import openai
import pytest

from minivllm.sampling_params import SamplingParams, generation_config_defaults
from conftest import sse_events
from minivllm.server.testing import ServerThread, make_tiny_chat_model
from minivllm.tokenizer import render_chat

MODEL = "tiny-chat"
MAX_MODEL_LEN = 256
# What the tiny model folder's generation_config.json adds to the default model's (which
# holds only bos/eos/pad ids): greedy, 5 tokens, a repetition penalty. do_sample and a
# null are there to show they are ignored.
GEN_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3,
                "do_sample": True, "top_p": None}
EXPECTED_DEFAULTS = {"temperature": 0.0, "max_tokens": 5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def gen_model_dir(tiny_chat_dir, tmp_path_factory):
    """The tiny chat model, its generation_config.json with sampling defaults."""
    d = tmp_path_factory.mktemp("tiny-gen") / "tiny-gen"
    shutil.copytree(tiny_chat_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    assert not set(cfg) & set(GEN_DEFAULTS)  # the default model's file has no sampling keys
    (d / "generation_config.json").write_text(json.dumps({**cfg, **GEN_DEFAULTS}))
    return d


def _engine(model_dir, **kw) -> dict:
    return {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8,
            "num_kv_blocks": 128, **kw}


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    with ServerThread(_engine(tiny_chat_dir), served_model_names=[MODEL]) as s:
        yield s


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


# ---- stream_options only with stream ------------------------------------------------------

def _check_stream_options_error(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "stream_options"
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert "stream" in err["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": CHAT}),
], ids=["completions", "chat"])
def test_stream_options_without_stream_is_a_400(http, path, body):
    body = {"model": MODEL, "max_tokens": 2, **body}
    opts = {"include_usage": True}
    _check_stream_options_error(http.post(path, json={**body, "stream_options": opts}))
    _check_stream_options_error(http.post(path, json={**body, "stream": False,
                                                      "stream_options": opts}))
    # null (and, as vLLM, {}) asks for nothing: fine without stream.
    for none in (None, {}):
        r = http.post(path, json={**body, "stream_options": none})
        assert r.status_code == 200, r.text
    # With stream=true it works: the usage chunk comes last, before [DONE].
    events = sse_events(http.post(path, json={**body, "stream": True, "stream_options": opts}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2


def test_stream_options_without_stream_openai_sdk(client):
    opts = {"include_usage": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream_options=opts)
    assert e.value.status_code == 400 and e.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       stream_options=opts)
    assert e.value.status_code == 400 and e.value.param == "stream_options"
    assert e.value.body["param"] == "stream_options"
    # With stream=True the SDK streams, the usage in the last chunk.
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                 temperature=0.0, stream=True,
                                                 stream_options=opts))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                            temperature=0.0, stream=True,
                                            stream_options=opts))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


# ---- /tokenizer_info -------------------------------------------------------------------------

# lm-eval renders the template with this environment (lm_eval/utils.py `env`).
LM_EVAL_JINJA = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined,
                                   keep_trailing_newline=True)


def test_tokenizer_info_fields(http, server, tiny_chat_dir):
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    tok = server.engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"], info["unk_token"]) == (
        "<|im_end|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
    saved = json.loads((tiny_chat_dir / "tokenizer_config.json").read_text())
    assert info["model_max_length"] == saved["model_max_length"]
    assert info["chat_template"] == tok.get_chat_template()
    assert info["chat_template"] == saved.get("chat_template", info["chat_template"])
    # AddedTokens inside added_tokens_decoder: tokenizer_config.json's dicts.
    assert info["added_tokens_decoder"]["2"]["content"] == "<|im_end|>"
    assert info["added_tokens_decoder"]["2"]["special"] is True
    assert "vocab_file" not in info and "merges_file" not in info
    schema = http.get("/openapi.json").json()
    get = schema["paths"]["/tokenizer_info"]["get"]
    assert "TokenizerInfoResponse" in json.dumps(get["responses"]["200"])
    assert "TokenizerInfoResponse" in schema["components"]["schemas"]


def test_tokenizer_info_chat_template_matches_the_servers_rendering(http, server):
    info = http.get("/tokenizer_info").json()
    template = LM_EVAL_JINJA.from_string(info["chat_template"])
    for msgs, gen in ((CHAT, True), (CHAT[1:], True), (CHAT + [
            {"role": "assistant", "content": "Blue."}], False)):
        text = template.render(messages=msgs, add_generation_prompt=gen)
        assert text == render_chat(server.engine.tokenizer, msgs, add_generation_prompt=gen)
        by_server = http.post("/tokenize", json={"messages": msgs,
                                                 "add_generation_prompt": gen}).json()
        by_text = http.post("/tokenize", json={"prompt": text,
                                               "add_special_tokens": False}).json()
        assert by_server["tokens"] == by_text["tokens"]


def test_tokenizer_info_eos_round_trips_to_the_eos_id(http, server):
    info = http.get("/tokenizer_info").json()
    for name, tid in (("eos_token", 2), ("bos_token", 1)):
        ids = http.post("/tokenize", json={"prompt": info[name],
                                           "add_special_tokens": False}).json()["tokens"]
        assert ids == [tid]
    assert {2} == set(server.engine.eos_token_ids)
    assert http.post("/detokenize", json={"tokens": [2]}).json()["prompt"] == info["eos_token"]


def test_lm_eval_remote_tokenizer_calls(server):
    """What lm-eval's RemoteTokenizer and local-completions (tokenized_requests=True) do,
    call for call, without importing lm_eval: strip the completions path off base_url,
    GET /tokenizer_info, POST /tokenize {"prompt", "add_special_tokens": false},
    POST /detokenize, render chat_template with jinja, then a loglikelihood request
    (token-id prompt, echo, max_tokens=1, logprobs=1) and a generate_until request."""
    base_url = server.url + "/v1/completions"
    base = base_url.replace("/v1/completions", "").replace("/v1/chat/completions", "")
    with httpx.Client(base_url=base.rstrip("/"), timeout=30,
                      headers={"Content-Type": "application/json"}) as s:
        # check_remote_tokenizer_support
        r = s.get("/tokenizer_info")
        r.raise_for_status()
        info = r.json()
        assert isinstance(info, dict) and "eos_token" in info
        r = s.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
        r.raise_for_status()
        assert isinstance(r.json().get("tokens"), list)

        def encode(text: str) -> list[int]:
            resp = s.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            resp.raise_for_status()
            return resp.json()["tokens"]

        def decode(tokens: list[int]) -> str:
            resp = s.post("/detokenize", json={"tokens": tokens})
            resp.raise_for_status()
            prompt = resp.json().get("prompt")
            assert isinstance(prompt, str)
            return prompt

        eos_id = encode(info["eos_token"])[0]
        bos_id = encode(info["bos_token"])[0]
        prefix_token_id = bos_id or eos_id  # TemplateAPI.prefix_token_id
        assert (eos_id, prefix_token_id) == (2, 1)
        context, continuation = "The capital of France is", " Paris"
        ctx_ids, cont_ids = encode(context), encode(continuation)
        assert decode(ctx_ids + cont_ids) == context + continuation
        chat_text = LM_EVAL_JINJA.from_string(info["chat_template"]).render(
            messages=CHAT, add_generation_prompt=True)
        assert chat_text.endswith("<|im_start|>assistant\n")

        # loglikelihood: LocalCompletionsAPI._create_payload(generate=False), then
        # parse_logprobs' token_logprobs[ctxlen:-1].
        whole = ctx_ids + cont_ids
        out = s.post(base_url, json={"model": MODEL, "prompt": [whole], "temperature": 0,
                                     "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                     "echo": True}).json()
        lp = out["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(whole) + 1
        ctxlen = len(ctx_ids)
        cont_lps = lp["token_logprobs"][ctxlen:-1]
        assert len(cont_lps) == len(cont_ids) and all(x <= 0 for x in cont_lps)
        for tok_lp, top in zip(cont_lps, lp["top_logprobs"][ctxlen:-1]):
            assert top and max(top.values()) >= tok_lp

        # generate_until: token-id prompt, until + the eos string as stop.
        out = s.post(base_url, json={"model": MODEL, "prompt": [ctx_ids], "max_tokens": 8,
                                     "temperature": 0, "stop": ["\n\n", info["eos_token"]],
                                     "seed": 1234}).json()
        assert isinstance(out["choices"][0]["text"], str)
        assert out["usage"]["completion_tokens"] <= 8


def test_tokenizer_info_without_tokenizer_and_with_api_key(tiny_chat_dir):
    with ServerThread(_engine(tiny_chat_dir, skip_tokenizer_init=True),
                      served_model_names=[MODEL]) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        r = h.get("/tokenizer_info")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "no tokenizer" in err["message"]
    key = "sekret"
    with ServerThread(_engine(tiny_chat_dir), served_model_names=[MODEL], api_key=key) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        r = h.get("/tokenizer_info")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert h.get("/tokenizer_info", headers={"Authorization": "Bearer no"}).status_code == 401
        r = h.get("/tokenizer_info", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["eos_token"] == "<|im_end|>"
        # A browser page on another origin: its preflight needs no key; the answers
        # allow the origin.
        origin = {"Origin": "http://localhost:3000"}
        r = h.options("/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = h.get("/v1/models", headers={**origin, "Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with ServerThread(_engine(tiny_chat_dir), served_model_names=[MODEL],
                      cors=dict(allow_origins=["https://app.example"])) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        r = h.options("/v1/models", headers={"Origin": "https://evil.example",
                                             "Access-Control-Request-Method": "GET"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_a_chat_template_of_the_servers_own(tiny_chat_dir):
    """--chat-template: every chat path renders with it (the chat endpoint, /tokenize's
    messages, /tokenizer_info), not the tokenizer's; a request's own chat_template wins."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    with ServerThread(_engine(tiny_chat_dir), served_model_names=[MODEL],
                      chat_template=template) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        msgs = [{"role": "user", "content": "Hi"}]
        ids = h.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        text = h.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "[user] Hi\n[assistant]"
        assert h.get("/tokenizer_info").json()["chat_template"] == template
        r = h.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
        r = h.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                 "chat_template": "{{ 'x' }}"})
        assert r.json()["usage"]["prompt_tokens"] == 1


# ---- generation_config.json defaults -------------------------------------------------------

def test_generation_config_defaults_reader(gen_model_dir, tiny_chat_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.sampling_params"):
        assert generation_config_defaults("auto", gen_model_dir) == EXPECTED_DEFAULTS
    assert "Sampling defaults from" in caplog.text and "max_tokens=5" in caplog.text
    assert generation_config_defaults(None, gen_model_dir / "config.json") == EXPECTED_DEFAULTS
    assert generation_config_defaults("vllm", gen_model_dir) == {}
    # The default model's file: ids only, so no defaults.
    assert generation_config_defaults("auto", tiny_chat_dir) == {}
    # A folder given explicitly.
    assert generation_config_defaults(str(gen_model_dir), tiny_chat_dir) == EXPECTED_DEFAULTS
    # A .gguf: the folder holding it. No file: no defaults.
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").write_bytes(b"GGUF")
    assert generation_config_defaults("auto", gguf_dir / "model.gguf") == {}
    (gguf_dir / "generation_config.json").write_text(json.dumps(
        {"top_k": 20, "top_p": 0.9, "min_p": 0.05, "temperature": 0.7, "num_beams": 2}))
    assert generation_config_defaults("auto", gguf_dir / "model.gguf") == {
        "top_k": 20, "top_p": 0.9, "min_p": 0.05, "temperature": 0.7}
    # Errors name the file (a malformed file is refused, not skipped).
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not a readable JSON"):
        generation_config_defaults("auto", bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        generation_config_defaults("auto", bad)
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p"):
        generation_config_defaults("auto", bad)
    (bad / "generation_config.json").write_text('{"temperature": NaN}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        generation_config_defaults("auto", bad)
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_config_defaults(str(tmp_path), gen_model_dir)
    with pytest.raises(ValueError, match="not 'auto', 'vllm' or a folder"):
        generation_config_defaults(str(tmp_path / "nowhere"), gen_model_dir)


@pytest.fixture(scope="module")
def gen_server(gen_model_dir):
    with ServerThread(_engine(gen_model_dir), served_model_names=[MODEL]) as s:
        yield s


def test_server_takes_generation_config_defaults(gen_server):
    client = openai.OpenAI(base_url=gen_server.url + "/v1", api_key="x", max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    # No temperature, max_tokens or repetition_penalty: greedy, 5 tokens, penalised.
    runs = [client.completions.create(model=MODEL, prompt="Hello there", extra_body=extra)
            for _ in range(3)]
    assert all(r.usage.completion_tokens == 5 for r in runs)
    assert len({r.choices[0].text for r in runs}) == 1  # greedy: the same every time
    default_ids = runs[0].choices[0].model_extra["token_ids"]
    asked = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5,
                                      temperature=0.0, extra_body={**extra,
                                                                   "repetition_penalty": 1.3})
    assert asked.choices[0].model_extra["token_ids"] == default_ids
    unpenalised = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5,
                                            temperature=0.0,
                                            extra_body={**extra, "repetition_penalty": 1.0})
    assert unpenalised.choices[0].model_extra["token_ids"] != default_ids
    # Explicit values win: temperature 1.0 samples, max_tokens 7 gives 7.
    sampled = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7,
                                        temperature=1.0, n=3, seed=5, extra_body=extra)
    assert sampled.usage.completion_tokens == 21
    assert len({c.text for c in sampled.choices}) > 1
    # Chat: the same defaults (max_completion_tokens / max_tokens unset).
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra)
    assert chat.usage.completion_tokens == 5
    chat2 = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra)
    assert chat2.choices[0].message.content == chat.choices[0].message.content
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=2,
                                          extra_body=extra).usage.completion_tokens == 2


def test_default_max_tokens_is_cut_to_the_context(gen_server):
    """As vLLM: a max_tokens from the generation config is cut to what the prompt leaves
    of the context (one the request gives is not: too long is a 400)."""
    with httpx.Client(base_url=gen_server.url, timeout=30) as h:
        ids = [100 + i for i in range(MAX_MODEL_LEN - 3)]
        r = h.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        r = h.post("/v1/completions", json={"prompt": ids, "max_tokens": 5})
        assert r.status_code == 400 and "maximum context length" in r.text


def test_server_with_generation_config_vllm_ignores_the_file(gen_model_dir):
    with ServerThread(_engine(gen_model_dir, generation_config="vllm", max_model_len=48),
                      served_model_names=[MODEL]) as s, \
            httpx.Client(base_url=s.url, timeout=30) as h:
        assert s.app.state.serving.sampling_defaults == {}
        # max_tokens: the endpoint's 16, or with null the rest of the context; not the
        # file's max_new_tokens 5.
        r = h.post("/v1/completions", json={"prompt": "Hello there", "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 16
        r = h.post("/v1/completions", json={"prompt": "Hello there", "ignore_eos": True,
                                            "max_tokens": None}).json()
        assert r["usage"]["completion_tokens"] == 48 - r["usage"]["prompt_tokens"]
        # temperature 1.0: samples, not greedy.
        r = h.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "n": 3,
                                            "ignore_eos": True}).json()
        assert len({c["text"] for c in r["choices"]}) > 1


def test_generation_config_of_a_separate_engine_process(gen_model_dir):
    """A server whose engine runs in another process takes generation_config from the
    EngineConfig it was built from (checked without starting the process)."""
    from minivllm.config import EngineConfig
    from minivllm.engine.async_llm_engine import AsyncLLMEngine
    for choice in ("auto", "vllm", str(gen_model_dir)):
        eng = AsyncLLMEngine(EngineConfig(model=str(gen_model_dir), generation_config=choice),
                             engine_process=True, start=False)
        assert eng.engine is None and eng.config.generation_config == choice


def test_serve_flag_generation_config(tiny_chat_dir, tmp_path):
    """--generation-config reaches EngineConfig and the app; a malformed file stops
    `minivllm serve` with a clear error (and no engine left running)."""
    import argparse

    from minivllm.server.launch import add_serve_arguments, build_server, engine_config_from_args

    parse = add_serve_arguments(argparse.ArgumentParser()).parse_args
    assert parse([]).generation_config == "auto"
    assert engine_config_from_args(parse([])).generation_config == "auto"
    cfg = engine_config_from_args(parse(["--generation-config", "vllm"]))
    assert cfg.generation_config == "vllm"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5,')
    args = parse(["--model", str(tiny_chat_dir), "--max-model-len", "64", "--num-kv-blocks",
                  "16", "--engine-in-thread", "--generation-config", str(tmp_path)])
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="is not a readable JSON file") as e:
        build_server(args)
    assert "--generation-config vllm" in str(e.value)
    assert not [t for t in threading.enumerate()  # its engine thread has stopped
                if t not in before and t.name == "minivllm-engine"]


def test_offline_llm_default_sampling_params(gen_model_dir):
    from minivllm import LLM

    kw = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, num_kv_blocks=64)
    llm = LLM(str(gen_model_dir), **kw)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.repetition_penalty) == (0.0, 5, 1.3)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)  # not in the file
    [out] = llm.generate("Hello there", use_tqdm=False)
    [asked] = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=5,
                                                         repetition_penalty=1.3),
                           use_tqdm=False)
    assert out.outputs[0].token_ids == asked.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 5
    [again] = llm.generate(["Hello there"], use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    [chat] = llm.chat(CHAT, use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 5
    del llm
    plain = LLM(str(gen_model_dir), generation_config="vllm", **kw)
    assert plain.get_default_sampling_params() == SamplingParams()


# ---- prompt_logprobs, vLLM's shape ----------------------------------------------------------

def test_prompt_logprobs_in_the_response_as_vllm_gives_them(http, tiny_chat_dir):
    """Completions: each choice's prompt_logprobs, None for the first token, then {token id:
    {logprob, rank, decoded_token}} with the prompt's own token and the top 2, the values
    the offline engine gives. Chat: at the top of the response. A stream asking for them is
    a 400, as in vLLM."""
    from minivllm import LLM, SamplingParams

    prompt = "The colour of the sky is"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                           "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    want = LLM(str(tiny_chat_dir), max_model_len=MAX_MODEL_LEN).generate(
        prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(got) == len(want.prompt_token_ids) == r.json()["usage"]["prompt_tokens"]
    assert got[0] is None
    for tid, pos, wpos in zip(want.prompt_token_ids[1:], got[1:], want.prompt_logprobs[1:]):
        assert str(tid) in pos and 2 <= len(pos) <= 3
        assert {int(t) for t in pos} == set(wpos)
        for t, entry in pos.items():
            assert entry["logprob"] == pytest.approx(wpos[int(t)].logprob, abs=1e-4)
            assert entry["rank"] == wpos[int(t)].rank and isinstance(entry["decoded_token"], str)

    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][0] is None
    assert all(len(pos) == 1 for pos in body["prompt_logprobs"][1:])  # the prompt's own token

    # echo with logprobs 4 has the engine keep 4 a prompt position; prompt_logprobs 1
    # still shows the top 1 (and the prompt's own token), echo's logprobs the top 4.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                           "echo": True, "logprobs": 4, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    for tid, pos, top in zip(want.prompt_token_ids[1:], choice["prompt_logprobs"][1:],
                             choice["logprobs"]["top_logprobs"][1:]):
        assert str(tid) in pos and 1 <= len(pos) <= 2
        assert all(e["rank"] == 1 or t == str(tid) for t, e in pos.items())
        assert len(top) >= 4

    for path, extra in (("/v1/completions", {"prompt": prompt}),
                        ("/v1/chat/completions", {"messages": CHAT})):
        r = http.post(path, json={"model": MODEL, "stream": True, "prompt_logprobs": 1,
                                  **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert "prompt_logprobs" not in r.json()["choices"][0]


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "Once upon a time"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http, path, extra):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(http.post(path, json=body))
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in chunks)
    body["stream_options"] = {"include_usage": True}
    assert all(c["usage"] is None for c in sse_events(http.post(path, json=body))[:-2])


def test_repetition_penalty_and_logprobs_limits_are_the_offline_ones(http):
    """The server's requests pass through SamplingParams' rules: repetition_penalty any
    finite value > 0 (vLLM's, not at most 2); logprobs up to the engine's max_logprobs
    (20 here); structured_outputs' whitespace_pattern refused (xgrammar has none)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert http.post("/v1/completions", json={**body, "repetition_penalty": 3.5}
                     ).status_code == 200
    r = http.post("/v1/completions", json={**body, "repetition_penalty": 0})
    assert r.status_code == 400 and "repetition_penalty" in r.text
    assert http.post("/v1/completions", json={**body, "logprobs": 20}).status_code == 200
    r = http.post("/v1/completions", json={**body, "logprobs": 21})
    assert r.status_code == 400 and "max_logprobs" in r.text
    r = http.post("/v1/completions", json={**body, "structured_outputs": {
        "json": {"type": "object"}, "whitespace_pattern": "[ ]?"}})
    assert r.status_code == 400 and "whitespace_pattern" in r.text
