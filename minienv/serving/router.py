"""Prefix-aware routing: send requests that share a prompt prefix to the same engine instance.

Behind a round-robin balancer, each of N instances sees 1/N of the requests of every system prompt, so each must
compute (and keep) every system prompt's K/V itself: the same prefix is prefilled up to N times and each prefix
cache holds N times less of what matters. Routing by prefix makes every shared prefix live on one instance.

The key is the one the prefix cache itself uses: the chain hash (:func:`minienv.kv.hashing.hash_block_chain`) of
the prompt's first ``prefix_blocks`` *full* blocks, at the servers' block size. Two prompts get the same key
exactly when they agree on those tokens — exactly when they could share those cached blocks. The key picks the
instance by *rendezvous hashing*: every instance gets the score ``sha256(key | address)`` and the highest wins.
Unlike ``key mod N``, adding or removing an instance moves only the prefixes that the change must move.

Affinity must not beat load: a popular prefix would pile onto one instance while the others idle. So the choice
gives way when its instance is *overloaded* — at least ``overload_min`` calls in flight and more than
``overload_factor`` times the mean of the other instances — to the least-loaded instance (SGLang's router balances its
cache-aware policy the same way: affinity while the load is even, shortest queue when it is not). The load is
the client's own count of calls in flight per instance: no extra RPC on the request path. A prompt with no full
block has no prefix to share and goes to the least-loaded instance.

:meth:`PrefixRouter.rank` returns every instance in order of preference; the client tries the first and moves
down the list when an instance is ``UNAVAILABLE`` before it has sent anything. Instances the client has *ejected*
(they refused a call recently: ``Client.ejected``) move to the end of the ranking, in their order, so a dead
instance costs one refused call, not one per request; they stay in it, so nothing is lost if it was the others
that failed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from minienv.kv.hashing import BlockHash, hash_block_chain


def rendezvous_order(key: bytes, addresses: Sequence[str]) -> list[str]:
    """``addresses`` from the highest score ``sha256(key | address)`` to the lowest (deterministic, any process)."""
    return sorted(addresses, key=lambda a: hashlib.sha256(key + b"|" + a.encode("utf-8")).digest(), reverse=True)


@dataclass
class PrefixRouter:
    """Rank instances for a prompt: the prefix's rendezvous choice first, unless it is overloaded.

    Args:
        prefix_blocks: how many leading full blocks make the key. More blocks separate system prompts that begin
            alike; a prompt whose shared part is shorter than ``prefix_blocks`` blocks still routes by the full
            blocks it has, which then include its own suffix (so keep it no longer than the shared prompts).
        overload_factor, overload_min: the chosen instance is overloaded when its calls in flight are
            ``>= overload_min`` and ``> overload_factor *`` the other instances' mean (one instance: never). Set
            ``overload_min`` near the servers' ``max_num_seqs`` (16 by default): up to that many, an instance
            batches every request at once, and moving one away only loses its cache hit.
        tokenizer: encodes text prompts for the key (default: the bundled tokenizer, loaded on first use); it
            must be the servers' tokenizer, or the key names other blocks than the servers cache.
        block_size: the servers' block size (default: read once from the first instance's server info).
    """

    prefix_blocks: int = 2
    overload_factor: float = 2.0
    overload_min: int = 16
    tokenizer: Any = None
    block_size: int | None = None
    decisions: Counter = field(default_factory=Counter)  # "prefix" / "overloaded" / "no_full_block" / "ejected"
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _rotation: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.prefix_blocks, bool) or not isinstance(self.prefix_blocks, int) or self.prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be an int >= 1, got {self.prefix_blocks!r}")
        if not self.overload_factor >= 1.0:
            raise ValueError(f"overload_factor must be >= 1 (a multiple of the mean load), got {self.overload_factor}")
        if isinstance(self.overload_min, bool) or not isinstance(self.overload_min, int) or self.overload_min < 1:
            raise ValueError(f"overload_min must be an int >= 1, got {self.overload_min!r}")

    def prefix_key(self, token_ids: Sequence[int]) -> BlockHash | None:
        """The chain hash of the first ``min(prefix_blocks, full blocks)`` blocks; None without a full block."""
        assert self.block_size is not None
        chain = hash_block_chain(list(token_ids), self.block_size, max_blocks=self.prefix_blocks)
        return chain[-1] if chain else None

    @staticmethod
    def _read_block_size(client: Any) -> int:
        """The servers' block size, from the first instance that answers (all serve the same engine options)."""
        from minienv.serving.types import ServingError

        last: ServingError | None = None
        for a in client.addresses:
            try:
                return int(client.server_info(a).block_size)
            except ServingError as exc:
                last = exc
        assert last is not None
        raise last

    def rank(self, client: Any, prompt: str | Sequence[int]) -> list[str]:
        """Every address of ``client``, best first, for ``prompt`` (text or token ids); the client's ejected
        addresses last (``decisions["ejected"]`` counts the rankings whose first choice was one of them)."""
        order = self._rank(client, prompt)
        ejected = getattr(client, "ejected", set())
        if ejected and order[0] in ejected:
            self.decisions["ejected"] += 1
        return [a for a in order if a not in ejected] + [a for a in order if a in ejected]

    def _rank(self, client: Any, prompt: str | Sequence[int]) -> list[str]:
        addresses = list(client.addresses)
        if self.block_size is None:
            self.block_size = self._read_block_size(client)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from minienv.tokenizer import load_tokenizer

                self.tokenizer = load_tokenizer()
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        load = client.in_flight
        key = self.prefix_key(ids)
        with self._lock:
            self._rotation += 1
            rotation = self._rotation
        # Least loaded first; ties rotate so that idle instances share short prompts.
        by_load = sorted(addresses, key=lambda a: (load[a], (addresses.index(a) - rotation) % len(addresses)))
        if key is None:
            self.decisions["no_full_block"] += 1
            return by_load
        order = rendezvous_order(key, addresses)
        chosen = order[0]
        others = [load[a] for a in addresses if a != chosen]
        others_mean = sum(others) / len(others) if others else float("inf")
        if load[chosen] >= self.overload_min and load[chosen] > self.overload_factor * others_mean:
            self.decisions["overloaded"] += 1
            return [by_load[0]] + [a for a in order if a != by_load[0]]
        self.decisions["prefix"] += 1
        return order
