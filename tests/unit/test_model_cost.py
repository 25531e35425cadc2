"""The deterministic generation cost model used by notebook 02."""

from __future__ import annotations

import pytest

from minienv.model import LlamaConfig
from minienv.model.cost import attention_flops, generation_cost, lm_head_flops, linear_flops_per_token

CFG = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, max_position_embeddings=64)


def test_linear_flops_are_twice_the_layer_weights():
    layer_weights = (CFG.num_parameters() - CFG.vocab_size * CFG.hidden_size * 2 - CFG.hidden_size) \
        // CFG.num_hidden_layers - 2 * CFG.hidden_size
    assert linear_flops_per_token(CFG) == 2 * layer_weights * CFG.num_hidden_layers


def test_token_rows_and_calls():
    cached = generation_cost(CFG, prompt_len=5, new_tokens=4, use_cache=True)
    naive = generation_cost(CFG, prompt_len=5, new_tokens=4, use_cache=False)
    assert (cached.forward_calls, cached.tokens_processed) == (4, 5 + 3)
    assert (naive.forward_calls, naive.tokens_processed) == (4, 5 + 6 + 7 + 8)
    # one new token: both loops do the same single forward, except the LM head rows
    one_c = generation_cost(CFG, 3, 1, True)
    one_n = generation_cost(CFG, 3, 1, False)
    assert one_n.flops - one_c.flops == 2 * lm_head_flops(CFG)


def test_ratio_grows_with_length():
    r = [generation_cost(CFG, 4, n, False).flops / generation_cost(CFG, 4, n, True).flops for n in (8, 16, 32)]
    assert r[0] < r[1] < r[2]
    assert attention_flops(CFG, 10) == 2 * attention_flops(CFG, 5)


def test_rejects_empty():
    with pytest.raises(ValueError):
        generation_cost(CFG, 0, 4, True)
