"""Speculative decoding: propose ``k`` tokens cheaply, verify them in one target call, keep the target's output.

* :mod:`~minienv.spec_decode.rejection` — the verification rule (greedy, and rejection sampling that preserves the
  target's distribution exactly);
* :mod:`~minienv.spec_decode.ngram` — prompt-lookup proposals (no model);
* :mod:`~minienv.spec_decode.draft` — a draft model with its own paged KV cache;
* :mod:`~minienv.spec_decode.speculator` — the engine's side: configuration, proposing for the running batch,
  verifying each request's rows, and the acceptance counters.
"""

from minienv.spec_decode.speculator import SpecDecodingStats, SpeculativeConfig, Speculator

__all__ = ["SpecDecodingStats", "SpeculativeConfig", "Speculator"]
