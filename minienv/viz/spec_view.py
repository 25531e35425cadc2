"""``SpeculationView``: speculative decoding of one request, verification by verification.

Each row is one engine step: the drafts the proposer guessed, coloured by the verdict — **kept** (green),
**rejected** (red, struck through; every draft after the first rejection is thrown away unjudged, pale red) —
then the token the target adds itself (blue: the *bonus* when every draft was kept, the *correction* drawn from
the residual otherwise). Under the rows, the request's KV slots after the last step, block by block: slots of
earlier tokens (grey), slots this step verified (green), and the slots the rejected drafts had reserved, given
back (dashed red outline, empty) — the truncate that keeps an unverified token out of the cache.

    view = SpeculationView(block_size=4)
    view.update([SpecRow(step=3, drafts=["the", " king"], num_accepted=1, target_token=" queen")],
                num_tokens=18)
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from . import _style as S
from ._view import SvgView

KEPT, REJECTED, UNJUDGED, TARGET, OLD = "#59a14f", "#e15759", "#f4c2c2", "#4e79a7", "#d9d9d9"


@dataclass(frozen=True)
class SpecRow:
    """One verification: the drafts (as text), how many were kept, and the token the target added."""

    step: int
    drafts: list[str]
    num_accepted: int
    target_token: str

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= len(self.drafts):
            raise ValueError(f"num_accepted must be in [0, {len(self.drafts)}], got {self.num_accepted}")


def _show(token: str) -> str:
    return html.escape(token.replace("\n", "⏎").replace(" ", "·")) or "∅"


class SpeculationView(SvgView):
    """A live picture of speculation for one request (see the module docstring)."""

    css_class = "minienv-speculation"

    def __init__(self, *, block_size: int, max_rows: int = 8, title: str = "speculative decoding") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.max_rows = max_rows
        self.title = title
        self.rows: list[SpecRow] = []
        self.num_tokens = 0  # tokens in the request's KV after the last row (computed)
        widgets = S.require("ipywidgets")
        self.widget = widgets.HTML(value=self.to_svg(), _dom_classes=(self.css_class,))

    def update(self, rows: list[SpecRow], *, num_tokens: int) -> None:
        """Show these rows (the last ``max_rows``) and a KV of ``num_tokens`` computed tokens."""
        self.rows = list(rows)[-self.max_rows:]
        self.num_tokens = int(num_tokens)
        self.widget.value = self.to_svg()

    def reset(self) -> None:
        self.update([], num_tokens=0)

    def to_svg(self) -> str:
        cw, ch, gap, left = 62, 22, 4, 58
        width = left + 9 * (cw + gap) + 10
        parts: list[str] = []
        y = 24
        parts.append(f'<text x="6" y="16" font-size="13" font-weight="bold">{html.escape(self.title)}</text>')
        if not self.rows:
            parts.append(f'<text x="6" y="{y + 14}" font-size="12" fill="#666">no verification yet</text>')
            y += 24
        for row in self.rows:
            parts.append(f'<text x="6" y="{y + 15}" font-size="11">step {row.step}</text>')
            x = left
            boxes = [(d, KEPT if i < row.num_accepted else REJECTED if i == row.num_accepted else UNJUDGED,
                      i >= row.num_accepted) for i, d in enumerate(row.drafts)]
            label = "bonus" if row.num_accepted == len(row.drafts) else "fix"
            boxes.append((row.target_token, TARGET, False))
            for j, (tok, fill, struck) in enumerate(boxes):
                parts.append(f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" rx="3" fill="{fill}"/>')
                color = "#ffffff" if fill in (KEPT, TARGET, REJECTED) else "#333333"
                deco = ' text-decoration="line-through"' if struck else ""
                parts.append(f'<text x="{x + cw / 2}" y="{y + 15}" font-size="11" text-anchor="middle" '
                             f'font-family="{S.FONT}" fill="{color}"{deco}>{_show(tok)[:8]}</text>')
                if j == len(boxes) - 1:
                    parts.append(f'<text x="{x + cw + 4}" y="{y + 15}" font-size="10" fill="#555">{label}</text>')
                x += cw + gap
            y += ch + gap
        # the KV slots after the last step
        y += 10
        last = self.rows[-1] if self.rows else None
        verified = last.num_accepted + 1 if last else 0  # the last token fed + the kept drafts
        rejected = len(last.drafts) - last.num_accepted if last else 0
        total = self.num_tokens + rejected
        B = self.block_size
        sw = max(8, min(22, (width - left) // max(total + B, 1)))
        parts.append(f'<text x="6" y="{y + 12}" font-size="11">KV slots</text>')
        for t in range(total + (-total) % B):
            x = left + t * sw + (t // B) * 4
            if t < self.num_tokens - verified:
                attrs = f'fill="{OLD}"'
            elif t < self.num_tokens:
                attrs = f'fill="{KEPT}"'
            elif t < total:
                attrs = f'fill="#ffffff" stroke="{REJECTED}" stroke-dasharray="3 2"'
            else:
                attrs = 'fill="#ffffff" stroke="#cccccc"'
            parts.append(f'<rect x="{x}" y="{y}" width="{sw - 2}" height="16" {attrs}/>')
        y += 22
        parts.append(f'<text x="{left}" y="{y + 10}" font-size="10" fill="#555">grey: earlier tokens · green: '
                     f'verified this step · dashed red: reserved for rejected drafts, given back · blocks of '
                     f'{B} slots</text>')
        height = y + 18
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'font-family="sans-serif">{"".join(parts)}</svg>')

    def __repr__(self) -> str:
        return f"SpeculationView(rows={len(self.rows)}, num_tokens={self.num_tokens})"
