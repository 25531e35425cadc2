"""A persistent KV tier under the paged KV pool: full blocks survive restarts and are shared between instances.

* :mod:`~minienv.kv_tier.record` — the record format (header, token ids, payload, checksum), the model fingerprint
  and the block keys (chain hashes, stable across processes);
* :mod:`~minienv.kv_tier.stores` — where records live: :class:`SQLiteStore` (embedded, the default) and
  :class:`RedisStore` (a server several engines share), both with chain-tail-first LRU eviction;
* :mod:`~minienv.kv_tier.connector` — :class:`KVTierConnector`, the engine's seam (vLLM's KV-connector shape):
  match at admission, load into fresh blocks before the prefill, save committed full blocks.

``InferenceEngine(kv_tier="/path/to/dir")`` or ``kv_tier="redis://127.0.0.1:6379/0"`` (or a store object) turns
it on; ``engine.kv_tier.stats`` holds the counters.
"""

from minienv.kv_tier.connector import KVTierConnector, KVTierStats, TierEvent, TierWarning
from minienv.kv_tier.record import (
    FORMAT_VERSION,
    KV_LAYOUT_VERSION,
    RecordChecksumError,
    RecordError,
    RecordMismatchError,
    RecordVersionError,
    block_keys,
    decode_record,
    encode_record,
    model_fingerprint,
    peek_header,
)
from minienv.kv_tier.stores import PutResult, RedisStore, SQLiteStore, TierBackendError, TierConfigError, open_store

__all__ = [
    "FORMAT_VERSION", "KVTierConnector", "KVTierStats", "KV_LAYOUT_VERSION", "PutResult", "RecordChecksumError",
    "RecordError", "RecordMismatchError", "RecordVersionError", "RedisStore", "SQLiteStore", "TierBackendError",
    "TierConfigError", "TierEvent", "TierWarning", "block_keys", "decode_record", "encode_record",
    "model_fingerprint", "open_store", "peek_header",
]
