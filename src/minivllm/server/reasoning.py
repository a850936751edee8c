"""Reasoning outputs (`--reasoning-parser`): a model that thinks in <think>...</think>
before it answers (Qwen3, DeepSeek-R1 distills) has the reasoning reported apart from the
answer (`reasoning_content` in messages and deltas), and a grammar or a tool call
constrains only what follows it.

Whether the output starts inside the reasoning depends on the prompt: DeepSeek-R1's
template ends the prompt with "<think>\\n"; Qwen3's lets the model open it (and closes an
empty one in the prompt when thinking is off)."""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def reasoning_state(prompt: str) -> str:
    """"inside": the prompt opened the reasoning; "done": it closed one (thinking off);
    "maybe": the model may open one."""
    tail = prompt.rstrip()
    if tail.endswith(OPEN):
        return "inside"
    if tail.endswith(CLOSE):
        return "done"
    return "maybe"


def reasoning_tokens(token_ids, reasoning: str | None, end_id: int | None, encode) -> int:
    """How many of an output's tokens are its reasoning: those up to the closing tag's
    token (end_id, where the vocabulary has the tag as one token and the output holds it);
    else the reasoning's text encoded again (the same count but where a re-tokenization
    splits the text differently)."""
    if not reasoning:
        return 0
    ids = list(token_ids)
    if end_id is not None and end_id in ids:
        return ids.index(end_id) + 1
    return min(len(ids), len(encode(reasoning)))


def reasoning_prefix(state: str) -> dict | None:
    """The structural-tag format of the reasoning a grammar lets through first."""
    if state == "done":
        return None
    think = {"type": "tag", "begin": "" if state == "inside" else OPEN,
             "content": {"type": "any_text", "excludes": [CLOSE]}, "end": CLOSE}
    return think if state == "inside" else {"type": "optional", "content": think}


def _held_prefix(text: str, marker: str) -> int:
    """How many of text's last characters could start `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningParser:
    """feed(text) -> [("reasoning", t) | ("content", t)], incrementally."""

    state: str  # reasoning_state()'s: inside | maybe | done
    reasoning: str = ""
    _held: str = ""
    _content_started: bool = False

    def __post_init__(self) -> None:
        self.state = {"inside": "reasoning", "maybe": "start", "done": "content"}[self.state]

    def feed(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        self._held += text
        if self.state == "start":
            head = self._held.lstrip()
            if head.startswith(OPEN):
                self._held = head[len(OPEN):]
                self.state = "reasoning"
            elif OPEN.startswith(head):
                return events  # not yet known
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = self._held.find(CLOSE)
            if at < 0:
                keep = _held_prefix(self._held, CLOSE)
                self._reason(self._held[:len(self._held) - keep], events)
                self._held = self._held[len(self._held) - keep:]
                return events
            self._reason(self._held[:at], events)
            self._held = self._held[at + len(CLOSE):]
            self.state = "content"
        if self.state == "content":
            text, self._held = self._held, ""
            if not self._content_started:
                text = text.lstrip("\n")
                self._content_started = bool(text)
            if text:
                events.append(("content", text))
        return events

    def finish(self) -> list[tuple[str, str]]:
        """The end of the output: what was held back goes where it was headed (an
        unfinished reasoning stays reasoning)."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.state == "reasoning":
            events: list = []
            self._reason(held, events)
            return events
        return [("content", held)]

    def _reason(self, text: str, events: list) -> None:
        if text:
            self.reasoning += text
            events.append(("reasoning", text))
