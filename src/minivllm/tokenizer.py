"""Tokenizer loading and chat-template rendering (Hugging Face tokenizers, local files only)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no machine here reaches a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_tokenizer(source: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(source)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Flatten OpenAI list-of-parts content ([{"type": "text", "text": ...}]) to strings,
    the parts' texts one per line (as vLLM joins them: parts are often separate
    sentences or instructions)."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    if not isinstance(part.get("text"), str):
                        raise ValueError("A content part of type 'text' needs a string "
                                         "'text'.")
                    parts.append(part["text"])
                elif isinstance(part, str):
                    parts.append(part)
                else:
                    raise ValueError("Only text content parts are supported.")
            m["content"] = "\n".join(parts)
        elif content is None:
            m["content"] = ""
        out.append(m)
    return out


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None, **template_kwargs) -> str:
    if tokenizer is None:
        raise ValueError("Chat needs a tokenizer with a chat template.")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template; pass chat_template=...")
    return tokenizer.apply_chat_template(
        normalize_messages(messages), tokenize=False,
        add_generation_prompt=add_generation_prompt, chat_template=chat_template,
        **template_kwargs)
