"""The ceiling ``bench_engine.py`` part 3 and ``profile_engine.py --run ceiling`` measure the engine against
(``benchmarks/_ceiling.py``): a bare batched loop over the model with dense caches.

A ceiling is only evidence if it computes what the engine computes: its greedy tokens must equal the engine's
(and each request's tokens generated alone), whatever the mix of prompt lengths — otherwise a faster ceiling could
simply be doing less. And the profile split must count its samples and file them where the engine's go.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _ceiling  # noqa: E402
from _ceiling import DenseBatchDecode, bare_greedy, replay, slot_steps, trace_of  # noqa: E402
import profile_engine  # noqa: E402
from profile_engine import classify, split  # noqa: E402

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402


def _engine_greedy(model, tok, prompts, n_new):
    engine = InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16, max_num_seqs=len(prompts))
    engine.eos_token_id = None  # exactly n_new tokens, like the bare loop
    return [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0))]


def test_bare_loop_generates_the_engines_greedy_tokens(model, tok):
    """Prompts of 1 to 40 tokens (padding masks of every width, one sequence crossing a block mid-run)."""
    prompts = [tok.encode("ROMEO: But soft, what light through yonder window breaks?"), [5],
               tok.encode("To be, or not to be"), tok.encode("the")] + [list(range(7, 47))]
    got = bare_greedy(model, prompts, 12)
    assert got == _engine_greedy(model, tok, prompts, 12)
    assert got[1] == _engine_greedy(model, tok, [prompts[1]], 12)[0]  # and == a request generated alone
    assert all(len(row) == 12 for row in got)


def test_dense_batch_decode_masks_each_sequences_padding(model):
    """After a prefill of lengths 3 and 1, the decode step attends over 4 slots: the short sequence's slots 2-3
    hold zeros and must be hidden (additive -inf), the long one's all seen."""
    backend = DenseBatchDecode(model, [3, 1], max_len=8)
    backend.end_step()  # as after the prefill step
    backend.begin_step(np.array([3, 1]))
    assert backend.lens.tolist() == [3, 1]
    bias = backend._bias[:, 0, 0]  # [S, 1, T] -> rows per sequence
    assert np.isneginf(bias[1, 0, 2:]).all() and (bias[1, 0, :2] == 0).all()
    assert (bias[0] == 0).all()


@pytest.mark.parametrize("root, attend, outside", [
    ("bare_greedy (_ceiling.py:72)", "DenseBatchDecode.attend (_ceiling.py:60)", "load_model (minienv/model/llama.py:328)"),
    ("replay (_ceiling.py:200)", "DenseSlots.attend (_ceiling.py:180)", "traced_continuous_run (_ceiling.py:260)"),
])
def test_profile_split_counts_the_bare_loops_and_files_their_attention_under_attention(tmp_path, root, attend,
                                                                                       outside):
    """The lockstep bare loop and the continuous run's replay: their samples count, their backends' attention is
    filed under attention, and what runs outside them (model loading, recording the trace) is not counted."""
    frames = f"<module> (profile_engine.py:1);run (profile_engine.py:2);{root};" \
             "LlamaModel.forward_step (minienv/model/llama.py:308);"
    raw = tmp_path / "run.raw"
    raw.write_text(f"{frames}{attend};memcpy (libc.so.6) 3\n"
                   f"{frames}sgemm_kernel (libscipy_openblas64_.so) 5\n"
                   f"<module> (profile_engine.py:1);run (profile_engine.py:2);{outside} 7\n")
    result = split(raw)
    assert result["samples"] == 8  # model loading / the trace's engine run are not counted
    assert result["blas_percent"] == 62.5
    assert result["percent"]["attention: other (gather, softmax, masks)"] == 37.5
    assert classify(frames + f"{attend};memcpy") == "attention: other (gather, softmax, masks)"


