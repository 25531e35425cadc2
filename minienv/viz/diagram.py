"""``flow_diagram``: a static top-to-bottom flow of boxes (the engine map), as SVG; ``forward_pass_svg``: one
decoder forward pass with a model's shapes (notebook 02).

A picture, not a widget: it renders the same in JupyterLab, on GitHub and on nbviewer.

    flow_diagram([Stage("Tokenizer", "text → token ids", "01"), Stage("Scheduler", ...)], title="the engine")
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _style as S


@dataclass(frozen=True)
class Stage:
    """One box: its name, a few lines of what it holds/does, and a note at the right (e.g. the notebook)."""

    name: str
    lines: tuple[str, ...] | str = ()
    note: str = ""
    children: tuple["Stage", ...] = field(default=())

    def line_list(self) -> list[str]:
        return [self.lines] if isinstance(self.lines, str) else list(self.lines)


def flow_svg(stages: list[Stage], *, title: str = "", start: str = "", end: str = "", width: int = 760) -> str:
    """SVG of stages top to bottom, joined by arrows; a stage's ``children`` are drawn as boxes inside it."""
    if not stages:
        raise ValueError("flow_svg needs at least one stage")
    pad, box_x, box_w, gap = 10, 110, 440, 26
    body: list[str] = []
    y = 12
    if title:
        body.append(S.svg_text(pad, y + 4, title, size=14, anchor="start", bold=True))
        y += 24
    if start:
        body.append(S.svg_text(box_x + box_w / 2, y + 6, start, size=12, color="#555555"))
        y += 14
        body += _arrow(box_x + box_w / 2, y, y + gap - 6)
        y += gap
    for k, st in enumerate(stages):
        lines = st.line_list()
        inner_h = sum(22 + 16 * len(c.line_list()) + 8 for c in st.children)
        h = 30 + 16 * len(lines) + inner_h + (8 if st.children else 4)
        color = S.PALETTE[k % len(S.PALETTE)]
        body.append(S.svg_rect(box_x, y, box_w, h, "#ffffff", stroke=color, width=2.5, rx=6))
        body.append(S.svg_rect(box_x, y, 8, h, color, stroke=color, width=0, rx=2))
        body.append(S.svg_text(box_x + 20, y + 17, st.name, size=13, anchor="start", bold=True))
        ly = y + 37
        for line in lines:
            body.append(S.svg_text(box_x + 20, ly, line, size=11, anchor="start", color="#333333"))
            ly += 16
        cy = ly - 4
        for c in st.children:
            ch = 22 + 16 * len(c.line_list())
            body.append(S.svg_rect(box_x + 20, cy, box_w - 40, ch, "#f6f8fb", stroke="#b8c4d6", width=1, rx=4))
            body.append(S.svg_text(box_x + 30, cy + 13, c.name, size=12, anchor="start", bold=True))
            if c.note:
                body.append(S.svg_text(box_x + box_w - 30, cy + 13, c.note, size=10, anchor="end", color="#555555"))
            cly = cy + 30
            for line in c.line_list():
                body.append(S.svg_text(box_x + 30, cly, line, size=10, anchor="start", color="#333333"))
                cly += 16
            cy += ch + 8
        if st.note:
            body.append(S.svg_text(box_x + box_w + 14, y + 17, st.note, size=11, anchor="start", color=color,
                                   bold=True))
        y += h
        if k < len(stages) - 1 or end:
            body += _arrow(box_x + box_w / 2, y + 2, y + gap - 4)
            y += gap
    if end:
        body.append(S.svg_text(box_x + box_w / 2, y + 4, end, size=12, color="#555555"))
        y += 14
    return S.svg_doc(width, y + 10, body, title=title or "flow diagram")


def _arrow(x: float, y0: float, y1: float) -> list[str]:
    return [
        f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y1 - 6:.1f}" stroke="#555555" stroke-width="2"/>',
        f'<polygon points="{x - 5:.1f},{y1 - 7:.1f} {x + 5:.1f},{y1 - 7:.1f} {x:.1f},{y1:.1f}" fill="#555555"/>',
    ]


def flow_diagram(stages: list[Stage], **kw):
    """``flow_svg`` as an ``IPython.display.SVG`` (displays in JupyterLab, GitHub and nbviewer)."""
    display = S.require("IPython.display")
    return display.SVG(data=flow_svg(stages, **kw))


def forward_pass_svg(config) -> str:
    """A box-and-arrow diagram of one decoder forward pass (notebook 02), labelled with the shapes of ``config``
    (a :class:`~minienv.model.LlamaConfig`): nine boxes, the per-layer ones bracketed "× layers"."""
    c = config
    boxes = [
        ("token ids  [N]", "#eeeeee"),
        (f"embedding  [N, {c.hidden_size}]", "#dbe9f6"),
        (f"RMSNorm → q/k/v proj  q[N,{c.num_attention_heads},{c.head_dim}]  k,v[N,{c.num_key_value_heads},{c.head_dim}]", "#fde2c8"),
        ("RoPE on q and k (position-dependent rotation)", "#fde2c8"),
        ("attention backend: write k,v to the KV cache; softmax(q·Kᵀ/√d)·V", "#f8c9c9"),
        ("o_proj, + residual", "#fde2c8"),
        (f"RMSNorm → SwiGLU MLP  [N, {c.intermediate_size}] → + residual", "#d9f0d3"),
        ("final RMSNorm → LM head", "#dbe9f6"),
        (f"logits  [N, {c.vocab_size}] → sampler → next token", "#eeeeee"),
    ]
    w, h, gap = 560, 34, 14
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 150}" height="{len(boxes) * (h + gap) + 10}" '
           'font-family="sans-serif" font-size="13">']
    for i, (label, color) in enumerate(boxes):
        y = 5 + i * (h + gap)
        out.append(f'<rect x="10" y="{y}" width="{w}" height="{h}" rx="6" fill="{color}" stroke="#555"/>')
        out.append(f'<text x="{10 + w / 2}" y="{y + h / 2 + 4}" text-anchor="middle">{label}</text>')
        if i < len(boxes) - 1:
            out.append(f'<line x1="{10 + w / 2}" y1="{y + h}" x2="{10 + w / 2}" y2="{y + h + gap}" stroke="#555"/>')
    top, bottom = 5 + 2 * (h + gap), 5 + 6 * (h + gap) + h
    out.append(f'<path d="M{w + 20},{top} h20 V{bottom} h-20" fill="none" stroke="#c33" stroke-width="2"/>')
    out.append(f'<text x="{w + 48}" y="{(top + bottom) / 2}" fill="#c33">× {c.num_hidden_layers} layers</text>')
    out.append("</svg>")
    return "\n".join(out)
