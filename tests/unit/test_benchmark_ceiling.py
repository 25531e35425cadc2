"""The ceiling ``bench_engine.py`` part 3 and ``profile_engine.py --run ceiling`` measure the engine against
(``benchmarks/_ceiling.py``): a bare batched loop over the model with dense caches.

A ceiling is only evidence if it computes what the engine computes: its greedy tokens must equal the engine's
(and each request's tokens generated alone), whatever the mix of prompt lengths — otherwise a faster ceiling could
simply be doing less. And the profile split must count its samples and file them where the engine's go.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _ceiling import DenseBatchDecode, bare_greedy  # noqa: E402
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


def test_profile_split_counts_the_bare_loop_and_files_its_attention_under_attention(tmp_path):
    frames = "<module> (profile_engine.py:1);run (profile_engine.py:2);bare_greedy (_ceiling.py:72);" \
             "LlamaModel.forward_step (minienv/model/llama.py:308);"
    raw = tmp_path / "run.raw"
    raw.write_text(f"{frames}DenseBatchDecode.attend (_ceiling.py:60);memcpy (libc.so.6) 3\n"
                   f"{frames}sgemm_kernel (libscipy_openblas64_.so) 5\n"
                   "<module> (profile_engine.py:1);load_model (minienv/model/llama.py:328) 7\n")
    result = split(raw)
    assert result["samples"] == 8  # model loading is not counted
    assert result["blas_percent"] == 62.5
    assert classify(frames + "DenseBatchDecode.attend (_ceiling.py:60);memcpy") == \
        "attention: other (gather, softmax, masks)"


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
