"""Notebook 15's live widget (minienv/lab/live_answer.py), driven on the bundled model: each step is one engine step,
the view draws the pool after it — the shared prompt's blocks labelled "hit" when your request finds them — the
numbers and the answer's tokens as they appear; same answer every run, and the same as the engine alone."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from engine_harness import bundled  # noqa: E402

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.lab.live_answer import EARLIER, YOU, LiveAnswer, LiveAnswerView  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.viz.tokens import id_spans, ids_html  # noqa: E402

B = 4
SYSTEM = list(range(100, 111))  # 11 tokens: 2 full blocks of 4 shared, 3 tokens in a partial block
EARLIER_IDS = SYSTEM + [7, 8, 9]
YOUR_IDS = SYSTEM + [20, 21, 22, 23, 24, 25]  # 17 tokens


def _engine():
    model, tok = bundled()
    return InferenceEngine(model, tok, kv_budget_tokens=96, block_size=B)  # 24 blocks


def _run(max_tokens=9):
    live = LiveAnswer(_engine(), EARLIER_IDS, YOUR_IDS, max_tokens=max_tokens)
    view = LiveAnswerView(live.engine.num_blocks, live.engine.tokenizer, title="pool", columns=8)
    captions, frames = [], []
    while (caption := live.step()) is not None:
        view.update(live, caption)
        captions.append(caption)
        frames.append(view.grid.cells)
    return live, view, captions, frames


def test_each_step_is_one_engine_step_and_the_answer_is_the_engines():
    live, _, captions, _ = _run()
    assert live.done and len(captions) == live.engine.stats.num_steps == len(live.history)
    assert [h.request for h in live.history] == [EARLIER] + [YOU] * (len(live.history) - 1)
    alone = _engine().generate([YOUR_IDS], SamplingParams(max_tokens=9, temperature=0.0))[0]
    assert live.token_ids == list(alone.token_ids) and live.text == alone.text
    again, _, again_captions, _ = _run()
    assert again.token_ids == live.token_ids and again_captions == captions  # deterministic


def test_the_shared_full_blocks_are_hits_the_partial_one_is_computed():
    live, _, captions, _ = _run()
    first, yours = live.history[0], live.history[1]
    assert first.hit_tokens == 0 and first.computed_tokens == len(EARLIER_IDS)
    assert live.hit_tokens == yours.hit_tokens == len(SYSTEM) // B * B == 8
    assert yours.computed_tokens == len(YOUR_IDS) - 8
    assert live.hit_blocks == (0, 1)  # the earlier visitor's first two blocks, found by hash
    assert "8 from the cache (2 blocks hit)" in captions[1] and "cached" in captions[0]


def test_blocks_grow_with_the_tokens_and_are_drawn():
    live, view, captions, frames = _run()
    for h in live.history[1:]:
        if not h.finished:  # the pool holds the KV of every token but the newest
            assert h.your_blocks == -(-(len(YOUR_IDS) + h.output_tokens - 1) // B)
    held = [h.your_blocks for h in live.history[1:-1]]
    assert held == sorted(held) and held[-1] > held[0]  # a new block when the tokens fill one
    step2 = {c.block_id: c for c in frames[1]}
    assert [b for b, c in step2.items() if c.label == "hit"] == [0, 1]
    assert all(c.owners == (YOU,) for b, c in step2.items() if b in (0, 1))
    assert sum(c.owners == (YOU,) for c in frames[1]) == live.history[1].your_blocks
    assert live.history[-1].finished and live.history[-1].your_blocks == 0  # freed; the full blocks stay cached
    assert all(c.state != "used" for c in frames[-1]) and any(c.state == "cached" for c in frames[-1])
    assert view.stats.values["from the cache"] == 8 and view.stats.values["answer tokens"] == len(live.token_ids)
    assert f"<b>{len(live.token_ids)} tokens</b>" in view.tokens.value
    assert view.figure().data[0].text == view.grid.fig.data[0].text  # the PNG is the live grid
    texts = []
    for cells, caption in view.frames:  # an earlier step's picture is the one the live grid drew then
        view.grid.update(cells, caption=caption)
        texts.append((view.grid.fig.data[0].text, view.grid.fig.layout.title.text))
    for k in (1, 2, len(texts) - 1):
        fig = view.figure(step=k)
        assert (fig.data[0].text, fig.layout.title.text) == texts[k - 1]
    assert live.engine.stats.num_steps == len(live.history)  # drawn from the frames: no step run again
    with pytest.raises(ValueError, match="step must be in"):
        view.figure(step=len(texts) + 1)


def test_ids_html_draws_the_ids_given_not_a_re_encoding():
    _, tok = bundled()
    ids = tok.encode("To be, or not to be")
    spans = id_spans(tok, ids[::-1])
    assert [s.token_id for s in spans] == ids[::-1]
    assert ids_html(tok, ids).count('class="mnv-tok"') == len(ids)


def test_a_busy_engine_or_a_prompt_needing_two_prefill_steps_is_refused():
    eng = _engine()
    with pytest.raises(ValueError, match="several prefill steps"):
        LiveAnswer(eng, EARLIER_IDS, list(range(1, 600)))
    eng.add_request(EARLIER_IDS, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle engine"):
        LiveAnswer(eng, EARLIER_IDS, YOUR_IDS)
