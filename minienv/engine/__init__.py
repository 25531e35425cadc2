"""The engine: requests in, one transactional batched step at a time, outputs routed to their consumers.

* :mod:`~minienv.engine.core` — :class:`InferenceEngine`: the step loop and the consumer APIs;
* :mod:`~minienv.engine.validation` — requests in: prompts and sampling parameters checked before queueing;
* :mod:`~minienv.engine.inputs` — a step's model inputs from the scheduler's plan;
* :mod:`~minienv.engine.outputs` — detokenizing, stop checks, :class:`RequestOutput`, per-consumer routing;
* :mod:`~minienv.engine.observe` — stats, step records, snapshots and timelines for dashboards.
"""

from minienv.engine.core import InferenceEngine, required_kv_tokens
from minienv.engine.observe import EngineSnapshot, EngineStats, RequestView, StepRecord, TimelineEntry
from minienv.engine.outputs import IncrementalDetokenizer, RequestOutput
from minienv.kv.errors import KVBudgetError
from minienv.request import InvalidRequestError, RequestNotFoundError, RequestStatus

__all__ = [
    "EngineSnapshot", "EngineStats", "IncrementalDetokenizer", "InferenceEngine", "InvalidRequestError",
    "KVBudgetError", "RequestNotFoundError", "RequestOutput", "RequestStatus", "RequestView", "StepRecord",
    "TimelineEntry", "required_kv_tokens",
]
