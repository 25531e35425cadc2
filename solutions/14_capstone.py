"""Reference solution for notebook 14 (the capstone): a KV cache manager written from scratch against the contract
the notebook states — it subclasses nothing and imports only the chain hash.

Data structures: a refcount per block, an ``OrderedDict`` free queue (head = least recently freed, O(1) removal
of a prefix hit), ``hash -> block`` and ``block -> hash`` maps for the prefix index, and per request its block
table and the chain hashes of its committed full blocks (so commit continues the chain where it stopped). The
request's tokens and progress are NOT kept here: the caller's request object owns them (``all_token_ids``,
``num_computed_tokens``) and every call reads them as they are now, as vLLM's manager reads its ``Request``.

It hashes and takes head blocks inline, so that it stands alone; in the notebook the skeleton's ``block_keys``
(your notebook-05 ``chain_hashes``) and ``take_from_head`` (your notebook-06 ``safe_victims``) do the same jobs.
"""

from __future__ import annotations

from collections import OrderedDict

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


class MyKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, enable_prefix_caching
        self.refs = [0] * num_blocks
        self.free_q: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.tables: dict[object, list[int]] = {}
        self.hashes: dict[object, list[bytes]] = {}  # request id -> chain hashes of its committed full blocks

    # -- the prefix index
    def lookup(self, token_ids: list[int]) -> list[int]:
        if not self.caching:
            return []
        B, parent, hit = self.block_size, ROOT_HASH, []
        for j in range((len(token_ids) - 1) // B):  # never the last token: it must be computed for its logits
            parent = hash_block_tokens(parent, token_ids[j * B:(j + 1) * B])
            if parent not in self.by_hash:
                break  # the first miss ends the hit: a later block's K/V depend on this one
            hit.append(self.by_hash[parent])
        return hit

    # -- allocation (the LRU evictor lives in _take)
    def _take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            bid, _ = self.free_q.popitem(last=False)  # head: least recently freed
            h = self.hash_of.pop(bid, None)
            if h is not None:
                del self.by_hash[h]  # eviction happens here, in the call that reuses the block
            self.refs[bid] = 1
            out.append(bid)
        return out

    def allocate(self, request, num_new_tokens: int) -> int | None:
        B = self.block_size
        hit = self.lookup(request.all_token_ids)
        need = -(-(len(hit) * B + num_new_tokens) // B) - len(hit)
        hit_free = sum(1 for b in hit if self.refs[b] == 0)  # taking these removes them from the free queue
        if need + hit_free > len(self.free_q):
            return None
        for b in hit:  # take the hit first, so the allocation below cannot evict it
            if self.refs[b] == 0:
                del self.free_q[b]
            self.refs[b] += 1
        self.tables[request.request_id] = hit + self._take(need)
        self.hashes[request.request_id] = [self.hash_of[b] for b in hit]
        return len(hit) * B

    def append_slots(self, request, num_new_tokens: int) -> bool:
        table = self.tables[request.request_id]
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if need > len(self.free_q):
            return False
        table.extend(self._take(max(need, 0)))
        return True

    def commit(self, request) -> None:
        if not self.caching:
            return
        B, rid = self.block_size, request.request_id
        table, hashes, toks = self.tables[rid], self.hashes[rid], request.all_token_ids
        for j in range(len(hashes), request.num_computed_tokens // B):  # computed tokens only: their K/V exist
            h = hash_block_tokens(hashes[-1] if hashes else ROOT_HASH, toks[j * B:(j + 1) * B])
            hashes.append(h)
            if h not in self.by_hash and table[j] not in self.hash_of:  # one block per hash: a twin stays private
                self.by_hash[h], self.hash_of[table[j]] = table[j], h

    def free(self, request_id) -> None:
        for b in reversed(self.tables.pop(request_id)):  # last block first: the tail of a prefix is evicted first
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_q[b] = None  # tail of the queue: most recently freed
        del self.hashes[request_id]

    # -- observers
    def block_table(self, request_id) -> list[int]:
        return list(self.tables[request_id])

    def ref_cnt(self, block_id: int) -> int:
        return self.refs[block_id]

    def free_queue(self) -> list[int]:
        return list(self.free_q)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.hash_of