def _small_continuous_run(model_, tok_, attention_kernel="auto"):
    """A stand-in for ``_ceiling.continuous_run`` that runs in a moment: 4 requests, decodes over 3-9 blocks."""
    engine = InferenceEngine(model_, tok_, kv_budget_tokens=2048, block_size=16, max_num_seqs=4,
                             attention_kernel=attention_kernel)
    engine.eos_token_id = None
    for n in (40, 70, 90, 130):
        engine.add_request(list(range(1, n)), SamplingParams(max_tokens=6, temperature=0))
    return engine


KERNELS = ["auto", "numpy"] + ([] if importlib.import_module("minienv.kv.paged_attention").NUMBA_MISSING
                               else ["numba"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_profile_continuous_run_runs_the_kernel_asked_for(monkeypatch, capsys, kernel):
    """``--run continuous --kernel K`` runs every step's paged attention with K (a small run here, once), and
    prints each run's CPU time; "auto" is the block walk when numba imports, else numpy."""
    paged_attention = importlib.import_module("minienv.kv.paged_attention")  # the module: minienv.kv re-exports
    engines = []  # a function of the same name

    def small_run(model_, tok_, attention_kernel="auto"):
        engines.append(_small_continuous_run(model_, tok_, attention_kernel))
        return engines[-1]

    monkeypatch.setattr(_ceiling, "continuous_run", small_run)
    monkeypatch.setattr(profile_engine, "REPEATS", 1)
    profile_engine.run("continuous", kernel=kernel)
    (engine,) = engines
    assert engine.backend.kernel == paged_attention.resolve_kernel_name(kernel)
    assert engine.backend.kv_pool is engine.kv_pool
    assert not engine.scheduler.has_unfinished_requests()
    assert f"continuous run, kernel {kernel}: 1 runs" in capsys.readouterr().out


def test_profile_race_kernels_times_every_kernel_and_checks_their_tokens(monkeypatch, capsys):
    """``--race-kernels``: each kernel really runs, its times are reported against auto's, and a kernel whose
    tokens differ stops the race instead of being timed."""
    import json

    core = importlib.import_module("minienv.engine.core")
    seen = []
    backend = core.PagedAttentionBackend

    class Spy(backend):
        def __init__(self, kv_pool, kernel="auto"):
            seen.append(kernel)
            super().__init__(kv_pool, kernel)

    monkeypatch.setattr(core, "PagedAttentionBackend", Spy)
    monkeypatch.setattr(_ceiling, "continuous_run", _small_continuous_run)
    profile_engine.race_kernels(3)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(seen) == set(KERNELS)
    assert set(result["kernels"]) == set(KERNELS) and result["identical_tokens"]
    assert result["kernels"]["auto"]["paired_over_auto"] == 1.0
    assert all(k["min_s"] > 0 for k in result["kernels"].values())

    class Wrong(backend):  # the numpy side attends wrongly
        def attend(self, layer_idx, q, k, v):
            out = super().attend(layer_idx, q, k, v)
            return out * 0.5 if self.kernel == "numpy" and KERNELS[-1] == "numba" else out

    if KERNELS[-1] == "numba":
        monkeypatch.setattr(core, "PagedAttentionBackend", Wrong)
        with pytest.raises(SystemExit, match="different tokens: numpy against"):
            profile_engine.race_kernels(3)


@pytest.mark.parametrize("argv", [["--run", "single", "--kernel", "numba"],
                                  ["--split", "run.raw", "--kernel", "numpy"],
                                  ["--race-kernels", "3", "--kernel", "numba"],
                                  ["--race-kernels", "2"]])
def test_profile_refuses_a_kernel_it_would_ignore_and_a_race_too_short(monkeypatch, capsys, argv):
    """A kernel asked for a run that has no such choice is an error, not silently ignored; so is a race of fewer
    than the harness's 3 rounds."""
    monkeypatch.setattr(sys, "argv", ["profile_engine.py", *argv])
    with pytest.raises(SystemExit) as exc:
        profile_engine.main()
    assert exc.value.code == 2
    assert ("--kernel applies to --run continuous only" if "--kernel" in argv else "at least 3 rounds") \
        in capsys.readouterr().err


def test_profile_split_files_each_model_piece_under_its_name():
    """Each model function the forward pass calls is named in the split (RoPE's in-place rotation included)."""
    step = "bare_greedy (_ceiling.py:72);LlamaModel.forward_step (minienv/model/llama.py:307);"
    for func, name in (("rms_norm (minienv/model/llama.py:41)", "model: RMSNorm"),
                       ("rotate_in_place (minienv/model/llama.py:101)", "model: RoPE"),
                       ("RopeTable.rows (minienv/model/llama.py:161)", "model: RoPE"),
                       ("silu_and_mul (minienv/model/llama.py:66)", "model: SiLU"),
                       ("LlamaModel._check_tokens (minienv/model/llama.py:222)", "model: input checks")):
        assert classify(step + func + ";FLOAT_add (numpy)") == name, func
    assert classify(step + "FLOAT_add (numpy)") == "model: other numpy (residuals, embedding, slicing)"


def _traced_run(model, tok):
    """A small continuous run, every step kept: 8 requests of 3-40 prompt tokens, at most 4 running, 24 tokens a
    step (so prompts are chunked, and chunks share steps with decodes), 2-12 greedy tokens each."""
    engine = InferenceEngine(model, tok, kv_budget_tokens=2048, block_size=16, max_num_seqs=4,
                             max_num_batched_tokens=24, history_size=10_000)
    engine.eos_token_id = None
    rng = np.random.default_rng(3)
    for _ in range(8):
        engine.add_request(rng.integers(1, tok.vocab_size, int(rng.integers(3, 41))).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(2, 13)), temperature=0))
    engine.run()
    return trace_of(engine.history)


