"""Notebook 02's forward-pass picture, drawn by helper code (minienv.viz.diagram) rather than a string in the
lesson: nine boxes labelled with the config's shapes, the per-layer ones bracketed "× layers"."""

from minienv.model import LlamaConfig
from minienv.viz.diagram import forward_pass_svg


def test_forward_pass_svg_labels_the_configs_shapes():
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    svg = forward_pass_svg(cfg)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<rect") == 9 and "× 3 layers" in svg
    for label in ("embedding  [N, 64]", "q[N,4,16]", "k,v[N,2,16]", "[N, 96]", "logits  [N, 300]", "KV cache"):
        assert label in svg, label
