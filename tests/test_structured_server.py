"""Structured outputs and tool calls end to end: the real SmolLM2-135M behind a real server,
the openai client and LangChain. Every answer is checked against its schema."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from minivllm.server.testing import ServerThread

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                             "legs": {"type": "integer"}},
            "required": ["kind"], "additionalProperties": False}},
    },
    "required": ["name", "age", "color", "pets"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city."}},
         {"type": "function", "function": {"name": "add", "parameters": ADD,
                                           "description": "Add two integers."}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    with ServerThread(dict(model=None, max_model_len=2048, max_num_seqs=8)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _chat(client, stream: bool, **kw):
    """(per choice: content, tool_calls as dicts, finish_reason) streamed or not."""
    kw = {"model": "SmolLM2-135M-Instruct", "temperature": 0.0, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        return [(c.message.content, [tc.model_dump() for tc in c.message.tool_calls or []],
                 c.finish_reason) for c in r.choices]
    out: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            o["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": None, "type": "function",
                                                        "function": {"name": None,
                                                                     "arguments": ""}})
                if tc.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = tc.id
                    call["function"]["name"] = tc.function.name
                else:
                    assert call["id"] is not None, "arguments before the call's id and name"
                call["function"]["arguments"] += tc.function.arguments or ""
            o["finish"] = c.finish_reason or o["finish"]
    return [(o["content"] or None, [o["calls"][i] for i in sorted(o["calls"])], o["finish"])
            for _, o in sorted(out.items())]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(client, stream):
    for content, calls, finish in _chat(
            client, stream, n=2, max_tokens=300, messages=[
                {"role": "user", "content": "Describe a person and their pets as JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}}):
        assert finish == "stop" and not calls
        jsonschema.validate(json.loads(content), PERSON)


def test_every_structured_outputs_kind(client):
    base = dict(model="SmolLM2-135M-Instruct", max_tokens=60, temperature=0.7, seed=3)
    r = client.chat.completions.create(messages=ASK, response_format={"type": "json_object"},
                                       **{**base, "max_tokens": 300, "temperature": 0})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"regex": r"[A-Z][a-z]{2,8} \d{1,2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} \d{1,2}", t)),
             ({"choice": ["sunny", "rainy", "cloudy"]}, lambda t: t in ("sunny", "rainy", "cloudy")),
             ({"grammar": 'root ::= "It is " ("hot" | "cold") "."'},
              lambda t: t in ("It is hot.", "It is cold.")),
             ({"json": WEATHER, "disable_any_whitespace": True},
              lambda t: jsonschema.validate(json.loads(t), WEATHER) is None)]
    for so, ok in cases:
        chat = client.chat.completions.create(messages=ASK, extra_body={"structured_outputs": so},
                                              n=2, **base)
        comp = client.completions.create(prompt="The weather today:", n=2,
                                         extra_body={"structured_outputs": so}, **base)
        texts = [c.message.content for c in chat.choices] + [c.text for c in comp.choices]
        assert all(ok(t) for t in texts), (so, texts)
    old = client.completions.create(prompt="Pick:", extra_body={"guided_choice": ["A", "B"]},
                                    **base)
    assert old.choices[0].text in ("A", "B")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named", "auto"])
def test_tool_calls_validate(client, tool_choice, stream):
    choice = {"type": "function", "function": {"name": "add"}} if tool_choice == "named" \
        else tool_choice
    results = _chat(client, stream, messages=ASK, tools=TOOLS, tool_choice=choice,
                    max_tokens=120, n=2)
    for content, calls, finish in results:
        if tool_choice == "auto" and not calls:
            assert finish in ("stop", "length") and content  # a text answer
            continue
        assert calls and finish == ("stop" if tool_choice == "named" else "tool_calls")
        if tool_choice != "auto":
            assert not content  # the grammar allows calls only, then the end
        for call in calls:
            assert call["id"] and call["type"] == "function"
            name = call["function"]["name"]
            assert name == "add" if tool_choice == "named" else name in SCHEMAS
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_parallel_tool_calls_false_makes_one_call(client):
    for _, calls, _ in _chat(client, False, messages=[{"role": "user", "content": (
            "Weather in Paris and in Rome, please.")}], tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, n=2, temperature=1.0, seed=5):
        assert len(calls) == 1


def test_multi_turn_with_tool_results(client):
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id,
                       "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS, max_tokens=40,
        temperature=0)
    msg = second.choices[0].message
    assert msg.content or msg.tool_calls
    for tc in msg.tool_calls or []:
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    # The tool's answer reached the prompt.
    assert first.usage.prompt_tokens < second.usage.prompt_tokens


def test_bad_requests_keep_the_server_serving(client, server):
    import httpx
    bad = [{"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}}}},
           {"structured_outputs": {"regex": "[a-"}},
           {"structured_outputs": {"grammar": "root ::= missing"}},
           {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
           {"tool_choice": "required"},
           {"tools": [{"type": "function", "function": {"description": "no name"}}]}]
    for extra in bad:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "max_tokens": 5, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                        max_tokens=3)
    assert ok.choices[0].message.content is not None


def test_langchain_structured_output_and_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=30)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=120, max_retries=0, timeout=300)
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Forecast, method=method).invoke(
            "Forecast for Paris in celsius for 3 days.")
        assert isinstance(got, Forecast), (method, got)

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city, in celsius or fahrenheit."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
    streamed = None
    for piece in bound.stream("What is the weather in Rome?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed.tool_calls[0]["name"] == "get_weather"
    assert set(streamed.tool_calls[0]["args"]) == {"city", "unit"}


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think>\n")


def test_reasoning_parser(default_model_dir):
    """--reasoning-parser: a prompt that opens the reasoning gets the output back as
    reasoning_content (streamed and not; a reasoning item from /v1/responses); with a schema and a prompt that does not, the
    grammar lets an optional <think> block through and then holds the answer to the
    schema."""
    with ServerThread(dict(model=None, max_model_len=1024, max_num_seqs=4),
                      reasoning_parser="qwen3") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
        kw = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=12, temperature=0,
                  extra_body={"chat_template": THINKING_TEMPLATE})
        r = c.chat.completions.create(**kw)
        full = r.choices[0].message
        thought = full.model_extra["reasoning_content"]
        assert thought and not full.content
        # All 12 tokens are reasoning (it never closed); a plain chat has none.
        assert r.usage.completion_tokens_details.reasoning_tokens == 12
        plain = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                          max_tokens=4, temperature=0)
        assert plain.usage.completion_tokens_details.reasoning_tokens == 0
        *_, last = c.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kw)
        assert last.usage.completion_tokens_details.reasoning_tokens == 12
        streamed = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or ""
                           for ch in c.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        assert streamed == thought
        # The Responses API: the thoughts are a reasoning item, streamed and not.
        rkw = dict(model="SmolLM2-135M-Instruct", input=ASK, max_output_tokens=12,
                   temperature=0, extra_body={"chat_template": THINKING_TEMPLATE})
        answer = c.responses.create(**rkw)
        [item] = answer.output
        assert item.type == "reasoning" and item.content[0].text == thought
        assert answer.usage.output_tokens_details.reasoning_tokens == 12
        events = list(c.responses.create(stream=True, **rkw))
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == thought
        answer = c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=200, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "w", "schema": WEATHER}}).choices[0].message
        jsonschema.validate(json.loads(answer.content), WEATHER)
