"""Tool-call formats and reasoning without a model: the incremental parsers on text cut at
random points, and the grammars they rely on (xgrammar matchers fed the text a model
would write under them)."""

from __future__ import annotations

import json
import random

import pytest

from minivllm.server.chat_outputs import ChatOutputPlan
from minivllm.server.reasoning import ReasoningParser, reasoning_state, reasoning_tokens
from minivllm.server.tool_calls import (FORMATS, ToolCallParser, ToolSpec, check_tools,
                                        format_for_template, render_tool_calls, tools_grammar)

CALLS = [{"function": {"name": "get_weather", "arguments": json.dumps(
    {"city": "Paris \"{}\" \\ é", "days": [1, 2], "opt": {"a": "}]"}})}},
    {"function": {"name": "noargs", "arguments": "{}"}}]
TOOLS = [ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}},
    "opt": {"type": "object", "properties": {"a": {"type": "string"}}}},
    "required": ["city"]}), ToolSpec("noargs", {"type": "object", "properties": {}})]


def feed_in_pieces(parser, text: str, rng: random.Random) -> list:
    events, i = [], 0
    while i < len(text):
        k = rng.randint(1, 9)
        events += parser.feed(text[i:i + k])
        i += k
    return events + parser.finish()


@pytest.mark.parametrize("name", list(FORMATS))
def test_parser_streams_calls_at_any_cut(name):
    fmt = FORMATS[name]
    text = "Let me check {this}. " + render_tool_calls(CALLS, fmt) + "\n"
    rng = random.Random(0)
    for _ in range(40):
        parser = ToolCallParser(fmt)
        events = feed_in_pieces(parser, text, rng)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]
        # Each call's id and name come before its arguments, which stream in order.
        order = [e[:2] for e in events if e[0] in ("call", "args")]
        assert order.index(("call", 0)) < order.index(("args", 0)) < order.index(("call", 1))
        args = {}
        for e in events:
            if e[0] == "args":
                args[e[1]] = args.get(e[1], "") + e[2]
        assert [args[i] for i in range(2)] == [c.arguments for c in parser.calls]
        # The text before the calls; nothing of the separators or the newline after them.
        assert parser.content == "Let me check {this}. "
        assert "".join(e[1] for e in events if e[0] == "content") == parser.content


@pytest.mark.parametrize("name", list(FORMATS))
def test_after_calls_only_real_text_is_content(name):
    """Separators after a call are never content, however the stream cuts them; the
    start of one more call cut off by the end is dropped; text after the calls is content
    without its separators."""
    fmt = FORMATS[name]
    calls = render_tool_calls(CALLS, fmt)
    rng = random.Random(3)
    for tail, content in (("\n" + fmt.trigger[:3], ""), ("\n\n", ""),
                          ("\nDone, both asked.", "Done, both asked.")):
        for _ in range(10):
            parser = ToolCallParser(fmt)
            events = feed_in_pieces(parser, calls + tail, rng)
            assert len(parser.calls) == 2 and parser.content == content, (tail, events)


def test_parser_leaves_plain_text_alone():
    for fmt in FORMATS.values():
        text = "No call here: <tool_ [TOOL {\"nam\": 1} done."
        parser = ToolCallParser(fmt)
        events = feed_in_pieces(parser, text, random.Random(1))
        assert parser.calls == [] and parser.content == text
        assert "".join(e[1] for e in events) == text


def test_format_from_the_chat_template():
    assert format_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert format_for_template("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert format_for_template("<|python_tag|>").name == "llama3_json"
    assert format_for_template("plain ChatML").name == "hermes"
    assert format_for_template("<tool_call>", "mistral").name == "mistral"
    with pytest.raises(ValueError, match="Unknown tool-call parser"):
        format_for_template(None, "xml")


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    import xgrammar as xgr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152))


def _accepts(compiler, fmt_dict: dict, text: str) -> bool:
    import xgrammar as xgr
    grammar = xgr.Grammar.from_structural_tag(json.dumps(
        {"type": "structural_tag", "format": fmt_dict}))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", list(FORMATS))
