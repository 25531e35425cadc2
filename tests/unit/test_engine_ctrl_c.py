"""Ctrl-C (a real SIGINT) and the engine (:mod:`minienv.engine.interrupts`).

A SIGINT that arrives while the engine changes its bookkeeping is held until the change is complete, then raised:
the engine is consistent and resuming gives every request the output it has alone. One during the model call
lands at once and the step is rolled back. The handler is installed once per public call and put back after it.
"""

from __future__ import annotations

import signal

import pytest

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

PROMPTS = ["the cat sat on", "a dog ran to the", "once upon a time there"]


@pytest.fixture(scope="module")
def model_tok():
    return load_model(), load_tokenizer()


@pytest.fixture(autouse=True)
def default_sigint():
    """SIGINT as a terminal's Python program or a Jupyter cell has it (Python's ``default_int_handler``), whatever
    this process inherited: under a background job or ``nohup`` SIGINT starts ignored, and then the engine rightly
    installs nothing (no Ctrl-C can arrive)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def alone(model, tok, prompt):
    eng = InferenceEngine(model, tok, kv_budget_tokens=1024)
    return eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids


def engine_with(model, tok):
    eng = InferenceEngine(model, tok, kv_budget_tokens=1024)
    eng.eos_token_id = None
    ids = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0)) for p in PROMPTS]
    return eng, ids


def test_sigint_during_the_commit_waits_for_its_end(model_tok):
    """A SIGINT raised from inside the step's commit (a KV event listener runs there) reaches the caller only
    after the step has committed: every invariant holds, and the run resumed gives each request its tokens."""
    model, tok = model_tok
    eng, ids = engine_with(model, tok)
    fired = []

    def listener(event):
        if event.kind == "cache" and not fired:  # inside update_from_output: halfway through the commit
            fired.append(eng.scheduler.num_steps)
            signal.raise_signal(signal.SIGINT)

    eng.kv_cache_manager.add_listener(listener)
    with pytest.raises(KeyboardInterrupt):
        eng.run()
    assert fired and eng.history[-1].step == fired[0] - 1, "the interrupted step was committed and recorded"
    assert eng.counters.failed_steps == 0
    eng.check_invariants()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handler was put back"
    eng.run()
    for rid, prompt in zip(ids, PROMPTS):
        assert eng.output(rid).token_ids == alone(model, tok, prompt)


def test_sigint_during_the_model_call_rolls_the_step_back(model_tok):
    """A SIGINT inside ``forward_step`` lands at once (nothing to protect there): the step is rolled back."""
    model, tok = model_tok
    eng, ids = engine_with(model, tok)
    calls = []
    forward = model.forward_step

    class Interrupting:
        config = model.config

        def forward_step(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)
                raise AssertionError("the SIGINT did not interrupt the model call")
            return forward(*args, **kwargs)

    eng.model = Interrupting()
    eng.step()
    eng.step()
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert eng.counters.failed_steps == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    eng.check_invariants()
    eng.run()
    for rid, prompt in zip(ids, PROMPTS):
        assert eng.output(rid).token_ids == alone(model, tok, prompt)


def test_a_program_with_its_own_sigint_handler_keeps_it(model_tok):
    model, tok = model_tok
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        eng, _ = engine_with(model, tok)
        eng.kv_cache_manager.add_listener(lambda e: signal.getsignal(signal.SIGINT) is mine or seen.append("x"))
        eng.run()
        assert "x" not in seen and signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_sigint_stays_ignored(model_tok):
    """A process started with SIGINT ignored (a background job, ``nohup``) cannot be interrupted: the engine leaves
    the disposition alone and runs."""
    model, tok = model_tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    eng, ids = engine_with(model, tok)
    eng.kv_cache_manager.add_listener(lambda e: signal.getsignal(signal.SIGINT) is signal.SIG_IGN or 1 / 0)
    eng.run()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert all(eng.output(rid).finished for rid in ids)
