"""Reference tier: the engine's greedy outputs == transformers' greedy ``generate`` on the same weights.

The engine batches the prompts, chunks their prefills, pages their K/V and (in the tight-budget case) preempts
and recomputes them; ``transformers`` runs each prompt alone with its own dense cache. The tokens must agree.
Once on a random checkpoint written by transformers (always), once on the bundled model (when it is built).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams

try:
    import torch
    import transformers
except ImportError:  # the autouse fixture below skips every test (per test, so MINIENV_REQUIRE_TIERS sees it)
    torch = transformers = None

pytestmark = pytest.mark.reference
ASSETS = Path(__file__).resolve().parents[2] / "assets"


@pytest.fixture(autouse=True)
def _reference_dependencies():
    for module in ("torch", "transformers", "safetensors"):
        pytest.importorskip(module)


class ByteTokenizer:
    """Enough of a tokenizer for token-id prompts on a random model: ids 0..255 are bytes, no end-of-text."""

    eos_token_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def hf_greedy(hf, prompt_ids: list[int], n: int, eos_token_id=None) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([prompt_ids])
        # an explicit all-ones mask: without it generate() treats every pad_token_id in the prompt as padding
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=eos_token_id)[0].tolist()[len(prompt_ids):]
    if eos_token_id is not None and eos_token_id in out:
        out = out[:out.index(eos_token_id)]  # minienv ends at EOS without emitting it
    return out


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    # Module-scoped fixtures run before the autouse one above, so skip here too when the tier's deps are missing.
    for module in ("torch", "transformers", "safetensors"):
        pytest.importorskip(module)
    path = tmp_path_factory.mktemp("hf_llama")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_engine_greedy_equals_transformers_on_a_random_checkpoint(random_checkpoint, budget):
    hf, path = random_checkpoint
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, int(n)))) for n in (3, 17, 40, 9, 64, 25)]
    n_new = 24
    kv = 4096 if budget == "ample" else 112  # tight: ~25 % of the 432 slots the six need, so it preempts
    engine = InferenceEngine(load_model(path), ByteTokenizer(), kv_budget_tokens=kv, block_size=8, max_num_seqs=4,
                             max_num_batched_tokens=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0))
    if budget == "tight":
        assert engine.stats.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.token_ids) == hf_greedy(hf, p, n_new)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_engine_greedy_equals_transformers_on_the_bundled_models(which):
    from minienv.tokenizer import load_tokenizer

    tok = load_tokenizer()
    hf = transformers.LlamaForCausalLM.from_pretrained(ASSETS / which, dtype=torch.float32).eval()
    prompts = ["ROMEO.\n", "To be, or not to be", "KING.\nWhat news", "\n\nACT II.\n\nScene I."]
    engine = InferenceEngine(load_model(ASSETS / which), tok, kv_budget_tokens=4096, max_num_seqs=4,
                             max_num_batched_tokens=64)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.token_ids) == hf_greedy(hf, tok.encode(p), 32, tok.eos_token_id)
        assert o.text.strip()
