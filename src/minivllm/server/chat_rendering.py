"""A conversation, with its tools, as the chat template reads it: shared by the server's
chat endpoints (serving.py) and the offline LLM.chat (llm.py).

A template that renders tools gets them as its `tools` variable; one that does not gets
them in a system message (tool_calls.tools_system_prompt). An assistant message's
tool_calls reach a template that renders them with their arguments as objects, and one
that does not as text in the message's content, in the model's call format.
"""

from __future__ import annotations

import json

from ..tokenizer import render_chat
from .tool_calls import format_for_template, render_tool_calls, tools_system_prompt


def chat_template_of(tokenizer) -> str | None:
    """The template apply_chat_template(chat_template=None) renders with, or None."""
    try:
        return tokenizer.get_chat_template()
    except (ValueError, AttributeError, TypeError):
        template = getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


class ChatRenderer:
    """Renders conversations for one tokenizer. tool_call_parser: the tool-call format's
    name (None or "auto": the chat template's, hermes when it shows none)."""

    def __init__(self, tokenizer, tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        template = chat_template_of(tokenizer) if tokenizer is not None else None
        self.tool_format = format_for_template(template, tool_call_parser)
        self.template_renders_tools = bool(template) and "tools" in template
        self.template_renders_calls = bool(template) and "tool_calls" in template

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               tool_choice=None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text; ValueError (or the template's own error) when it cannot be
        rendered."""
        messages, kwargs = self.prepare(messages, tools, tool_choice, add_generation_prompt,
                                        continue_final_message, chat_template,
                                        chat_template_kwargs)
        return render_chat(self.tokenizer, messages, chat_template=chat_template, **kwargs)

    def prepare(self, messages: list[dict], tools: list[dict] | None, tool_choice,
                add_generation_prompt: bool, continue_final_message: bool,
                chat_template: str | None, chat_template_kwargs: dict | None
                ) -> tuple[list[dict], dict]:
        """(the messages, the template's keyword arguments) for render_chat; ValueError
        for malformed tool_calls. chat_template_kwargs may set add_generation_prompt and
        continue_final_message too, and win (as vLLM's)."""
        messages = [self.template_message(dict(m)) for m in messages]
        kwargs = {"add_generation_prompt": add_generation_prompt,
                  "continue_final_message": continue_final_message,
                  **(chat_template_kwargs or {})}
        if tools and (chat_template or self.template_renders_tools):
            kwargs.setdefault("tools", tools)
        elif tools and tool_choice != "none":
            # The template shows no tools: tell the model about them in a system message.
            note = tools_system_prompt(tools, self.tool_format)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
            else:
                messages.insert(0, {"role": "system", "content": note})
        return messages, kwargs

    def template_message(self, m: dict) -> dict:
        """A message as chat templates read it: content never missing; an assistant's
        tool_calls with their arguments as objects (templates write them with tojson), or
        written into its content for a template that does not render tool_calls."""
        m.setdefault("content", "")
        calls = m.get("tool_calls")
        if not calls:
            return m
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ValueError("tool_calls must be a list of objects.")
        if not self.template_renders_calls:
            text = render_tool_calls(calls, self.tool_format)
            content = m["content"] if isinstance(m["content"], str) else ""
            return {k: v for k, v in m.items() if k != "tool_calls"} | {
                "content": (content + "\n" if content else "") + text}
        fixed = []
        for c in calls:
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            fixed.append({**c, "function": fn})
        return {**m, "tool_calls": fixed}
