"""A model's chat template: the Jinja program, shipped inside the model file, that turns messages into a prompt.

A chat model was trained on conversations written one exact way — SmolLM2 uses ChatML::

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n
    <|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n
    <|im_start|>assistant\\n

and answers well only when prompted the same way, down to the newlines. So the template is not re-typed here: it
is read from the model's file and rendered the way ``transformers``' ``apply_chat_template`` renders it (a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that does not escape HTML, ``raise_exception`` and ``strftime_now``), so minienv's prompt is the
reference's, byte for byte. The template may add a default system prompt when the conversation has none
(SmolLM2's does); the model then stops at the end-of-turn token (``<|im_end|>``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

__all__ = ["ChatTemplate", "check_messages"]

_ROLES = ("system", "user", "assistant")


def check_messages(messages: Any, where: str = "messages") -> list[dict]:
    """A conversation: a non-empty list of ``{"role": ..., "content": str}``; anything else is a ValueError
    naming the message and the field."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts, got "
                         f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in _ROLES:
            raise ValueError(f"{where}[{i}]['role'] must be one of {list(_ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}]['content'] must be a string, got {type(m.get('content')).__name__}")
        out.append(dict(m))
    return out


class ChatTemplate:
    """A compiled chat template; ``render(messages)`` is the prompt text, ending with the assistant's turn."""

    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None):
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ImportError("a chat template needs `jinja2` (pip install 'minienv[realmodel]')") from exc

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as transformers passes them
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc

    def render(self, messages: Any, *, add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages`` (checked first); ``add_generation_prompt`` opens the assistant's turn."""
        messages = check_messages(messages)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
