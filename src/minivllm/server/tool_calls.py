"""Tool calling: the call formats models are trained on, the grammar that holds a call to
its tool's JSON schema, and an incremental parser of the model's output into content and
calls (for streaming: each call's id and name first, then its argument fragments).

Formats (`--tool-call-parser`, else chosen from the chat template):
    hermes       Qwen2.5 / Qwen3 / Hermes:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.1 / 3.2:           {"name": "f", "parameters": {...}}   (";"-separated)
    mistral      Mistral:                   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]

The grammar is an xgrammar structural tag: under tool_choice "auto" the text is free until
the format's trigger, then the call is held to the tool's schema; "required" allows
calls only (at least one, then the end), a named tool exactly that one; parallel_tool_calls
false stops after the first. Because every call the model makes is generated under that grammar, the
parser can rely on the format's exact text around the arguments.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    trigger: str       # the text that opens the model's tool calls
    call_open: str     # before the function's name (after the trigger for list formats)
    args_key: str      # the key of the arguments object
    call_close: str    # after the call's JSON object closes
    listed: bool = False  # the calls sit in one JSON list after the trigger (Mistral)

    def begin(self, name: str) -> str:
        return self.call_open + json.dumps(name)[1:-1] + f'", "{self.args_key}": '


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "', "arguments",
                             "}\n</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", '{"name": ', '{"name": "', "parameters",
                                  "}"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", '{"name": "', "arguments", "}",
                              listed=True),
}


def format_for_template(template: str | None, choice: str | None = None) -> ToolCallFormat:
    """The format `choice` names, else the one the chat template renders (hermes when it
    shows none: a template without tool support gets the tools in a system message)."""
    if choice and choice != "auto":
        if choice not in FORMATS:
            raise ValueError(f"Unknown tool-call parser {choice!r}; known: "
                             f"{', '.join(FORMATS)}.")
        return FORMATS[choice]
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


# ---- the request's tools ------------------------------------------------------------------

@dataclass
class ToolSpec:
    name: str
    parameters: dict


def check_tools(tools: list | None, tool_choice) -> tuple[list[ToolSpec], str | None]:
    """The request's function tools and the tool name a named tool_choice forces; ValueError
    (with the offending field) for a tool without a name or with a name taken, a choice
    of an unknown tool, "required" without tools."""
    specs = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only tools of type 'function' are supported.")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name is required.")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", fn["name"]):
            raise ValueError(f"tools[{i}].function.name {fn['name']!r} must be 1-64 letters, "
                             "digits, underscores, dashes, dots or colons.")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")
        specs.append(ToolSpec(fn["name"], params))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("tools: two tools have the same name.")
    forced = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type", "function") == "function" \
            else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}.')
        if name not in {s.name for s in specs}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in "
                             "tools.")
        forced = name
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named '
                         f"function, got {tool_choice!r}.")
    elif tool_choice == "required" and not specs:
        raise ValueError('tool_choice "required" needs tools.')
    return specs, forced


def tools_grammar(fmt: ToolCallFormat, tools: list[ToolSpec], tool_choice, forced: str | None,
                  parallel: bool, answer_schema: dict | None = None,
                  trigger_is_token: bool = False) -> dict:
    """The structural tag's format (a dict) for the request's tool choice. answer_schema: a
    response_format schema the text answer must follow when the model calls no tool
    (tool_choice auto)."""
    def call_tag(spec: ToolSpec, begin_prefix: str = "") -> dict:
        return {"type": "tag", "begin": begin_prefix + fmt.begin(spec.name),
                "content": {"type": "json_schema", "json_schema": spec.parameters},
                "end": fmt.call_close}

    chosen = [t for t in tools if forced is None or t.name == forced]
    if fmt.listed:
        calls = {"type": "tags_with_separator", "tags": [call_tag(t) for t in chosen],
                 "separator": ", ", "at_least_one": True,
                 "stop_after_first": forced is not None or not parallel}
        if trigger_is_token:  # the trigger is one special token, which text cannot spell
            listed = {"type": "tag", "begin": {"type": "token", "token": fmt.trigger},
                      "content": {"type": "sequence", "elements": [
                          {"type": "const_string", "value": "["}, calls]}, "end": "]"}
        else:
            listed = {"type": "tag", "begin": fmt.trigger + "[", "content": calls, "end": "]"}
        if forced is not None or tool_choice == "required":
            return listed
        if answer_schema is not None:
            return {"type": "or", "elements": [
                listed, {"type": "json_schema", "json_schema": answer_schema}]}
        if trigger_is_token:
            return {"type": "token_triggered_tags", "trigger_tokens": [fmt.trigger],
                    "tags": [listed], "stop_after_first": True}
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [listed],
                "stop_after_first": True}
    if forced is not None:
        return call_tag(chosen[0])
    if tool_choice == "required":  # calls and nothing else, one a line, then the end
        return {"type": "tags_with_separator", "tags": [call_tag(t) for t in chosen],
                "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}
    triggered = {"type": "triggered_tags", "triggers": [fmt.trigger],
                 "tags": [call_tag(t) for t in chosen], "stop_after_first": not parallel}
    if answer_schema is None:
        return triggered
    calls = dict(triggered, at_least_one=True)
    return {"type": "or", "elements": [calls, {"type": "json_schema",
                                               "json_schema": answer_schema}]}


def tools_system_prompt(tools: list[dict], fmt: ToolCallFormat) -> str:
    """For a chat template that does not render tools: the tool definitions and the call
    format, as a system message."""
    example = fmt.begin("function_name") + '{"arg": "value"}' + fmt.call_close
    if fmt.listed:
        example = fmt.trigger + "[" + example + "]"
    return ("You may call one or more functions to assist with the user query. The "
            "functions, as JSON schemas:\n"
            + "\n".join(json.dumps(t.get("function", t)) for t in tools)
            + f"\nTo call a function, answer with exactly:\n{example}")


def render_tool_calls(calls: list[dict], fmt: ToolCallFormat) -> str:
    """An assistant message's tool_calls written as the model would (for a template that
    does not render tool_calls itself)."""
    parts = []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args)
        parts.append(fmt.begin(fn.get("name", "")) + args + fmt.call_close)
    if fmt.listed:
        return fmt.trigger + "[" + ", ".join(parts) + "]"
    return "\n".join(parts)


def new_call_id(fmt: ToolCallFormat) -> str:
    if fmt.name == "mistral":  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ---- parsing, incrementally ----------------------------------------------------------------

@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCallParser:
    """Splits the model's text into content and tool calls as it arrives: feed() takes
    each new piece of text and returns events, ("content", text), ("call", index)
    when call `index` got its id and name, ("args", index, fragment); O(new text) each.
    Text that may be the start of the trigger is held back until it is known."""

    fmt: ToolCallFormat
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _state: str = "text"   # text | seek | object | after
    _held: str = ""        # text not yet classified
    _obj: str = ""         # the call's JSON object so far
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _call: int | None = None  # the index of the call being read, once named
    _name_end: int = 0
    _args_at: int = -1     # where the arguments value starts in _obj
    _between: bool = False  # after a call: separators before more text are not content

    def feed(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        self._held += text
        while self._held:
            before = (self._state, len(self._held))
            getattr(self, "_" + self._state)(events)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[tuple]:
        """The end of the output: held text that never became a call is content, unless
        calls came before it (then it is the start of one more call, cut off)."""
        events = []
        if self._state == "text" and self._held and not self.calls:
            self._emit_content(self._held, events)
        self._held = ""
        return events

    def _emit_content(self, text: str, events: list) -> None:
        if text:
            self.content += text
            events.append(("content", text))

    def _text(self, events: list) -> None:
        if self._between:  # the separator after a call, however the text was split
            self._held = self._held.lstrip(" \n;")
            if not self._held:
                return
            self._between = False
        trigger = self.fmt.trigger
        at = self._held.find(trigger)
        if at >= 0:
            self._emit_content(self._held[:at], events)
            # Formats whose trigger is the call's own opening keep it in the object.
            keep = trigger if trigger.startswith("{") else ""
            self._held = keep + self._held[at + len(trigger):]
            self._state = "seek"
            return
        hold = 0
        for k in range(min(len(trigger) - 1, len(self._held)), 0, -1):
            if trigger.startswith(self._held[-k:]):
                hold = k
                break
        self._emit_content(self._held[:len(self._held) - hold], events)
        self._held = self._held[len(self._held) - hold:]

    def _seek(self, events: list) -> None:
        i = 0
        while i < len(self._held) and self._held[i] != "{":
            if self._held[i] == "]" and self.fmt.listed:
                self._held = self._held[i + 1:]
                self._state, self._between = "text", bool(self.calls)
                return
            i += 1
        if i == len(self._held):
            self._held = ""
            return
        self._held = self._held[i:]
        self._state = "object"
        self._obj, self._depth, self._in_string, self._escape = "", 0, False, False
        self._call, self._args_at, self._name_end = None, -1, 0

    def _object(self, events: list) -> None:
        text, self._held = self._held, ""
        for pos, ch in enumerate(text):
            d0 = self._depth
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            self._obj += ch
            if self._depth == 0:  # the object closed
                self._held = text[pos + 1:]
                self._finish_call(events)
                return
            if self._call is None:
                m = _NAME.match(self._obj)
                if m:
                    self.calls.append(ParsedCall(new_call_id(self.fmt),
                                                 json.loads(f'"{m.group(1)}"')))
                    self._call = len(self.calls) - 1
                    self._name_end = m.end()
                    events.append(("call", self._call))
            elif self._args_at < 0:
                m = _ARGS.match(self._obj, self._name_end)
                if m and m.end() == len(self._obj):
                    self._args_at = m.end()
            elif d0 >= 2 or self._depth >= 2 or not (ch.isspace() or ch == ","):
                self.calls[self._call].arguments += ch
                events.append(("args", self._call, ch))
        self._merge_args(events)

    def _finish_call(self, events: list) -> None:
        self._merge_args(events)
        if self._call is None:  # not a call after all: its text is content
            self._emit_content(self._obj, events)
            self._state = "text"
        else:
            call = self.calls[self._call]
            if not call.arguments.strip():
                call.arguments = "{}"
                events.append(("args", self._call, "{}"))
            self._state = "after"
        self._obj = ""

    @staticmethod
    def _merge_args(events: list) -> None:
        merged: list = []
        for e in events:
            if e[0] == "args" and merged and merged[-1][0] == "args" and merged[-1][1] == e[1]:
                merged[-1] = ("args", e[1], merged[-1][2] + e[2])
            else:
                merged.append(e)
        events[:] = merged

    def _after(self, events: list) -> None:
        """After a call's object: the format's closing text, a separator, or more."""
        fmt = self.fmt
        if fmt.listed:
            stripped = self._held.lstrip()
            if not stripped:
                self._held = ""
                return
            if stripped[0] == ",":
                self._held = stripped[1:]
                self._state = "seek"
            elif stripped[0] == "]":
                self._held = stripped[1:]
                self._state, self._between = "text", True
            else:
                self._state = "text"
                self._held = stripped
            return
        close = fmt.call_close[1:]  # after the object's own "}"
        if close:
            at = self._held.find(close.strip())
            if at < 0:
                return  # wait for it
            self._held = self._held[at + len(close.strip()):]
        self._between = True
        self._state = "text"
