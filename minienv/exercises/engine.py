"""Notebook 08's exercises: the KV slot of a token, and the engine loop by hand."""

from __future__ import annotations

from minienv.engine import InferenceEngine
from minienv.exercises._check import exercise, fail, require
from minienv.exercises.scheduling import _tiny_model, _TokenIds
from minienv.sampling import SamplingParams

# Prompts as token ids; 3 starts like 0 (a shared first block), so block tables are not simply [0, 1, 2, ...].
PROMPTS = [list(range(1, 20)), list(range(40, 51)), list(range(60, 84)), list(range(1, 11)) + [99, 98],
           list(range(100, 114))]
ENGINE = dict(kv_budget_tokens=96, block_size=8, max_num_seqs=3, max_num_batched_tokens=32)


@exercise("write slot_of(table, t, block_size): the physical KV slot of token t")
def check_slots(fn) -> str:
    """Hand-made cases (one per rule), then every token an engine computes, against the slots it wrote."""
    table, b = [5, 2, 9], 4
    for t in (0, 5, 9, 11):
        want = table[t // b] * b + t % b
        got = fn(list(table), t, b)
        if got == want:
            continue
        where = f"table {table}, block size {b}, token {t}: expected slot {want}, got {got}"
        if got == table[t // b] + t % b:
            fail("a block holds block_size slots: the block's first slot is its id × block_size", where)
        fail("the physical block is table[t // block_size] — not the logical block t // block_size", where)
    eng = InferenceEngine(_tiny_model(), _TokenIds(), **ENGINE)
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0))
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        plan = eng.history[-1].scheduler_output
        mgr = eng.kv_cache_manager
        for s in plan.scheduled:
            if not mgr.has_request(s.request_id):
                continue  # finished in this step: its table is gone
            blocks = list(mgr.block_ids(s.request_id))
            for k, t in enumerate(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)):
                got = fn(list(blocks), t, eng.block_size)
                require(got == int(s.slot_mapping[k]), "the slot the engine wrote: table[t // B] × B + t % B",
                        f"step {plan.step}, request {s.request_id}, token {t}, table {blocks}: "
                        f"expected slot {int(s.slot_mapping[k])}, got {got}")
                checked += 1
    return f"slot_of matches the engine's slot mapping for all {checked} tokens it computed"


@exercise("write run_to_completion(engine, prompts, params) -> {request_id: text} with add_request / step")
def check_run_to_completion(fn) -> str:
    params = SamplingParams(max_tokens=10, temperature=0)
    want = InferenceEngine(_tiny_model(), _TokenIds(), **ENGINE).generate(PROMPTS, params)
    eng = InferenceEngine(_tiny_model(), _TokenIds(), **ENGINE)
    got = fn(eng, [list(p) for p in PROMPTS], params)
    require(not eng.has_unfinished_requests(), "step until has_unfinished_requests() is false",
            "the engine still has unfinished requests when your function returned")
    require(isinstance(got, dict), "return a dict {request_id: text}", f"got {type(got).__name__}")
    ids = [o.request_id for o in want]
    require(sorted(got) == sorted(ids), "key the texts by the request ids add_request returned",
            f"expected keys {ids}, got {sorted(got)}")
    for o in want:
        require(got[o.request_id] == eng.output(o.request_id).text,
                "a request's text is all its deltas joined, in order (each delta is only what is new)",
                f"request {o.request_id}: expected {eng.output(o.request_id).text!r}, got {got[o.request_id]!r}")
        require(got[o.request_id] == o.text, "the loop by hand gives what generate() gives",
                f"request {o.request_id}: expected {o.text!r}, got {got[o.request_id]!r}")
    return "run_to_completion is generate(): add every request, step until none is unfinished, join the deltas"
