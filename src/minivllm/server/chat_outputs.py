"""What a chat answer is made of beyond text: reasoning, tool calls, and the grammar that
holds them (and a response_format) together. The chat endpoint builds a ChatOutputPlan
per request; each choice's output runs through a ChoiceParser, incrementally when
streamed (server/reasoning.py, server/tool_calls.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..sampling_params import StructuredOutputsParams
from .protocol import RequestError
from .reasoning import ReasoningParser, reasoning_prefix
from .tool_calls import ToolCallFormat, ToolCallParser, tools_grammar


def constraint_format(c: StructuredOutputsParams) -> dict:
    """A constraint as a structural tag's format (to sit after a reasoning block)."""
    kind = c.kind
    if kind == "json":
        schema = json.loads(c.json) if isinstance(c.json, str) else c.json
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":  # any keys (a bare {"type": "object"} is strict: none)
        return {"type": "json_schema", "json_schema": {"type": "object",
                                                       "additionalProperties": True}}
    if kind == "regex":
        return {"type": "regex", "pattern": c.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": c.grammar}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": v}
                                           for v in c.choice]}
    tag = json.loads(c.structural_tag) if isinstance(c.structural_tag, str) \
        else c.structural_tag
    if "format" not in tag:
        raise RequestError("A reasoning model takes a structural_tag in its {'format': ...} "
                           "form.", param="structured_outputs")
    return tag["format"]


@dataclass
class ChatOutputPlan:
    """fmt: the tool-call format to parse (None: no tools in play); forced: the tool a
    named tool_choice forces; reasoning: reasoning.reasoning_state() of the prompt, or None
    without a reasoning parser."""

    fmt: ToolCallFormat | None = None
    forced: str | None = None
    reasoning: str | None = None

    @property
    def parses(self) -> bool:
        return self.fmt is not None or self.reasoning is not None

    def parser(self) -> "ChoiceParser":
        return ChoiceParser(self)

    def constraint(self, tools, tool_choice, parallel: bool,
                   asked: StructuredOutputsParams | None,
                   trigger_is_token: bool = False) -> StructuredOutputsParams | None:
        """The grammar the output is held to: the tools' (with a response_format schema
        for a text answer), after the reasoning when there is one; `asked` alone when
        nothing else is in play."""
        inner = None
        if self.fmt is not None:
            schema = None
            if asked is not None:
                if asked.kind not in ("json", "json_object"):
                    raise RequestError("Tools combine with a JSON response_format only.",
                                       param="response_format")
                schema = constraint_format(asked)["json_schema"]
            inner = tools_grammar(self.fmt, tools, tool_choice, self.forced, parallel,
                                  schema, trigger_is_token)
        elif asked is not None:
            if self.reasoning is None or reasoning_prefix(self.reasoning) is None:
                return asked
            inner = constraint_format(asked)
        if inner is None:
            return None
        prefix = reasoning_prefix(self.reasoning) if self.reasoning is not None else None
        fmt = inner if prefix is None else {"type": "sequence", "elements": [prefix, inner]}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                       "format": fmt})


@dataclass
class ChoiceParser:
    """One choice's text -> events ("reasoning", t), ("content", t), ("call", i),
    ("args", i, fragment); the parsed message parts once finished."""

    plan: ChatOutputPlan
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    content: str = ""

    def __post_init__(self) -> None:
        if self.plan.reasoning is not None:
            self.reasoning = ReasoningParser(self.plan.reasoning)
        if self.plan.fmt is not None:
            self.tools = ToolCallParser(self.plan.fmt)

    def feed(self, text: str) -> list[tuple]:
        return self._route(self.reasoning.feed(text) if self.reasoning else
                           [("content", text)] if text else [])

    def finish(self) -> list[tuple]:
        events = self._route(self.reasoning.finish()) if self.reasoning else []
        if self.tools is not None:
            events += self._content_events(self.tools.finish())
        return events

    def _route(self, events: list[tuple]) -> list[tuple]:
        out = []
        for e in events:
            if e[0] == "content" and self.tools is not None:
                out += self._content_events(self.tools.feed(e[1]))
            else:
                out += self._content_events([e])
        return out

    def _content_events(self, events: list[tuple]) -> list[tuple]:
        for e in events:
            if e[0] == "content":
                self.content += e[1]
        return events

    @property
    def calls(self) -> list:
        return self.tools.calls if self.tools is not None else []

    def message(self, prefix: str = "") -> dict:
        """The assistant message (non-streamed): content (None when only tool calls),
        reasoning_content, tool_calls."""
        content = prefix + self.content
        msg: dict = {"role": "assistant"}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning.reasoning or None
        if self.calls:
            msg["content"] = content if content.strip() else None
            msg["tool_calls"] = [c.as_dict() for c in self.calls]
        else:
            msg["content"] = content
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a forced call: "stop")."""
        if self.calls and engine_reason == "stop" and self.plan.forced is None:
            return "tool_calls"
        return engine_reason


def delta_of(event: tuple, parser: ChoiceParser) -> dict:
    """A stream chunk's delta for one parser event."""
    kind = event[0]
    if kind == "content":
        return {"content": event[1]}
    if kind == "reasoning":
        return {"reasoning_content": event[1]}
    call = parser.calls[event[1]]
    if kind == "call":
        return {"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}
