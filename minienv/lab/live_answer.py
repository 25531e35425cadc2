"""Notebook 15's live widget: one question answered by the engine step by step, the KV pool drawn as it goes.

Two requests share a system prompt: an earlier visitor's (one prefill step; when it finishes, its full blocks stay
in the pool, cached) and then yours. Each :meth:`LiveAnswer.step` is one ``engine.step()`` — the engine's own
loop, nothing re-implemented — and :class:`LiveAnswerView` draws the state after it with the views the other
chapters use: the pool as a :class:`~minienv.viz.BlockGrid` of
:func:`~minienv.viz.kv_views.manager_cells` (the blocks your prompt found in the cache labelled ``hit``), the
numbers in a :class:`~minienv.viz.StatsView` (prompt tokens hit / computed, blocks held, pool use, with bars), and
the answer's tokens as they appear (:func:`~minienv.viz.tokens.ids_html`).

The driver (:class:`LiveAnswer`) needs no widgets, so tests run it on the bundled toy model; the view needs the
``lab`` extra.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from minienv.sampling import SamplingParams

EARLIER, YOU = "earlier", "you"
#: the two requests' colours in the pool (from the series' palette: pink for the earlier visitor, blue for you)
OWNER_COLORS = {EARLIER: "#ff9da7", YOU: "#4e79a7"}


@dataclass(frozen=True)
class AnswerStep:
    """What one engine step did, seen from the two requests (one row of :attr:`LiveAnswer.history`)."""

    step: int  #: 1-based engine step
    request: str  #: the request this step advanced (``EARLIER`` or ``YOU``)
    hit_tokens: int  #: prompt tokens of that request found in the prefix cache (0 after its prefill)
    computed_tokens: int  #: tokens this step computed for it
    your_blocks: int  #: blocks your request holds after the step (0 before it arrives and after it finishes)
    used_blocks: int  #: blocks of the pool in use after the step (refcount > 0)
    output_tokens: int  #: tokens of your answer so far
    finished: bool  #: your request finished in this step


class LiveAnswer:
    """Drive ``engine`` through the earlier visitor's prompt, then yours, one engine step per :meth:`step`.

    ``earlier_ids`` and ``your_ids`` are token ids (the notebook renders both conversations with the chat template;
    they share the system prompt). The earlier request generates one token, so its prefill is its only step; yours
    is answered greedily, up to ``max_tokens``. Greedy and one request at a time: the same answer every run.
    """

    def __init__(self, engine, earlier_ids: Sequence[int], your_ids: Sequence[int], *, max_tokens: int = 48) -> None:
        if engine.has_unfinished_requests():
            raise ValueError("LiveAnswer needs an idle engine (it counts every step as its own)")
        longest = max(len(earlier_ids), len(your_ids))
        if longest > engine.max_num_batched_tokens:
            raise ValueError(f"a {longest}-token prompt takes several prefill steps here (max_num_batched_tokens="
                             f"{engine.max_num_batched_tokens}); LiveAnswer shows one prefill step per prompt")
        self.engine = engine
        self.earlier_ids, self.your_ids = list(earlier_ids), list(your_ids)
        self.max_tokens = int(max_tokens)
        self.history: list[AnswerStep] = []
        self.hit_blocks: tuple[int, ...] = ()  #: the physical blocks your prompt found cached
        self.hit_tokens = 0  #: your prompt's tokens served from the cache
        self.token_ids: list[int] = []  #: your answer so far
        self.text = ""
        self.done = False

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def step(self) -> str | None:
        """One engine step (adding the next request first when the previous one is done); a caption, or None when
        your answer is complete."""
        eng, kv = self.engine, self.engine.kv_cache_manager
        if self.done:
            return None
        if not self.history:
            eng.add_request(self.earlier_ids, SamplingParams(max_tokens=1, temperature=0.0), request_id=EARLIER)
        elif self.history[-1].request == EARLIER:
            eng.add_request(self.your_ids, SamplingParams(max_tokens=self.max_tokens, temperature=0.0),
                            request_id=YOU)
        who = EARLIER if len(self.history) == 0 else YOU
        prefill = eng.requests[who].num_computed_tokens == 0
        out = {o.request_id: o for o in eng.step()}.get(who)
        if out is None:  # every step advances the one running request by a token (no chunking: see __init__)
            raise RuntimeError(f"engine step {len(self.history) + 1} gave request {who!r} no output")
        hit = out.num_cached_tokens if prefill else 0
        computed = len(self.earlier_ids if who == EARLIER else self.your_ids) - hit if prefill else 1
        if prefill and who == YOU:
            self.hit_tokens = hit
            self.hit_blocks = tuple(kv.block_ids(YOU)[: hit // self.block_size]) if kv.has_request(YOU) else ()
        if who == YOU:
            self.token_ids, self.text = list(out.token_ids), out.text
            self.done = out.finished
        used = kv.num_blocks - kv.num_free_blocks
        mine = len(kv.block_ids(YOU)) if kv.has_request(YOU) else 0
        self.history.append(AnswerStep(len(self.history) + 1, who, hit, computed, mine, used, len(self.token_ids),
                                       who == YOU and self.done))
        return self.caption()

    def caption(self) -> str:
        s = self.history[-1]
        if s.request == EARLIER:
            return (f"step {s.step}: an earlier visitor's prompt, {s.computed_tokens} tokens computed; it is done, "
                    f"and its {len(self.earlier_ids) // self.block_size} full blocks stay in the pool, cached")
        if s.hit_tokens or s.output_tokens == 1:
            return (f"step {s.step}: your prompt, {s.hit_tokens + s.computed_tokens} tokens: {s.hit_tokens} from "
                    f"the cache ({len(self.hit_blocks)} blocks hit), {s.computed_tokens} computed")
        if s.finished:
            return (f"step {s.step}: done after {s.output_tokens} tokens — your blocks go back to the free queue, "
                    "the full ones still cached")
        return f"step {s.step}: token {s.output_tokens}, your request holds {s.your_blocks} blocks"

    def cells(self):
        """The pool as :class:`~minienv.viz.BlockCell` records, your cache hits labelled ``hit``."""
        from minienv.viz.kv_views import manager_cells

        kv = self.engine.kv_cache_manager
        cells = manager_cells(kv)
        held = set(kv.block_ids(YOU)) if kv.has_request(YOU) else set()
        return [dataclasses.replace(c, label="hit") if c.block_id in self.hit_blocks
                and c.block_id in held else c for c in cells]


class LiveAnswerView:
    """The pool, the numbers and the answer's tokens of a :class:`LiveAnswer`, updated in place after each step."""

    def __init__(self, num_blocks: int, tokenizer, *, title: str, columns: int = 16, cell_px: int = 50) -> None:
        import ipywidgets as w

        from minienv.viz import BlockGrid, StatsView

        self.tokenizer = tokenizer
        # fixed colours, so a step redrawn in a grid of its own (figure(step)) looks as it did live
        self._grid_args = dict(columns=columns, title=title, cell_px=cell_px, owner_colors=OWNER_COLORS)
        self.grid = BlockGrid(num_blocks, **self._grid_args)
        self.frames: list[tuple] = []  #: (cells, caption) drawn at each step since the last reset
        self.stats = StatsView(title="your request")
        self.tokens = w.HTML()
        self.widget = w.VBox([self.grid.widget, w.HBox([self.stats.widget, self.tokens])])

    def reset(self) -> None:
        self.frames = []
        self.grid.reset()
        self.stats.reset()
        self.tokens.value = ""

    def update(self, live: LiveAnswer, caption: str) -> None:
        from minienv.viz.tokens import ids_html

        kv = live.engine.kv_cache_manager
        cells = live.cells()
        self.frames.append((cells, caption))
        self.grid.update(cells, caption=caption)
        s = live.history[-1]
        prompt = len(live.your_ids)
        seen = s.request == "you"
        self.stats.update({"prompt tokens": prompt if seen else "–",
                           "from the cache": live.hit_tokens if seen else "–",
                           "answer tokens": s.output_tokens,
                           "blocks held": s.your_blocks,
                           "pool in use": f"{s.used_blocks} / {kv.num_blocks} blocks"},
                          bars={"from the cache": (live.hit_tokens, prompt)} if seen else None)
        self.tokens.value = ids_html(self.tokenizer, live.token_ids)

    def figure(self, step: int | None = None):
        """A plain plotly figure of the pool now, or as the grid drew it after ``step`` (1-based), its changes
        outlined — what ``minienv.viz.static.show`` turns into a PNG. An earlier step is redrawn in a grid of its
        own (the live one is left as it is), from the frames kept: no engine step is run again."""
        if step is None:
            return self.grid.figure()
        if not 1 <= step <= len(self.frames):
            raise ValueError(f"step must be in 1..{len(self.frames)}, got {step!r}")
        from minienv.viz import BlockGrid

        grid = BlockGrid(self.grid.num_blocks, **self._grid_args)
        for cells, caption in self.frames[max(step - 2, 0): step]:
            grid.update(cells, caption=caption)
        return grid.figure()
