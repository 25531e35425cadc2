"""Notebook 08's exercises: latency in steps from what step() returns, and the engine loop by hand."""

from __future__ import annotations

from types import SimpleNamespace

from minienv.engine import InferenceEngine
from minienv.exercises._check import exercise, fail, require
from minienv.lab.tiny import TokenIdTokenizer, tiny_model
from minienv.sampling import SamplingParams

# Prompts as token ids; 3 starts like 0 (a shared first block), so block tables are not simply [0, 1, 2, ...].
PROMPTS = [list(range(1, 20)), list(range(40, 51)), list(range(60, 84)), list(range(1, 11)) + [99, 98],
           list(range(100, 114))]
ENGINE = dict(kv_budget_tokens=96, block_size=8, max_num_seqs=3, max_num_batched_tokens=32)


def _outputs(*steps: list[tuple[str, bool]]) -> list[list[SimpleNamespace]]:
    """Hand-made step outputs: one list per step of ``(request_id, finished)``."""
    return [[SimpleNamespace(request_id=rid, finished=fin, delta_text="x") for rid, fin in step] for step in steps]


_LATENCY_CASES = [  # (arrivals, step outputs, expected, the rule a wrong answer on this case breaks first)
    ({"a": 0}, _outputs([("a", True)]), {"a": (1, 1)},
     "steps are numbered from 1: the first step() call is step 1 (a request whose only token comes from it has "
     "TTFT 1 and e2e 1)"),
    ({"a": 0}, _outputs([], [], [("a", False)], [("a", True)]), {"a": (3, 4)},
     "the first token is the request's first OUTPUT: steps that ran only part of its prompt return nothing for it"),
    ({"a": 0, "b": 2}, _outputs([("a", False)], [("a", False)], [("a", True), ("b", False)], [("b", True)]),
     {"a": (1, 3), "b": (1, 2)},
     "count from the request's arrival: TTFT = first-token step − arrival, e2e = finishing step − arrival"),
    ({"a": 0}, _outputs([("a", False)], [], [], [("a", False)], [("a", True)]), {"a": (1, 5)},
     "e2e counts steps, not outputs: a preempted request can spend steps without an output"),
    ({"r2": 0, "r10": 0, "r1": 1}, _outputs([("r10", False), ("r2", True)], [("r1", True), ("r10", True)]),
     {"r2": (1, 1), "r10": (1, 2), "r1": (1, 1)},
     "key by request id: the order of a step's outputs is not the order the requests arrived in"),
]


@exercise("write latency_in_steps(arrivals, step_outputs) -> {request_id: (ttft_steps, e2e_steps)}")
def check_latency_in_steps(fn) -> str:
    """Hand-made step outputs (one rule each), then a real engine run with staggered arrivals, chunked prefill and
    preemption, against the metrics the engine itself records (``RequestOutput.metrics``)."""
    for arrivals, steps, want, rule in _LATENCY_CASES:
        fn.rule = rule
        got = fn(dict(arrivals), [list(step) for step in steps])
        shown = [[(o.request_id, "finished" if o.finished else "token") for o in step] for step in steps]
        require(isinstance(got, dict), "return a dict {request_id: (ttft_steps, e2e_steps)}", f"got {got!r}")
        got = {k: tuple(v) if isinstance(v, (tuple, list)) else v for k, v in got.items()}
        require(got == want, rule, f"arrivals {arrivals}, step outputs {shown}:\n  expected {want}\n  got      {got}")
    fn.rule = "the latencies of a real engine run equal the engine's own metrics"
    eng = InferenceEngine(tiny_model(), TokenIdTokenizer(), kv_budget_tokens=64, block_size=8, max_num_seqs=3,
                          max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0)
    arrivals, step_outputs, ids = {}, [], []
    schedule = {0: PROMPTS[:3], 2: PROMPTS[3:4], 5: PROMPTS[4:]}  # step count -> prompts added before that step
    while eng.has_unfinished_requests() or len(step_outputs) <= max(schedule):
        for p in schedule.get(len(step_outputs), []):
            rid = eng.add_request(p, params)
            arrivals[rid] = len(step_outputs)
            ids.append(rid)
        step_outputs.append(eng.step())
    got = fn(dict(arrivals), [list(step) for step in step_outputs])
    for rid in ids:
        m = eng.output(rid).metrics
        want = (m.ttft_steps, m.e2e_steps)
        require(isinstance(got, dict) and tuple(got.get(rid, ())) == want, fn.rule,
                f"request {rid} (arrived after {arrivals[rid]} steps): the engine recorded {want}, you said "
                f"{got.get(rid) if isinstance(got, dict) else got!r}")
    pre = eng.scheduler.num_preemptions
    return (f"latency_in_steps equals the engine's metrics for {len(ids)} requests over {len(step_outputs)} steps "
            f"(staggered arrivals, chunked prefill, {pre} preemption{'s' if pre != 1 else ''})")


_ONLY = ("add_request", "step", "has_unfinished_requests")
_PROCESS_RULE = "use only add_request, step and has_unfinished_requests — the loop generate() runs, by hand"


class _StepOnlyEngine:
    """The engine as the exercise allows it: ``add_request``, ``step`` and ``has_unfinished_requests``. Anything
    else (``generate``, ``output``, ...) fails the process rule, whatever the answer would have been."""

    def __init__(self, engine: InferenceEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        if name in _ONLY:
            return getattr(self._engine, name)
        fail(_PROCESS_RULE, f"your function used engine.{name}")


@exercise("write run_to_completion(engine, prompts, params) -> {request_id: text} with add_request / step")
def check_run_to_completion(fn) -> str:
    params = SamplingParams(max_tokens=10, temperature=0)
    want = InferenceEngine(tiny_model(), TokenIdTokenizer(), **ENGINE).generate(PROMPTS, params)
    eng = InferenceEngine(tiny_model(), TokenIdTokenizer(), **ENGINE)
    got = fn(_StepOnlyEngine(eng), [list(p) for p in PROMPTS], params)
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