def test_grammars_take_what_the_parser_reads(compiler, name):
    """Every tool_choice's grammar accepts the calls the format writes (one call when
    parallel calls are off or a tool is named); 'required' and named refuse any text
    around the calls; auto takes text."""
    fmt = FORMATS[name]
    one, both = render_tool_calls(CALLS[:1], fmt), render_tool_calls(CALLS, fmt)
    sep = "" if fmt.listed else "\n"
    auto = tools_grammar(fmt, TOOLS, "auto", None, True)
    assert _accepts(compiler, auto, "Sure. " + both + sep)
    assert _accepts(compiler, auto, "Just text.")
    required = tools_grammar(fmt, TOOLS, "required", None, True)
    assert _accepts(compiler, required, both)
    assert not _accepts(compiler, required, "Just text.")
    assert not _accepts(compiler, required, "Sure. " + both)  # calls only
    assert not _accepts(compiler, required, both + sep + "Done.")
    named = tools_grammar(fmt, TOOLS, {"type": "function"}, "get_weather", True)
    assert _accepts(compiler, named, one)
    assert not _accepts(compiler, named, render_tool_calls(CALLS[1:], fmt))
    single = tools_grammar(fmt, TOOLS, "required", None, False)
    assert _accepts(compiler, single, one)
    assert not _accepts(compiler, single, both)
    bad_args = render_tool_calls([{"function": {"name": "get_weather",
                                                "arguments": '{"town": "x"}'}}], fmt)
    assert not _accepts(compiler, required, bad_args)
    # tool_choice auto with a response_format: a call, or an answer that fits the schema.
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    mixed = tools_grammar(fmt, TOOLS, "auto", None, True, answer)
    assert _accepts(compiler, mixed, one)
    assert _accepts(compiler, mixed, '{"ok": true}')
    assert not _accepts(compiler, mixed, "Just text.")


def test_check_tools_errors():
    tool = {"type": "function", "function": {"name": "f"}}
    assert check_tools([tool], "auto")[0][0].parameters["type"] == "object"
    for tools, choice, needle in [
            ([{"type": "function", "function": {}}], "auto", "name is required"),
            ([{"type": "retrieval"}], "auto", "type 'function'"),
            ([tool], {"type": "function", "function": {"name": "g"}}, "not in tools"),
            ([tool], "sometimes", "tool_choice must be"),
            ([tool, tool], "auto", "same name"),
            ([], "required", "needs tools")]:
        with pytest.raises(ValueError, match=needle):
            check_tools(tools, choice)


def test_reasoning_split_at_any_cut():
    text = "<think>\nHmm, 2 + 2 </thin k? is 4.</think>\n\nThe answer is 4."
    for cut_seed in range(30):
        rng = random.Random(cut_seed)
        parser = ReasoningParser("maybe")
        events = feed_in_pieces(parser, text, rng)
        assert "".join(e[1] for e in events if e[0] == "reasoning") == \
            "\nHmm, 2 + 2 </thin k? is 4."
        assert "".join(e[1] for e in events if e[0] == "content") == "The answer is 4."
    inside = ReasoningParser(reasoning_state("...<|Assistant|><think>\n"))
    events = feed_in_pieces(inside, "a<b</think>c", random.Random(0))
    assert inside.reasoning == "a<b"
    assert "".join(e[1] for e in events if e[0] == "content") == "c"
    plain = ReasoningParser(reasoning_state("prompt without thinking"))
    assert feed_in_pieces(plain, "Just an answer", random.Random(0))[0][0] == "content"
    assert reasoning_state("<think>\n\n</think>\n\n") == "done"


def test_reasoning_comes_before_the_constraint(compiler):
    from minivllm import StructuredOutputsParams
    plan = ChatOutputPlan(reasoning="maybe")
    asked = StructuredOutputsParams(choice=["yes", "no"])
    so = plan.constraint([], None, True, asked)
    fmt = json.loads(json.dumps(so.structural_tag))["format"]
    assert _accepts(compiler, fmt, "<think>let me see</think>yes")
    assert _accepts(compiler, fmt, "no")
    assert not _accepts(compiler, fmt, "<think>x</think>maybe")
    assert ChatOutputPlan().constraint([], None, True, asked) is asked


def test_reasoning_tokens_are_counted_to_the_closing_tag():
    """Up to and with the closing tag's token where the output has it (Qwen3's and
    DeepSeek-R1's vocabularies hold </think> as one token); else the reasoning's text
    encoded again, never more than the output."""
    end = 99
    def encode(text):
        return text.split()
    assert reasoning_tokens([5, 6, 7, end, 8, 9], "a b c", end, encode) == 4
    assert reasoning_tokens([5, 6, 7, 8], "a b c", end, encode) == 3  # tag spelled in pieces
    assert reasoning_tokens([5, 6], "a b c d", None, encode) == 2
    assert reasoning_tokens([5, end, 6], "", end, encode) == 0  # no reasoning
