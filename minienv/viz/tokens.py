"""See how a tokenizer cuts text: each token a coloured span, its id underneath.

    from minienv.viz.tokens import TokenView, tokens_html
    view = TokenView(tokenizer, "To be, or not to be")   # live: type in the box, the spans follow
    view                                                 # the widget (in a notebook)
    view.static()                                        # the same picture as plain HTML (GitHub, nbviewer)
    tokens_html(tokenizer, "any text")                   # just the HTML string

Why a picture: a token is not a word. Seeing " the" (with its space) as one token, "Montague" as three, an
emoji as four byte-tokens, and a newline as a token of its own is what makes "tokens per character" and
"sequence length" concrete, and every later notebook counts KV-cache memory in tokens.

Conventions: consecutive tokens alternate through the shared palette (so neighbours differ); whitespace is
made visible (``·`` for a space, ``⏎`` for a newline, ``→`` for a tab); a token that holds only part of a
multi-byte character (byte-level BPE can cut a character) shows its bytes in hex, e.g. ``‹f0 9f›``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._style import FONT, PALETTE, esc, require, text_color
from ._view import View

__all__ = ["TokenSpan", "TokenView", "id_spans", "ids_html", "token_spans", "tokens_html"]

_VISIBLE = {" ": "·", "\n": "⏎", "\t": "→", "\r": "␍"}


@dataclass(frozen=True)
class TokenSpan:
    """One token as displayed: its id, its raw bytes, the label shown and its colour."""

    token_id: int
    raw: bytes
    label: str
    color: str
    special: bool


def _label(raw: bytes, special: bool) -> str:
    if special:
        return raw.decode("utf-8")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a multi-byte character
        return "‹" + " ".join(f"{b:02x}" for b in raw) + "›"
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def token_spans(tokenizer: Any, text: str) -> list[TokenSpan]:
    """Encode ``text`` and describe each token (works with any tokenizer offering ``encode``/``id_to_bytes``)."""
    return id_spans(tokenizer, tokenizer.encode(text))


def id_spans(tokenizer: Any, ids: Any) -> list[TokenSpan]:
    """Describe each of the token ``ids`` (e.g. what a model generated, which need not re-encode to the same ids)."""
    specials = set(getattr(tokenizer, "special_tokens", {}).values())
    spans = []
    for k, i in enumerate(ids):
        raw = tokenizer.id_to_bytes(i)
        spans.append(TokenSpan(i, raw, _label(raw, i in specials), PALETTE[k % len(PALETTE)], i in specials))
    return spans


def _span_html(s: TokenSpan) -> str:
    fg = text_color(s.color)
    border = "2px solid #111" if s.special else "1px solid #fff"
    title = f"id {s.token_id} · bytes {s.raw.hex(' ')}"
    return (
        f'<span class="mnv-tok" title="{esc(title)}" style="display:inline-block;margin:1px;padding:1px 3px;'
        f'border-radius:3px;border:{border};background:{s.color};color:{fg};text-align:center;'
        f'vertical-align:top"><span style="white-space:pre">{esc(s.label)}</span>'
        f'<br><span style="font-size:9px;opacity:.85">{s.token_id}</span></span>'
    )


def _spans_html(spans: list[TokenSpan], max_tokens: int) -> str:
    parts = []
    for s in spans[:max_tokens]:
        parts.append(_span_html(s))
        if s.raw.endswith(b"\n") and not s.special:
            parts.append("<br>")
    if len(spans) > max_tokens:
        parts.append(f"<span> … {len(spans) - max_tokens} more</span>")
    return "".join(parts)


def ids_html(tokenizer: Any, ids: Any, *, max_tokens: int = 2000) -> str:
    """Static HTML of the token ``ids`` as they are (one coloured span per id, id below it), e.g. a model's output
    token by token."""
    spans = id_spans(tokenizer, ids)
    head = f'<div style="font-size:12px;color:#444;margin-bottom:4px"><b>{len(spans)} tokens</b></div>'
    return (f'<div class="mnv-tokens" style="font-family:{FONT};font-size:13px;line-height:1.2">{head}'
            f'<div>{_spans_html(spans, max_tokens)}</div></div>')


def tokens_html(tokenizer: Any, text: str, *, max_tokens: int = 2000) -> str:
    """Static HTML: a stats line, then one coloured span per token (id below it).

    Newlines in the text also break the line of spans, so verse keeps its shape.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    spans = token_spans(tokenizer, text)
    n_bytes = len(text.encode("utf-8"))
    ratio = f"{len(spans) / len(text):.2f}" if text else "–"
    head = (f'<div style="font-size:12px;color:#444;margin-bottom:4px">{len(text)} characters · {n_bytes} bytes · '
            f'<b>{len(spans)} tokens</b> · {ratio} tokens per character</div>')
    return (f'<div class="mnv-tokens" style="font-family:{FONT};font-size:13px;line-height:1.2">{head}'
            f'<div>{_spans_html(spans, max_tokens)}</div></div>')


class TokenView(View):
    """A live view: a text box and, under it, the text's tokens; updates as you type.

    ``view.update(text)`` sets the text from code (and the box follows). ``view.ids`` / ``view.spans`` are what
    is shown, so a notebook can assert on it. ``static()`` gives the HTML for readers without a kernel.
    """

    def __init__(self, tokenizer: Any, text: str = "", *, placeholder: str = "Type here…") -> None:
        w = require("ipywidgets")
        self.tokenizer = tokenizer
        self.input = w.Textarea(value=text, placeholder=placeholder, continuous_update=True,
                                layout=w.Layout(width="100%", height="5em"))
        self.output = w.HTML()
        self.widget = w.VBox([self.input, self.output])
        self.spans: list[TokenSpan] = []
        self.input.observe(self._on_change, names="value")
        self._render(text)

    @property
    def text(self) -> str:
        return self.input.value

    @property
    def ids(self) -> list[int]:
        return [s.token_id for s in self.spans]

    def _on_change(self, change: dict) -> None:
        self._render(change["new"])

    def _render(self, text: str) -> None:
        self.spans = token_spans(self.tokenizer, text)
        self.output.value = tokens_html(self.tokenizer, text)

    def update(self, text: str) -> None:
        """Show ``text`` (as if typed)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if text == self.input.value:
            self._render(text)
        else:
            self.input.value = text  # triggers _on_change

    def to_html(self) -> str:
        return tokens_html(self.tokenizer, self.text)

    def __repr__(self) -> str:
        return f"TokenView({len(self.spans)} tokens, {len(self.text)} chars)"