def test_the_replay_of_a_continuous_run_computes_the_engines_tokens_step_for_step(model, tok, monkeypatch):
    """The continuous run's ceiling replays its steps without an engine; it is evidence only if every step's greedy
    tokens equal what the engine sampled there — and the test fails if the decode batch's length mask is dropped
    (rows of different lengths then read each other's stale or zero keys)."""
    steps = _traced_run(model, tok)
    assert any(len(toks) > 1 and ctx > 0 for st in steps for _, ctx, toks in st.chunks)  # a chunk mid-prompt
    assert any(len(st.chunks) > 1 and len({len(t) for _, _, t in st.chunks}) > 1 for st in steps)  # mixed steps
    laid = slot_steps(steps, 4)
    max_len = max(ctx + len(toks) for st in steps for _, ctx, toks in st.chunks)
    got = replay(model, laid, 4, max_len)
    assert got == [list(st.sampled) for st in steps]
    assert sum(map(len, got)) == sum(len(st.sampled) for st in steps) > 8
    monkeypatch.setattr(_ceiling, "hidden_bias", lambda hidden: None)  # no length mask
    assert replay(model, slot_steps(steps, 4), 4, max_len) != got


def test_slot_steps_give_each_request_the_lowest_free_row_for_its_lifetime(model, tok):
    steps = _traced_run(model, tok)
    laid = slot_steps(steps, 4)
    live: dict[str, int] = {}
    for st, ss in zip(steps, laid, strict=True):
        rows = {}
        t = 0
        for (rid, ctx, toks), _ in zip(st.chunks, st.samples, strict=True):
            if len(toks) == 1 and ctx > 0:
                rows[rid] = int(ss.dec_row[list(ss.dec_tok).index(t)])
            else:
                rows[rid] = next(r for r, start, _, _ in ss.chunks if start == t)
            t += len(toks)
        for rid, row in rows.items():
            if rid in live:
                assert live[rid] == row  # the same row for the request's whole life
            else:
                assert row == min(set(range(4)) - set(live.values()))  # the lowest free row
                live[rid] = row
        assert len(set(live.values())) == len(live)  # never two requests on one row
        for rid in st.finished:
            live.pop(rid)
