"""Prompt-lookup speculation: if the last few tokens appeared before, guess that what followed then follows now.

No model, no probabilities: :meth:`NgramProposer.propose` looks for the most recent earlier occurrence of the
sequence's last ``n`` tokens (trying the longest ``n`` from ``max_n`` down to ``min_n``) and proposes the ``k``
tokens that followed it. It shines where the output copies the input (editing, summarising with quotes, code),
and costs nothing when it finds no match (no proposal: a plain decode step). Verification treats its guesses as
drawn from a one-hot ``q``, so the output distribution is still exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Propose up to ``k`` tokens by matching the longest recent n-gram, ``min_n <= n <= max_n``."""

    k: int
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        for name in ("k", "min_n", "max_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"NgramProposer: {name} must be an int >= 1, got {value!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"NgramProposer: min_n ({self.min_n}) must be <= max_n ({self.max_n})")

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``self.k``) tokens that followed the latest earlier match of the suffix; [] if none.

        A match must end before the last token, so that at least one token follows it (it may overlap the suffix).
        Among matches of the longest ``n``, the most recent wins.
        """
        k = self.k if k is None else k
        ids = np.asarray(token_ids, dtype=np.int64)
        t = len(ids)
        for n in range(min(self.max_n, t - 1), self.min_n - 1, -1):
            suffix = ids[t - n:]
            # windows starting at 0 … t - n - 1 (the window at t - n is the suffix itself)
            windows = np.lib.stride_tricks.sliding_window_view(ids[:t - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
