"""OpenAI's Responses API through the real server and the real openai client (SmolLM2-135M):
the same text as the chat endpoint for the same conversation, streamed events in order and
numbered, function calls whose arguments fit their schema (and a conversation that carries
them back), text.format's JSON schema, and the requests it cannot serve refused with the
reason; LangChain's Responses mode on top."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from minivllm.server.testing import ServerThread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(default_model_dir):
    with ServerThread(dict(model=None, max_model_len=2048, max_num_seqs=8)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _stream(client, **kw):
    """(the events, the final response) of a streamed request."""
    events = list(client.responses.create(model=MODEL, stream=True, **kw))
    return events, events[-1].response


def test_text_as_the_chat_endpoint_gives_it(client):
    kw = dict(temperature=0, max_output_tokens=24)
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                instructions="Answer in one sentence.", **kw)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.id.startswith("resp_") and r.output[0].type == "message"

    events, final = _stream(client, input="What is the capital of France?",
                            instructions="Answer in one sentence.", **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == ("response.completed" if r.status == "completed"
                               else "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == r.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text


def test_logprobs_as_the_chat_endpoint_gives_them(client):
    """include message.output_text.logprobs with top_logprobs: each answer token's logprob
    and alternatives, the chat endpoint's; streamed, on the deltas and again at the end."""
    ask = "Name a color."
    kw = dict(input=ask, temperature=0, max_output_tokens=8, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(model=MODEL, **kw)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": ask}],
                                          max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2)
    want = chat.choices[0].logprobs.content
    [part] = r.output[0].content
    assert len(part.logprobs) == len(want) == r.usage.output_tokens
    for g, w in zip(part.logprobs, want):
        assert g.token == w.token and abs(g.logprob - w.logprob) < 1e-3
        assert [a.token for a in g.top_logprobs] == [a.token for a in w.top_logprobs]
    events, final = _stream(client, **kw)
    streamed = [t.token for e in events if e.type == "response.output_text.delta"
                for t in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [t.token for t in done.logprobs] == [w.token for w in want]
    plain = client.responses.create(model=MODEL, input=ask, temperature=0, max_output_tokens=8)
    assert plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.create(model=MODEL, input=ask, include=["bogus.thing"])


def test_cached_prompt_tokens_are_counted(client):
    """The prefix cache's share of the prompt: in a chat's usage (prompt_tokens_details,
    streamed and not, as OpenAI's) and a response's (input_tokens_details)."""
    ask = [{"role": "user", "content": "Count the cached tokens of this prompt. " * 8}]
    kw = dict(model=MODEL, messages=ask, max_tokens=2, temperature=0)
    client.chat.completions.create(**kw)  # now in the cache
    usage = client.chat.completions.create(**kw).usage
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    *_, last = client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **kw)
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    r = client.responses.create(model=MODEL, input=ask, max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens_details.cached_tokens > 0


def test_a_short_budget_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.",
                                          temperature=0, max_output_tokens=3, stream=True))
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_fit_their_schema_and_come_back(client, stream):
    kw = dict(input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0)
    if stream:
        events, r = _stream(client, **kw)
        added = [e.item for e in events if e.type == "response.output_item.added"
                 and e.item.type == "function_call"]
        assert added and added[0].name == "get_weather" and added[0].arguments == ""
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta")
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == done.arguments
    else:
        r = client.responses.create(model=MODEL, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER)
        assert c.call_id.startswith("call") and c.id.startswith("fc_")
    call = calls[0]
    follow = client.responses.create(model=MODEL, tools=TOOLS, temperature=0,
                                     max_output_tokens=16, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens  # the call and its output


def test_text_format_json_schema(client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a person.", temperature=0, text={
        "format": {"type": "json_schema", "name": "person", "schema": person,
                   "strict": True}})
    jsonschema.validate(json.loads(r.output_text), person)


@pytest.mark.parametrize("extra,param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(tools=[{"type": "web_search_preview"}]), "tools"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x/y.png"}]}]), "input"),
    (dict(input=[]), "input"),
    (dict(input=[{"role": "user", "content": 5}]), "input"),
    (dict(input=[{"type": "function_call", "call_id": 1, "name": "f"}]), "input"),
    (dict(text={"format": {"type": "grammar"}}), "text"),
    (dict(tool_choice={"type": "file_search"}, tools=TOOLS), "tool_choice"),
])
def test_what_it_cannot_serve_is_a_400_with_the_reason(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", **extra})
    assert e.value.body["param"] == param


def test_langchain_over_the_responses_api(client):
    """LangChain's ChatOpenAI(use_responses_api=True): a plain answer, a forced tool call
    with its arguments parsed, a structured output."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="x", temperature=0,
                     max_tokens=60, use_responses_api=True)
    assert "Paris" in llm.invoke("What is the capital of France?").text

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    [call] = llm.bind_tools([get_weather], tool_choice="required",
                            parallel_tool_calls=False).invoke(ASK).tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)

    class Person(BaseModel):
        name: str

    person = llm.with_structured_output(Person, method="json_schema").invoke("Name a person.")
    assert isinstance(person, Person) and person.name


def test_nothing_is_stored(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_123")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")
