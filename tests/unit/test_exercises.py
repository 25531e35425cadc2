"""Every exercise check, three ways: the reference solution passes, each wrong answer fails naming the rule it
breaks, and the stub the notebook ships says "not implemented yet" (without raising).

The wrong answers are the mistakes a student is likely to make, at least one per rule the exercise states;
``WRONG`` pairs each with the words its failure message must contain.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from minienv.exercises import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises import block_size as ex13
from minienv.exercises import persistent_kv as ex11
from minienv.exercises import engine as ex08
from minienv.exercises import metrics as ex09
from minienv.exercises import kv_memory as ex03
from minienv.exercises import lru_eviction as ex06
from minienv.exercises import model as ex02
from minienv.exercises import paged_attention as ex04
from minienv.exercises import prefix_sharing as ex05
from minienv.exercises import at_scale as ex16
from minienv.exercises import real_model as ex15
from minienv.exercises import scheduling as ex07
from minienv.exercises import serving as ex10
from minienv.exercises import tokenizer as ex01
from minienv.exercises import tour as ex00
from minienv.exercises import speculative_decoding as ex12
from minienv.kv import OutOfBlocksError
from minienv.kv.hashing import ROOT_HASH, hash_block_chain, hash_block_tokens
from kv_driver import admit, append, child, compute

REPO = Path(__file__).resolve().parents[2]


def _solutions(name: str):
    spec = importlib.util.spec_from_file_location(f"solutions_{name}", REPO / "solutions" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ceilings(first_exponent=0, cap=True, growth="exp", extra=0):
    def fn(max_attempts, initial, mult, max_backoff):
        out = []
        for n in range(1, max_attempts + extra):
            c = initial * mult ** (n - 1 + first_exponent) if growth == "exp" else initial * n
            out.append(min(c, max_backoff) if cap else c)
        return out
    return fn


def _key(prompt, block_size, blocks=1, whole=False):
    """The prefix key a (possibly wrong) router hashes: the first ``blocks`` full blocks, or the whole prompt."""
    if whole:
        return hash_block_tokens(ROOT_HASH, list(prompt))
    return hash_block_chain(list(prompt), block_size, max_blocks=blocks)[-1]


def _hrw(key, names, score="both"):
    def rank(name):
        data = {"both": key + name.encode(), "name only": name.encode(), "key only": key}[score]
        return hashlib.sha256(data).digest()
    return max(names, key=rank)


def _ring(key, names):  # consistent hashing with one point per instance (no virtual nodes)
    points = sorted((hashlib.sha256(n.encode()).digest(), n) for n in names)
    at = bisect.bisect(points, (key, ""))
    return points[at % len(points)][1]


def _pick(home="hrw", blocks=1, whole=False, score="both", fallback="least", ties="name", home_wins_tie=True,
          strict=False, short="least", short_ties="name", exact_is_short=False, answer="name", mutate=False):
    """A router by the exercise's rules with one of them changed (the keywords name what changes)."""
    def fn(prompt, loads, block_size, max_load):
        names = list(loads)
        by_tie = {"name": lambda a: a, "largest name": lambda a: tuple(-ord(c) for c in a),
                  "dict order": names.index}[ties]
        if len(prompt) < block_size or (exact_is_short and len(prompt) == block_size):
            if short == "hash":
                chosen = _hrw(hash_block_tokens(ROOT_HASH, list(prompt)), names)
            elif short == "chain":
                chosen = _hrw(hash_block_chain(list(prompt), block_size)[0], names)  # IndexError: no full block
            else:
                tie = (lambda a: a) if short_ties == "name" else names.index
                chosen = min(names, key=lambda a: (loads[a], tie(a)))
        else:
            key = _key(prompt, block_size, blocks, whole)
            ordered = sorted(names)
            h = {"hrw": lambda: _hrw(key, names, score), "ring": lambda: _ring(key, names),
                 "mod sorted": lambda: ordered[int.from_bytes(key[:8], "big") % len(names)],
                 "mod order": lambda: names[int.from_bytes(key[:8], "big") % len(names)]}[home]()
            over = loads[h] > max_load if strict else loads[h] >= max_load
            if not over or fallback == "none":
                chosen = h
            elif fallback == "next":
                chosen = ordered[(ordered.index(h) + 1) % len(ordered)]  # the neighbour, whatever its load
            elif fallback == "first":
                chosen = next(a for a in names if a != h) if len(names) > 1 else h
            elif fallback == "others":  # the least loaded of the others, even when the home is less loaded
                chosen = min((a for a in names if a != h), key=lambda a: (loads[a], by_tie(a)))
            elif fallback == "compare":  # the best other, if it is less loaded: fails with no other instance
                best = min((a for a in names if a != h), key=lambda a: (loads[a], by_tie(a)))
                chosen = best if loads[best] < loads[h] else h
            elif fallback == "home if least":  # below max_load too: the home only when it is the least loaded
                chosen = min(names, key=lambda a: (loads[a], a != h, by_tie(a)))
            else:
                chosen = min(names, key=lambda a: (loads[a], (a != h) if home_wins_tie else 0, by_tie(a)))
            if fallback == "home if least" and not over:
                chosen = min(names, key=lambda a: (loads[a], a != h, by_tie(a)))
        if mutate:
            loads[chosen] += 1  # counts the request in: the caller's dict changes
        return names.index(chosen) if answer == "index" else chosen
    return fn


def merge_pair(seq, pair, new_id):
    return _solutions("01_tokenizer").merge_pair(seq, pair, new_id)


def _weighted(words):
    counts = Counter()
    for w, c in words.items():
        for p in zip(w, w[1:]):
            counts[p] += c
    return counts


def _release_forward(pool, req):
    for block in pool.tables.pop(req):  # head of the table first
        pool.refcount[block] -= 1
        if pool.refcount[block] == 0:
            pool.free[block] = None


def _release_ignoring_refcount(pool, req):
    for block in reversed(pool.tables.pop(req)):
        pool.refcount[block] = max(0, pool.refcount[block] - 1)
        pool.free[block] = None


def _release_zeroes_refcount(pool, req):
    for block in reversed(pool.tables.pop(req)):
        pool.refcount[block] = 0  # drops every holder's reference, not just this request's
        if block not in pool.free:
            pool.free[block] = None


def _release_keeps_table(pool, req):
    for block in reversed(pool.tables[req]):
        pool.refcount[block] -= 1
        if pool.refcount[block] == 0:
            pool.free[block] = None


def _release_to_head(pool, req):
    for block in reversed(pool.tables.pop(req)):
        pool.refcount[block] -= 1
        if pool.refcount[block] == 0:
            pool.free[block] = None
            pool.free.move_to_end(block, last=False)


def _nonoverlapping_pairs(word):
    """Pairs counted the way a careless student does: step 2 after a repeat, so (7, 7, 7) holds (7, 7) once."""
    i, out = 0, []
    while i < len(word) - 1:
        out.append((word[i], word[i + 1]))
        i += 2 if word[i] == word[i + 1] else 1
    return out


def _merge_step_with(pick=None, new_id=None, merge=None, nothing=None, mutate=False, weighted=True,
                     overlapping=True, singletons=True, distinct=False, keep_counts=True, floor_then_add=False):
    def fn(words):
        pairs = (lambda w: list(zip(w, w[1:]))) if overlapping else _nonoverlapping_pairs
        counts = Counter()
        for w, c in words.items():
            for p in (set(pairs(w)) if distinct else pairs(w)):  # distinct: a pair counted once per word
                counts[p] += c if weighted else 1
        if not counts:
            if nothing == "raise":
                return max(max(w) for w in words)  # no guard: max() of nothing raises on {}
            return nothing
        pair = (pick or (lambda c: min(c, key=lambda p: (-c[p], p))))(counts)
        top = max(max(w) for w in words if w and (singletons or len(w) > 1))
        nid = new_id if new_id is not None else (max(256, top) + 1 if floor_then_add else max(256, top + 1))
        out = {tuple((merge or merge_pair)(list(w), pair, nid)): (c if keep_counts else 1) for w, c in words.items()}
        if mutate:
            words.clear()
        return pair, nid, out
    return fn


def _merge_right_to_left(seq, pair, new_id):
    return merge_pair(seq[::-1], pair[::-1], new_id)[::-1]


def _merge_first_only(seq, pair, new_id):
    for i in range(len(seq) - 1):
        if (seq[i], seq[i + 1]) == pair:
            return seq[:i] + [new_id] + seq[i + 2:]
    return seq


def _encode_with(offset=256, guard=True):
    """``encode_word`` with one planted mistake: merge ``i`` made into id ``offset + i``, or no stop on an empty
    list of pairs (``min()`` of nothing raises)."""
    def fn(word, merges):
        rank = {p: i for i, p in enumerate(merges)}
        ids = list(word)
        while True:
            pairs = [p for p in zip(ids, ids[1:]) if p in rank]
            if guard and not pairs:
                return ids
            best = min(pairs, key=rank.__getitem__)
            ids = merge_pair(ids, best, offset + rank[best])
    return fn


def _encode_leftmost(word, merges):
    rank = {p: i for i, p in enumerate(merges)}
    ids = list(word)
    while True:
        for i, p in enumerate(zip(ids, ids[1:])):
            if p in rank:
                ids = ids[:i] + [256 + rank[p]] + ids[i + 2:]
                break
        else:
            return ids


def _encode_one_merge(word, merges):
    rank = {p: i for i, p in enumerate(merges)}
    ids = list(word)
    pairs = [p for p in zip(ids, ids[1:]) if p in rank]
    if pairs:
        best = min(pairs, key=rank.__getitem__)
        ids = merge_pair(ids, best, 256 + rank[best])
    return ids


def _encode_right_to_left(word, merges):
    rank = {pair: i for i, pair in enumerate(merges)}
    ids = list(word)
    while len(ids) > 1:
        pairs = [p for p in zip(ids, ids[1:]) if p in rank]
        if not pairs:
            break
        best = min(pairs, key=rank.__getitem__)
        ids = _merge_right_to_left(ids, best, 256 + rank[best])
    return ids


def _fewest_then_largest_id(c):
    least = min(r.num_computed_tokens for r in c)
    return max((r for r in c if r.num_computed_tokens == least), key=lambda r: r.request_id)


def _fewest_latest_by_id_order(c):
    return min(sorted(c, key=lambda r: r.request_id, reverse=True), key=lambda r: r.num_computed_tokens)


def _latency_with(first_step=1, first_token="output", from_arrival=True, e2e="finished", key="id"):
    """``latency_in_steps`` with one planted mistake (the defaults are the right rule)."""
    def fn(arrivals, step_outputs):
        first, done, count = {}, {}, Counter()
        for step, outputs in enumerate(step_outputs, start=first_step):
            for out in outputs:
                rid = out.request_id
                first.setdefault(rid, step)
                count[rid] += 1
                if out.finished:
                    done[rid] = step
        got = {}
        for rid, arrived in arrivals.items():
            start = arrived if from_arrival else 0
            t = arrived + 1 if first_token != "output" else first[rid]
            end = (first[rid] + count[rid] - 1) if e2e == "outputs" else done[rid]
            got[rid] = (t - start, end - start)
        if key == "first seen":  # results listed as requests first produced a token, zipped with the arrivals
            return dict(zip(arrivals, [got[rid] for rid in first], strict=True))
        return got
    return fn


def _newest_tail(records):
    parents = {p for _, p, _ in records}
    return max((t, k) for k, _, t in records if k not in parents)[1]


def _oldest_tail_by_key(records):  # ignores the access times: the smallest key among the tails
    parents = {p for _, p, _ in records}
    return min(k for k, _, _ in records if k not in parents)


def _frag(lengths, b, steps="every", combine="sums"):
    """``predict_fragmentation`` with one planted mistake (the defaults are the right rule)."""
    wasted = allocated = 0
    ratios = []
    for p, o in lengths:
        span = {"every": range(p, p + o), "final": [p + o], "one too many": range(p, p + o + 1),
                "one too few": range(p + 1, p + o)}[steps]
        for n in span:
            slots = -(-n // b) * b
            wasted, allocated = wasted + slots - n, allocated + slots
            ratios.append((slots - n) / slots)
    return wasted / allocated if combine == "sums" else sum(ratios) / len(ratios)


def _frag_rule_of_thumb(lengths, b):  # notebook 03's (B - 1) / 2 per request over the mean length
    mean = sum(p + o / 2 for p, o in lengths) / len(lengths)
    return min(0.99, (b - 1) / 2 / mean)


def _run_with_output(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: engine.output(rid).text for rid in ids}


def _encode_first_occurrence(word, merges):
    ids = list(word)
    for i, pair in enumerate(merges):
        ids = _merge_first_only(ids, pair, 256 + i)
    return ids


def _softmax_attend(q, K, V, scale=True, stable=True):
    s = K @ q / (np.sqrt(q.shape[-1]) if scale else 1.0)
    w = np.exp(s - s.max()) if stable else np.exp(s)
    return (w / w.sum()) @ V


def _in_window(attend, first=False, offset=0, exclude_own=False, from_start=False):
    """``decode_attention(q, K, V, window)`` from a window-less ``attend(q, K, V)``, with one planted mistake."""
    def fn(q, K, V, window):
        if window is not None:
            w = window + offset
            if first:  # the first `window` tokens instead of the last
                K, V = K[:w], V[:w]
            elif exclude_own:  # the window ends before the query's own token
                K, V = K[-w - 1:-1], V[-w - 1:-1]
            elif from_start:  # K[t - window:]: a negative start when the window is longer than the cache
                K, V = K[len(K) - w:], V[len(V) - w:]
            else:
                K, V = K[-w:], V[-w:]
        return attend(q, K, V)
    return fn


def _weights_only(q, K, V):
    s = K @ q / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max())
    return w / w.sum()


def _rand_mgr_gather(k_layer, table, n):
    return np.take(k_layer, table, axis=0).reshape(-1, *k_layer.shape[2:])[:n]


def _kv_context(n, layers, heads, d, b, window, every, keep=min, globals_=lambda L, g: L // g):
    num_global = layers if window is None else globals_(layers, every)
    local = n if window is None else keep(n, window)
    return 2 * heads * d * b * (num_global * n + (layers - num_global) * local)


def _token_loop(k_layer, table, start, stop):
    bs = k_layer.shape[1]
    return np.array([k_layer[table[i // bs], i % bs] for i in range(start, stop)]).reshape(-1, *k_layer.shape[2:])


def _range_gather(k_layer, table, start, stop, offset=True, cut=True, last_floor=False):
    bs = k_layer.shape[1]
    first, last = start // bs, (stop // bs if last_floor else -(-stop // bs))
    rows = np.take(k_layer, table[first:last], axis=0).reshape(-1, *k_layer.shape[2:])
    off = start - first * bs if offset else 0
    return rows[off:off + stop - start] if cut else rows[off:]


def _chain_own_tokens(tokens, bs):
    return [hash_block_tokens(ROOT_HASH, tokens[j * bs:(j + 1) * bs]) for j in range(len(tokens) // bs)]


def _chain_with_partial(tokens, bs):
    hashes, parent = [], ROOT_HASH
    for j in range(-(-len(tokens) // bs)):
        parent = hash_block_tokens(parent, tokens[j * bs:(j + 1) * bs])
        hashes.append(parent)
    return hashes


def _chain_wrong_root(tokens, bs):
    hashes, parent = [], b"\x01" * 32
    for j in range(len(tokens) // bs):
        parent = hash_block_tokens(parent, tokens[j * bs:(j + 1) * bs])
        hashes.append(parent)
    return hashes


def _append_with(copy_when="partial_shared", names_copy=True, original="minus_one", copy_ref="one", new_ref=1,
                 copy_first=True, pick="head", new_count="right", room="right", mutate=False, shape="triple"):
    """``my_append_slots`` with one planted mistake (the defaults are the right rules)."""
    def fn(table, ref_cnt, n, k, b, free):
        last = table[-1] if table else None
        shared = last is not None and ref_cnt[last] > 1
        copy = {"partial_shared": n % b != 0 and shared, "shared_last": shared, "never": False,
                "partial": n % b != 0 and last is not None, "after_fill": (n + k) % b != 0 and shared,
                "all_shared": n % b != 0 and shared}[copy_when]
        new = {"right": -(-(n + k) // b) - -(-n // b), "k": -(-k // b), "floor": (n + k) // b - n // b,
               "ceil_floor": -(-(n + k) // b) - n // b}[new_count]
        need = copy + new
        if room == "right" and need > len(free):
            return None
        if room == "ignore_copy" and new > len(free):
            return None
        if room == "ge" and need >= len(free) and need:
            return None
        if room == "need_one" and not free:
            return None
        if room == "peek":
            free[0]  # noqa: B018 - looks at the head before asking whether a block is needed at all
        queue = {"head": list(free), "tail": list(free)[::-1], "sorted": sorted(free)}[pick]
        if mutate:
            t, r = table, ref_cnt
        else:
            t, r = list(table), list(ref_cnt)
        copies = []
        blocks = [queue.pop(0) for _ in range(need)]  # raises IndexError when the queue runs out (room="never")
        if copy_first:
            private, fresh = (blocks[0] if copy else None), blocks[copy:]
        else:
            private, fresh = (blocks[-1] if copy else None), blocks[:new]
        if copy:
            srcs = [x for x in t if r[x] > 1] if copy_when == "all_shared" else [last]
            for i, src in enumerate(srcs):
                dst = private if i == 0 else blocks[0]
                copies.append((src, dst))
            if names_copy:
                t[-1] = private
            r[private] = r[last] if copy_ref == "inherit" else 1
            r[last] = {"minus_one": r[last] - 1, "same": r[last], "zero": 0}[original]
        for x in fresh:
            t.append(x)
            r[x] = new_ref
        return (t, copies) if shape == "pair" else (t, r, copies)
    return fn


def _safe_victims_mutating(lru_order, refcount, n):
    victims = [b for b in lru_order if refcount[b] == 0][:n]
    if len(victims) < n:
        raise OutOfBlocksError(n, len(victims), len(lru_order))
    for b in victims:
        lru_order.remove(b)
    return victims


def _plan_greedy(needs, budget):
    out = []
    for n in needs:
        k = min(n, budget)
        out.append(k)
        budget -= k
    return out


def _plan_prefills_reversed(needs, budget):
    out = [1 if n == 1 else 0 for n in needs]
    budget -= sum(out)
    for i in reversed(range(len(needs))):
        if needs[i] > 1:
            out[i] = max(0, min(needs[i], budget))
            budget -= out[i]
    return out


def _plan_no_need_cap(needs, budget):
    decodes = sum(1 for n in needs if n == 1)
    out, left = [], budget - decodes
    for n in needs:
        if n == 1:
            out.append(1)
        else:
            out.append(max(0, left))
            left = 0
    return out


def _run_fixed_steps(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    texts = {rid: "" for rid in ids}
    for _ in range(3):
        for out in engine.step():
            texts[out.request_id] += out.delta_text
    return texts


def _run_last_delta(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    texts = {rid: "" for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = out.delta_text
    return texts


def _run_keyed_by_index(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    texts = {i: "" for i in range(len(ids))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[ids.index(out.request_id)] += out.delta_text
    return texts


def _cost_with(length="final", exact_full_wastes=False, hit="floor", cap=True, entries="blocks", combine=sum):
    """``block_size_cost`` with one planted mistake (the defaults are the right rule)."""
    def fn(requests, b, entry_cost):
        costs = []
        for p, o, s in requests:
            n = p + o if length == "final" else p
            blocks = -(-n // b)
            empty = b - n % b if exact_full_wastes else blocks * b - n
            usable = min(s, p - 1) if cap else s
            hits = {"floor": usable // b * b, "ceil": -(-usable // b) * b, "all": s}[hit]
            table = {"blocks": blocks, "request": 1, "none": 0}[entries]
            costs.append(empty + (s - hits) + entry_cost * table)
        return combine(costs)
    return fn


def _load_with(keys="tier", stop=True, cap_last=True, local="subtract", unit="tokens"):
    """``num_tokens_to_load`` with one planted mistake (the defaults are the right rule)."""
    from minienv.kv_tier import block_keys

    def fn(prompt, num_local, verified, b, fp):
        n_blocks = (len(prompt) - 1) // b if cap_last else len(prompt) // b
        if keys == "tier":
            ks = block_keys(prompt[:n_blocks * b], b, fp)
        elif keys == "local":  # notebook 05's keys: no fingerprint
            ks = hash_block_chain(prompt[:n_blocks * b], b)
        else:  # each block keyed alone, not chained
            ks = [block_keys(prompt[j * b:(j + 1) * b], b, fp)[0] for j in range(n_blocks)]
        run = 0
        for k in ks:
            if k in verified:
                run += 1
            elif stop:
                break
        tokens = run * b if unit == "tokens" else run
        if local == "ignore":
            return tokens
        return tokens - num_local if local == "raw" else max(0, tokens - num_local)
    return fn


def _quantile(lower_of="previous", off_scale="largest finite", position="in bucket", q1_off_scale=False):
    """PromQL's histogram_quantile with one classic slip (notebook 09)."""
    def fn(q, buckets):
        total = buckets[-1][1]
        if total == 0:
            return float("nan")
        if q1_off_scale and q == 1:  # "q = 1 is the maximum, off the scale"
            return max(le for le, _ in buckets if le != float("inf"))
        rank, lower, below, last_seen = q * total, 0.0, 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                if le == float("inf"):
                    return last_seen if off_scale == "last non-empty" else lower
                at = rank / count if position == "cumulative" else (rank - below) / (count - below)
                start = last_seen if lower_of == "last non-empty" else lower
                return start + (le - start) * at
            if count > below:
                last_seen = le
            lower, below = le, count
        return float("nan")
    return fn


def _increase(reset="previous", first_pair=True):
    """A counter's increase with one classic slip (notebook 09)."""
    def fn(samples):
        if len(samples) < 2:
            return None
        values = [v for _, v in samples]
        total, high = 0.0, values[0]
        for i, (before, after) in enumerate(zip(values, values[1:])):
            if i == 0 and not first_pair:  # "the first pair is the baseline": a drop there is lost
                total += max(0.0, after - before)
                continue
            ref = {"previous": before, "first": values[0], "max so far": high}[reset]
            total += after if after < ref else after - before
            high = max(high, after)
        return total
    return fn


# notebook 15: conversations per budget with a shared system prompt, and the hits it earns
def _ceil(a, b):
    return -(-a // b)


def _fit(shared="full", own="ceil", zero=True, whole=True, room=True):
    """conversations_that_fit with one rule broken: ``shared`` full / none / ceil / round blocks; ``own`` ceil (whole
    blocks) / floor (the last partial block dropped) / rest (ceil of the tokens after the system prompt) / tokens."""
    def fn(nb, b, s, n):
        sh = {"full": s // b, "none": 0, "ceil": _ceil(s, b), "round": round(s / b)}[shared]
        if own == "tokens":
            return max(0, (nb - sh) * b // (n - sh * b))
        mine = {"ceil": _ceil(n, b) - sh, "floor": n // b - sh, "rest": _ceil(n - s, b)}[own]
        if mine <= 0:
            mine = 1
        if zero and nb < sh + mine:
            return 0
        return ((nb - sh) // mine if whole else _ceil(nb - sh, mine)) if room else nb // mine
    return fn


def _fit_raises_on_a_block_multiple(nb, b, s, n):
    sh = s // b + 1 // (s % b)  # "the partial block is s % b tokens": ZeroDivisionError when there is none
    return (nb - sh) // (_ceil(n, b) - sh)


def _hits15(first=False, per="right", only_second=False, unit="tokens"):
    def fn(s, lens, b):
        rule = {"right": lambda n: min(s // b, (n - 1) // b) * b,
                "partial": lambda n: min(s, n - 1),
                "ceil": lambda n: min(_ceil(s, b), (n - 1) // b) * b,
                "nocap": lambda n: s // b * b,
                "cap at n": lambda n: min(s // b, n // b) * b,
                "cap on shared": lambda n: (s - 1) // b * b,
                "tokens cap": lambda n: min(s // b * b, n - 1)}[per]
        later = lens if first else (lens[1:2] if only_second else lens[1:])
        total = sum(rule(n) for n in later)
        return total // b if unit == "blocks" else total
    return fn


# notebook 16: a lone stream's decode time, and the batch from which a decode step is compute-bound
def _weights_read(m):
    return m.num_layers * m.layer_params + m.lm_head_params + m.hidden_size


def _decode_ms(read=_weights_read, nbytes=True, mbu_on=True, overhead=True, unit=1e3):
    def fn(m, g, mbu, o):
        return (read(m) * (m.dtype_bytes if nbytes else 1) / (g.bandwidth_gbs * 1e9 * (mbu if mbu_on else 1))
                + (o if overhead else 0)) * unit
    return fn


def _batch16(kv_tokens=2, attn=True, head=True, mfu_on=True, mbu_on=True, weights="once", rounding=None,
             never=None, embedding=False):
    import math

    def fn(m, g, ctx, mfu, mbu):
        peak = g.peak_tflops * 1e12 * (mfu if mfu_on else 1)
        bw = g.bandwidth_gbs * 1e9 * (mbu if mbu_on else 1)
        w = (m.num_params if embedding else _weights_read(m)) * m.dtype_bytes / bw
        f = (2 * m.num_layers * m.layer_params + (2 * m.hidden_size * m.vocab_size if head else 0)
             + (4 * m.num_layers * m.num_heads * m.head_dim * (ctx + 1) if attn else 0)) / peak
        k = (ctx + kv_tokens) * m.kv_bytes_per_token / bw if kv_tokens is not None else 0.0
        if weights == "per request":
            k += w
        if f <= k:
            return never
        return max(1, (rounding or math.ceil)(w / (f - k)))
    return fn


def _batch16_raises_when_never(m, g, ctx, mfu, mbu):
    b = _batch16()(m, g, ctx, mfu, mbu)
    if b is None:
        raise ValueError("never compute-bound")
    return b


# notebook, check, solution / stub name, [(wrong answer, words its failure must contain), ...]
# ---- notebook 12: the acceptance step and prompt lookup
def _draw(w, rng):
    cdf = np.cumsum(w)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def _accept_with(keep="ratio", residual="clipped", bonus_at=0, stop=True, k0_bonus=True, source="given"):
    """``accept_step`` with one planted mistake (the defaults are the right rule)."""
    own = np.random.default_rng(123)

    def fn(drafts, p, q, rng):
        if source == "global":
            rng = np.random  # the module's hidden generator: not the seed the engine handed in
        elif source == "reset":
            rng = np.random.default_rng(0)  # a fresh generator each call: every call draws the same numbers
        elif source == "own":
            rng = own
        if not drafts and not k0_bonus:
            return []
        out = []
        for i, d in enumerate(drafts):
            if keep == "ratio":
                kept = rng.random() * q[i, d] < p[i, d]
            elif keep == "p_ge_q":  # "the larger probability wins", no coin
                kept = p[i, d] >= q[i, d]
            elif keep == "p_gt_q":
                kept = p[i, d] > q[i, d]
            elif keep == "prob_p":  # a coin at p instead of p/q
                kept = rng.random() < p[i, d]
            else:  # "no_min": p/q > 1 read as a coin at q/p
                ratio = p[i, d] / q[i, d]
                kept = rng.random() < (ratio if ratio <= 1 else 1 / ratio)
            if kept:
                out.append(d)
                continue
            if residual == "clipped":
                fix = _draw(np.maximum(p[i] - q[i], 0), rng)
            elif residual == "p":
                fix = _draw(p[i], rng)
            elif residual == "argmax":
                fix = int(np.argmax(np.maximum(p[i] - q[i], 0)))
            elif residual == "unclipped":
                fix = _draw(p[i] - q[i], rng)
            else:  # "choice": numpy's choice wants weights that sum to 1
                fix = int(rng.choice(len(p[i]), p=np.maximum(p[i] - q[i], 0)))
            if stop:
                return out + [fix]
            out.append(fix)  # carries on judging the later drafts
        if len(out) > len(drafts):
            return out[:len(drafts)]
        return out + [_draw(p[len(drafts) - bonus_at], rng)]
    return fn


def _accept_no_bonus(drafts, p, q, rng):
    out = _solutions("12_speculative_decoding").accept_step(drafts, p, q, rng)
    return out[:-1] if len(out) == len(drafts) + 1 else out


def _accept_keep_all(drafts, p, q, rng):
    return list(drafts) + [_draw(p[len(drafts)], rng)]


def _propose_with(order="longest", latest=True, lo_shift=0, hi_shift=0, overlap=True, k_cap=True, empty=list,
                  guard=True, first=None):
    """``propose`` with one planted mistake (the defaults are the right rule)."""
    def fn(tokens, k, min_n, max_n):
        if not guard:
            tokens[-1]  # noqa: B018 - reads the last token before looking at the length
        t = len(tokens)
        ns = list(range(min(max_n + hi_shift, t - 1), min_n + lo_shift - 1, -1))
        for n in (ns if order == "longest" else ns[::-1]):
            starts = range(t - n - 1 if overlap else t - 2 * n, -1, -1)
            for s in (starts if latest else reversed(starts)):
                if tokens[s:s + n] == tokens[t - n:]:
                    return tokens[s + n:s + n + (k if k_cap else len(tokens))]
        return empty()
    return fn


WRONG = [
    ("00_tour", ex00.check_next_blocks, "next_blocks", [
        (lambda pool, n: list(pool.free)[-n:], "head of the free queue first"),
        (lambda pool, n: list(pool.free)[:n][::-1], "right blocks, wrong order"),
        (lambda pool, n: sorted(pool.free)[:n], "head of the free queue first"),
        (lambda pool, n: [pool.free.popitem(last=False)[0] for _ in range(n)], "must not change the pool"),
    ]),
    ("00_tour", ex00.check_release, "release", [
        (_release_forward, "the table's last block first"),
        (_release_ignoring_refcount, "only when its refcount reaches 0"),
        (_release_keeps_table, "block table is removed"),
        (_release_zeroes_refcount, "loses exactly one reference"),
        (_release_to_head, "join the tail of the queue"),
    ]),
    ("01_tokenizer", ex01.check_merge_step, "merge_step", [
        (_merge_step_with(weighted=False), "weighted by the word's count"),
        (_merge_step_with(pick=lambda c: max(c, key=lambda p: (c[p], p))), "smallest pair"),
        (_merge_step_with(merge=_merge_right_to_left), "left to right, without overlaps"),
        (_merge_step_with(merge=_merge_first_only), "every occurrence"),
        (_merge_step_with(new_id=256), "largest id in any word + 1"),
        (_merge_step_with(nothing=(None, 256, {})), "nothing to merge: return None"),
        (_merge_step_with(mutate=True), "do not modify the input"),
        (_merge_step_with(overlapping=False), "overlapping ones too"),
        (_merge_step_with(singletons=False), "a one-token word's id counts too"),
        (_merge_step_with(keep_counts=False), "keeps each word's count"),
        (_merge_step_with(pick=lambda c: min(c)), "pick the most frequent pair"),
        (_merge_step_with(distinct=True), "count every occurrence of a pair in a word"),
        (_merge_step_with(pick=lambda c: min(c, key=lambda p: (-c[p], p[0]))), "compare whole tuples"),
        (_merge_step_with(floor_then_add=True), "merge it into id 256"),
        (_merge_step_with(nothing="raise"), "nothing to merge: return None"),
    ]),
    ("01_tokenizer", ex01.check_encode_word, "encode_word", [
        (_encode_leftmost, "lowest-rank merge present first"),
        (_encode_one_merge, "keep merging until no merge applies"),
        (_encode_first_occurrence, "replaces every occurrence"),
        (_encode_right_to_left, "merge left to right, without overlaps"),
        (_encode_with(offset=257), "merge i of the list creates id 256 + i"),
        (_encode_with(guard=False), "with no merge that applies, the ids are the bytes"),
    ]),
    ("02_model_and_kv_cache", ex02.check_decode_attention, "decode_attention", [
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V, scale=False)), "q·k / sqrt(D)"),
        (_in_window(lambda q, K, V: _softmax_attend(q, K[:-1], V[:-1])), "its own token too"),
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V, stable=False)), "numerically stable"),
        (_in_window(_weights_only), "one vector of size D"),
        (_in_window(lambda q, K, V: (lambda s: (np.exp(s - s.max()) / np.exp(s - s.max()).sum()) @ V)(K @ q / len(q))),
         "q·k / sqrt(D)"),  # divided by D
        (_in_window(lambda q, K, V: (lambda s: np.exp(s - s.max()) @ V)(K @ q / np.sqrt(len(q)))),
         "softmaxed over the attended tokens"),  # not normalised
        (_in_window(lambda q, K, V: (lambda s: (np.exp(s - s.min()) / np.exp(s - s.min()).sum()) @ V)(
            K @ q / np.sqrt(len(q)))), "numerically stable"),  # the smallest score subtracted: exp still overflows
        (lambda q, K, V, w: _softmax_attend(q, K[-w:], V[-w:]), "window=None means no window"),  # K[-None:]
        (lambda q, K, V, w: _softmax_attend(q, K, V), "only the last `window` cached tokens"),  # window ignored
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V), first=True), "only the last `window` cached tokens"),
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V), offset=-1), "only the last `window` cached tokens"),
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V), exclude_own=True), "its own included"),
        (_in_window(lambda q, K, V: _softmax_attend(q, K, V), from_start=True), "a window longer than the cache"),
    ]),
    ("02_model_and_kv_cache", ex02.check_kv_bytes_for_context, "kv_bytes_for_context", [
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g) // 2, "a K and a V vector"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, h, d, b, w, g), "only the KV heads are stored"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, 1, kv, d, b, w, g), "every layer"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, 1, w, g), "bytes per element"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(1, L, kv, d, b, w, g), "× the tokens of the context"),
        (lambda n, L, h, kv, d, b, w, g: 2 * L * kv * d * b * n, "a sliding-window layer keeps only the last"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, keep=lambda n, w: w if n >= w else n + 1),
         "a window longer than the context keeps the whole context"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, keep=lambda n, w: w),
         "a window longer than the context keeps the whole context"),
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, globals_=lambda L, g: -(-L // g)),
         "num_layers // global_every"),  # counts layer 0 as global
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, globals_=lambda L, g: L // g - (g == 1)),
         "with global_every = 1, every layer"),
        (lambda n, L, h, kv, d, b, w, g: max(1, _kv_context(n, L, kv, d, b, w, g)), "an empty context costs nothing"),
        (lambda n, L, h, kv, d, b, w, g: 2 * kv * d * b * ((L // g) * n + (L - L // g) * min(n, w)),
         "window=None means every layer is global"),  # min(n, None): the student's TypeError, named
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, globals_=lambda L, g: 0),
         "a global layer keeps every token of the context"),  # the window applied to every layer
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, keep=lambda n, w: min(n, w - 1)),
         "a sliding-window layer keeps only the last `window` tokens"),  # the window counted without its last token
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, keep=lambda n, w: max(n, w)),
         "a sliding-window layer keeps only the last `window` tokens"),  # max for min: the window never cuts
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, keep=lambda n, w: min(n, w) if n != w
                                                     else n - 1),
         "a context exactly as long as the window fills it"),  # "the window is full" tested with <
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, globals_=lambda L, g: max(1, L // g)),
         "num_layers // global_every"),  # at least one global layer, even when global_every > num_layers
        (lambda n, L, h, kv, d, b, w, g: _kv_context(n, L, kv, d, b, w, g, globals_=lambda L, g: (L - 1) // g),
         "num_layers // global_every"),  # the multiples of global_every in range(1, num_layers): one too few
        (lambda n, L, h, kv, d, b, w, g: _kv_context(max(n, 1), L, kv, d, b, w, g),
         "an empty context costs nothing"),  # one token at least
    ]),
    ("03_kv_memory", ex03.check_internal_frag, "internal_frag", [
        (lambda n, b: b - n % b, "exactly full wastes nothing"),
        (lambda n, b: n % b, "not the used ones"),
        (lambda n, b: 0 if n % b == 0 else b - n % b + (1 if b == 256 else 0), "blocks × block_size − tokens"),
    ]),
    ("03_kv_memory", ex03.check_slot_categories, "slot_categories", [
        (lambda l, L, A: (l, L - l, A - min(A, L)), "reservation counts only allocated slots"),
        (lambda l, L, A: (l, min(A, L) - l, A - L), "never negative"),
        (lambda l, L, A: (l, A - min(A, L), min(A, L) - l), "reservation is room this request will fill later"),
        (lambda l, L, A: (L, min(A, L) - l, A - min(A, L)), "token states are the tokens computed so far"),
        (lambda l, L, A: [l, min(A, L) - l, A - min(A, L)], "return a tuple"),
    ]),
    ("04_paged_attention", ex04.check_gather, "my_gather", [
        (lambda k, t, a, b: _rand_mgr_gather(k, np.sort(t), b)[a:], "physical (sorted) order"),
        # the lesson's whole-sequence gather, then sliced: reads blocks outside the range
        (lambda k, t, a, b: _rand_mgr_gather(k, t, b)[a:b], "read only the blocks the range touches"),
        (lambda k, t, a, b: _range_gather(k, t, a, b, offset=False), "starts start % block_size slots"),
        (lambda k, t, a, b: _range_gather(k, t, a, b, cut=False), "cut the range at stop"),
        (lambda k, t, a, b: _range_gather(k, t, a, b, last_floor=True), "include the range's partial last block"),
        (lambda k, t, a, b: _range_gather(k, t, a, b).reshape(b - a, -1), "[stop − start, kv_heads"),
        (lambda k, t, a, b: np.take(k, t[a // k.shape[1]:-(-b // k.shape[1])], axis=0).transpose(1, 0, 2, 3)
         .reshape(-1, *k.shape[2:])[a % k.shape[1]:a % k.shape[1] + b - a], "take the blocks in the table's"),
        (lambda k, t, a, b: _token_loop(k, np.arange(len(k)), a, b), "take the blocks in the table's"),  # the
        # pool's blocks 0, 1, ... instead of the table's
        (lambda k, t, a, b: _token_loop(k, t, a, b), "no Python loop over tokens"),  # right values, token by token
        (lambda k, t, a, b: _range_gather(k, t, a, b) if b > a else None, "the result is [stop − start"),
    ]),
    ("04_paged_attention", ex04.check_new_blocks_needed, "new_blocks_needed", [
        (lambda n, k, b: -(-k // b), "fits in the last block's free slots"),
        (lambda n, k, b: (n + k) // b - n // b, "ceil(tokens / block_size)"),
        (lambda n, k, b: -(-(n + k) // b) - n // b, "fits in the last block's free slots"),
        (lambda n, k, b: -(-(n + k) // b) - -(-n // b) if n % b else (-(-k // b) if n == 0 else 0),
         "crosses a block boundary"),
    ]),
    ("05_prefix_sharing", ex05.check_chain_hashes, "chain_hashes", [
        (_chain_own_tokens, "covers its parent's hash"),
        (_chain_with_partial, "only full blocks get a hash"),
        (_chain_wrong_root, "hash_block_tokens(ROOT_HASH"),
    ]),
    ("05_prefix_sharing", ex05.check_append_slots, "my_append_slots", [
        (_append_with(copy_when="never"), "is copied first"),
        (_append_with(copy_when="shared_last"), "a full block is never written"),  # copies a full shared last block
        # judged by the block after the write: copies a full shared block (and misses a block the write fills)
        (_append_with(copy_when="after_fill"), "a full block is never written"),
        (_append_with(copy_when="partial"), "refcount 1 is written in place"),
        (_append_with(copy_when="all_shared"), "a full block is never written"),  # copies the shared prompt blocks
        (_append_with(names_copy=False), "the table names the private copy"),
        (_append_with(original="same"), "loses exactly one reference"),
        (_append_with(original="zero"), "loses exactly one reference"),
        (_append_with(copy_ref="inherit"), "the copy and each new block start at 1"),
        (_append_with(new_ref=0), "the copy and each new block start at 1"),
        (_append_with(copy_first=False), "the copy first, then the new blocks"),
        (_append_with(pick="tail"), "head of the free queue"),
        (_append_with(pick="sorted"), "head of the free queue"),
        (_append_with(new_count="k"), "one new block per block boundary crossed"),
        (_append_with(new_count="floor"), "one new block per block boundary crossed"),
        (_append_with(new_count="ceil_floor"), "one new block per block boundary crossed"),
        (_append_with(room="ignore_copy"), "fewer blocks than the copy plus the new blocks"),
        (_append_with(room="ge"), "fewer blocks than the copy plus the new blocks"),
        (_append_with(room="need_one"), "a request that needs no block always fits"),
        (_append_with(room="peek"), "a request that needs no block always fits"),  # IndexError on []
        (_append_with(room="never"), "fewer blocks than the copy plus the new blocks"),  # crashes: IndexError
        (_append_with(mutate=True), "leave the inputs unchanged"),
        (_append_with(shape="pair"), "return (table, ref_cnt, copies)"),
    ]),
    ("06_lru_eviction", ex06.check_evictions, "my_evictions", [
        (lambda q, n: [b for b, c in q[::-1][:n] if c], "head first"),
        (lambda q, n: [b for b, _ in q[:n]], "a free-empty block holds nothing"),
        (lambda q, n: [b for b, c in q if c][:n], "takes the first n blocks of the free queue"),
        (lambda q, n: [b for b, c in q[:n] if c][::-1], "head first"),
    ]),
    ("06_lru_eviction", ex06.check_safe_victims, "safe_victims", [
        (lambda order, rc, n: order[:n] if sum(rc[b] == 0 for b in order) >= n
         else (_ for _ in ()).throw(OutOfBlocksError(n, 0, len(order))), "never evict a block a request still holds"),
        (lambda order, rc, n: [b for b in sorted(order) if rc[b] == 0][:n] if sum(rc[b] == 0 for b in order) >= n
         else (_ for _ in ()).throw(OutOfBlocksError(n, 0, len(order))), "LRU order"),
        (lambda order, rc, n: [b for b in order if rc[b] == 0][:n], "raise OutOfBlocksError"),
        (_safe_victims_mutating, "change nothing"),
        (lambda order, rc, n: (_ for _ in ()).throw(OutOfBlocksError(n, 0, len(order))), "refuse only when"),
    ]),
    ("07_scheduling", ex07.check_victim_policy, "fewest_computed", [
        (lambda c: min(c, key=lambda r: r.num_computed_tokens), "among equals"),
        (lambda c: c[0], "fewest computed tokens"),
        (lambda c: max(c, key=lambda r: r.num_computed_tokens), "fewest computed tokens"),
        (lambda c: min(reversed(c), key=lambda r: r.num_computed_tokens).request_id, "return one of the candidates"),
        (_fewest_then_largest_id, "the latest in the LIST"),
        (_fewest_latest_by_id_order, "the latest in the LIST"),
    ]),
    ("07_scheduling", ex07.check_plan_step, "plan_step", [
        (_plan_greedy, "every decode gets its token"),
        (lambda needs, budget: list(needs), "never computes more tokens than the budget"),
        (_plan_prefills_reversed, "in running order"),
        (_plan_no_need_cap, "at most what it still needs"),
        (lambda needs, budget: _plan_greedy(needs, budget)[:-1], "one number per running request"),
    ]),
    ("08_engine", ex08.check_latency_in_steps, "latency_in_steps", [
        (_latency_with(first_step=0), "numbered from 1"),
        (_latency_with(first_token="after arrival"), "the request's first OUTPUT"),
        (_latency_with(from_arrival=False), "count from the request's arrival"),
        (_latency_with(e2e="outputs"), "e2e counts steps, not outputs"),
        (_latency_with(key="first seen"), "key by request id"),
        (lambda arrivals, steps: [(1, 1)] * len(arrivals), "return a dict"),
    ]),
    ("08_engine", ex08.check_run_to_completion, "run_to_completion", [
        (_run_fixed_steps, "step until has_unfinished_requests() is false"),
        (_run_last_delta, "all its deltas joined"),
        (_run_keyed_by_index, "key the texts by the request ids"),
        (lambda engine, prompts, params: [o.text for o in engine.generate(prompts, params)], "use only add_request"),
        (lambda engine, prompts, params: {o.request_id: o.text for o in engine.generate(prompts, params)},
         "use only add_request"),
        (_run_with_output, "use only add_request"),
        (lambda engine, prompts, params: {engine.add_request(p, params): "" for p in prompts},
         "step until has_unfinished_requests() is false"),
    ]),
    ("09_metrics", ex09.check_quantile_from_buckets, "quantile_from_buckets", [
        (lambda q, b: next(le for le, c in b if c >= q * b[-1][1]) if b[-1][1] else float("nan"),
         "interpolate linearly"),
        (lambda q, b: b[-1][0], "cumulative"),
        (_quantile(lower_of="last non-empty"), "even when that bucket is empty) to its own le"),
        (_quantile(position="cumulative"), "(rank - count below) / (its own observations)"),
        (_quantile(off_scale="last non-empty"), "gives the largest finite bound"),
        (_quantile(q1_off_scale=True), "the first whose count >= rank"),
    ]),
    ("09_metrics", ex09.check_increase, "increase", [
        (lambda s: s[-1][1] - s[0][1] if len(s) > 1 else None, "is a reset"),
        (lambda s: sum(b[1] - a[1] if b[1] > a[1] else b[1] for a, b in zip(s, s[1:])) if len(s) > 1 else None,
         "an equal value is not a reset"),
        (_increase(reset="first"), "is a reset"),
        (_increase(reset="max so far"), "is a reset"),
        (_increase(first_pair=False), "is a reset"),
        (lambda s: sum(b[1] - a[1] if b[1] >= a[1] else 0.0 for a, b in zip(s, s[1:])) if len(s) > 1 else None,
         "is a reset"),  # a drop adds nothing: the restarted counter's first count is lost
    ]),
    ("10_serving", ex10.check_retry_ceilings, "retry_ceilings", [
        (_ceilings(first_exponent=1), "the first retry waits up to initial_backoff"),
        (_ceilings(growth="linear"), "multiplier × the previous"),
        (_ceilings(cap=False), "no ceiling exceeds max_backoff"),
        (_ceilings(extra=1), "max_attempts counts the first call"),
        (lambda m, i, k, c: sum(_ceilings()(m, i, k, c)), "return a list of numbers"),
        (lambda m, i, k, c: [i] + _ceilings()(m, i, k, c)[1:] if m > 1 else [], "the first one included"),
    ]),
    ("10_serving", ex10.check_pick_instance, "pick_instance", [
        (_pick(home="mod sorted"), "moves only the prefixes that must move"),
        (_pick(home="mod order"), "not on their order in loads"),
        (_pick(whole=True), "only the prompt's first full block decides"),
        (_pick(blocks=2), "only the prompt's first full block decides"),
        (_pick(score="name only"), "a fair share"),
        (_pick(score="key only"), "not on their order in loads"),
        (_pick(home="ring"), "a fair share"),
        (_pick(exact_is_short=True), "a prompt of exactly one block has a full block"),
        (_pick(fallback="none"), "max_load or more requests in flight is overloaded"),
        (_pick(strict=True), "max_load or more requests in flight is overloaded"),
        (_pick(fallback="next"), "the fallback is the least-loaded instance"),
        (_pick(fallback="first"), "the fallback is the least-loaded instance"),
        (_pick(ties="largest name"), "among equally loaded instances (the home not among them), the smallest name"),
        (_pick(ties="dict order"), "among equally loaded instances (the home not among them), the smallest name"),
        (_pick(fallback="others"), "when every instance is overloaded"),
        (_pick(home_wins_tie=False), "the home wins a tie"),
        (_pick(fallback="home if least"), "fewer than max_load requests in flight keeps the request"),
        (_pick(short="hash"), "shorter than one block has no full block"),
        (_pick(short="chain"), "shorter than one block has no full block"),  # the student's IndexError, named
        (_pick(short_ties="dict order"), "shorter than one block has no full block"),
        (_pick(fallback="compare"), "with one instance"),  # the student's ValueError (min of nothing), named
        (_pick(answer="index"), "return the name of an instance"),
        (_pick(mutate=True), "do not modify loads"),
    ]),
    ("11_persistent_kv", ex11.check_next_victim, "next_victim", [
        (lambda records: min(records, key=lambda r: r[2])[0], "evict only a chain's tail"),  # plain LRU
        (_newest_tail, "least recently used goes first"),
        (lambda records: records[0][0], "evict only a chain's tail"),  # the first listed
        (_oldest_tail_by_key, "least recently used goes first"),
        (lambda records: b"\x00" * 32, "return the key of one of the stored records"),
    ]),
    ("11_persistent_kv", ex11.check_num_tokens_to_load, "num_tokens_to_load", [
        (_load_with(keys="local"), "the model fingerprint"),
        (_load_with(keys="unchained"), "chain hashes"),
        (_load_with(stop=False), "stop at the first block that is not verified"),
        (_load_with(cap_last=False), "never load the prompt's last token"),
        (_load_with(local="ignore"), "only the tokens beyond the local hit"),
        (_load_with(local="raw"), "never a negative count"),
        (_load_with(unit="blocks"), "count tokens (blocks × block_size), not blocks"),
        (lambda prompt, n, v, b, fp: float(_load_with()(prompt, n, v, b, fp)), "return one int"),
    ]),
    ("13_block_size", ex13.check_fragmentation_prediction, "predict_fragmentation", [
        (lambda lengths, b: 100 * _frag(lengths, b), "not a percentage"),
        (_frag_rule_of_thumb, "over every step"),
        (lambda lengths, b: _frag(lengths, b, steps="final"), "over every step"),
        (lambda lengths, b: _frag(lengths, b, steps="one too many"), "over every step"),
        (lambda lengths, b: _frag(lengths, b, steps="one too few"), "over every step"),  # nothing for (1, 1)
        (lambda lengths, b: _frag(lengths, b, combine="mean of ratios"), "divide once"),
    ]),
    ("13_block_size", ex13.check_block_size_cost, "block_size_cost", [
        (_cost_with(length="prompt"), "at the final length (prompt + output)"),
        (_cost_with(exact_full_wastes=True), "0 when exactly full"),
        (_cost_with(hit="all"), "hits in whole blocks only"),
        (_cost_with(hit="ceil"), "hits in whole blocks only"),
        (_cost_with(cap=False), "the prompt's last token is never a hit"),
        (_cost_with(entries="none"), "every block-table entry costs entry_cost"),
        (_cost_with(entries="request"), "every block-table entry costs entry_cost"),
        (_cost_with(combine=lambda c: sum(c) / len(c)), "summed over all the requests"),
        (_cost_with(combine=lambda c: c[-1]), "summed over all the requests"),
        (_cost_with(combine=lambda c: [sum(c)]), "return one number"),
    ]),
    ("15_real_model", ex15.check_conversations_that_fit, "conversations_that_fit", [
        (_fit(shared="none"), "full blocks are stored once"),
        (_fit(room=False), "but they take room in the pool too"),
        (_fit(shared="ceil"), "only full blocks are shared"),
        (_fit(shared="round"), "only full blocks are shared"),
        (_fit(own="rest"), "only full blocks are shared"),
        (_fit(own="tokens"), "whole blocks"),
        (_fit(own="floor"), "whole blocks"),
        (_fit(zero=False), "0 when not even one fits"),
        (_fit(whole=False), "count whole conversations only"),
        (lambda nb, b, s, n: (nb - s // b) / (_ceil(n, b) - s // b), "return one int"),
        (_fit_raises_on_a_block_multiple, "only full blocks are shared"),
    ]),
    ("15_real_model", ex15.check_prefix_hit_tokens, "prefix_hit_tokens", [
        (_hits15(first=True), "the first request finds nothing cached"),
        (_hits15(per="partial"), "only whole blocks are hits"),
        (_hits15(per="ceil"), "only whole blocks are hits"),
        (_hits15(per="tokens cap"), "only whole blocks are hits"),
        (_hits15(per="nocap"), "the prompt's last token is never a hit"),
        (_hits15(per="cap at n"), "the prompt's last token is never a hit"),
        (_hits15(per="cap on shared"), "the prompt's last token is never a hit"),
        (_hits15(only_second=True), "every later request hits"),
        (_hits15(unit="blocks"), "count tokens"),
        (lambda s, lens, b: _hits15()(s, lens, b) if len(lens) > 1 else lens[1], "the first request finds nothing"),
        (lambda s, lens, b: [min(s // b, (n - 1) // b) * b for n in lens[1:]], "return one int"),
    ]),
    ("12_speculative_decoding", ex12.check_accept_step, "accept_step", [
        (_accept_no_bonus, "followed by exactly one token"),
        (_accept_keep_all, "p = 0 means never"),
        (_accept_with(keep="p_ge_q"), "p/q = 0.5 means half the time"),
        (_accept_with(residual="p"), "not from p"),
        (_accept_with(bonus_at=1), "bonus from p at position k + 1"),
        (_accept_with(keep="no_min"), "p >= q means always"),
        (_accept_with(keep="p_gt_q"), "p = q included"),
        (_accept_with(keep="prob_p"), "p >= q means always"),
        (_accept_with(residual="argmax"), "in proportion to max(p - q, 0)"),
        (_accept_with(residual="unclipped"), "normalise(max(p - q, 0))"),
        (_accept_with(residual="choice"), "normalise(max(p - q, 0))"),
        (_accept_with(stop=False), "draw one token and stop"),
        (_accept_with(k0_bonus=False), "with no drafts (k = 0)"),
        (_accept_with(source="global"), "the rng you are given"),
        (_accept_with(source="reset"), "the rng you are given"),
        (_accept_with(source="own"), "the rng you are given"),
    ]),
    ("12_speculative_decoding", ex12.check_ngram, "propose", [
        (_propose_with(order="shortest"), "longest n first"),
        (_propose_with(latest=False), "most recent wins"),
        (lambda tokens, k, lo, hi: _propose_with()(tokens, k, 1, hi), "below min_n"),
        (_propose_with(k_cap=False), "at most k"),
        (_propose_with(empty=lambda: None), "no match: propose nothing"),
        (_propose_with(overlap=False), "may overlap the suffix"),
        (_propose_with(lo_shift=1), "min_n included"),
        (_propose_with(hi_shift=-1), "max_n (included)"),
        (_propose_with(guard=False), "an empty sequence included"),
    ]),
    ("16_at_scale", ex16.check_decode_prediction, "predict_decode_ms", [
        (_decode_ms(unit=1), "answer in milliseconds"),
        (_decode_ms(nbytes=False), "a step reads bytes"),
        (_decode_ms(read=lambda m: m.num_params), "the embedding table is only gathered"),
        (_decode_ms(mbu_on=False), "not the datasheet peak"),
        (_decode_ms(overhead=False), "add the fixed per-step overhead"),
        (lambda m, g, mbu, o: "6 ms", "return one number"),
    ]),
    ("16_at_scale", ex16.check_compute_bound_batch, "compute_bound_batch", [
        (_batch16(weights="per request"), "read once per step, whatever the batch"),
        (_batch16(embedding=True), "the embedding is only gathered"),
        (_batch16(kv_tokens=None), "every request adds the same work"),
        (_batch16(kv_tokens=1), "every request adds the same work"),  # the new token's KV write forgotten
        (_batch16(kv_tokens=0), "every request adds the same work"),  # only the context's KV
        (_batch16(attn=False), "every request adds the same work"),
        (_batch16(head=False), "every request adds the same work"),
        (_batch16(mfu_on=False), "peak_tflops × 1e12 × mfu"),
        (_batch16(mbu_on=False), "peak_tflops × 1e12 × mfu"),
        (_batch16(rounding=lambda x: int(x)), "the smallest whole batch size"),
        (_batch16(rounding=round), "the smallest whole batch size"),
        (_batch16(never=0), "return None when no batch size is compute-bound"),
        (_batch16_raises_when_never, "return None when no batch size is compute-bound"),
        (_batch16(rounding=lambda x: x), "return an int"),
        (_batch16(never=float("inf")), "return an int"),
    ]),
]

CASES = [(nb, check, name, wrong, words) for nb, check, name, wrongs in WRONG for wrong, words in wrongs]
EXERCISES = [(nb, check, name) for nb, check, name, _ in WRONG]


@pytest.mark.parametrize("notebook, check, name", EXERCISES, ids=[f"{nb}:{name}" for nb, _, name in EXERCISES])
def test_solution_passes(notebook, check, name, capsys):
    assert check(getattr(_solutions(notebook), name)) == PASSED
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("notebook, check, name, wrong, words", CASES,
                         ids=[f"{nb}:{name}:{i}" for i, (nb, _, name, _, _) in enumerate(CASES)])
def test_wrong_answer_fails_naming_the_rule(notebook, check, name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("✗ ")
    assert words in first_line, f"{name}: expected the rule {words!r}, got: {info.value}"


def _stub(notebook: str, name: str):
    """The function the notebook ships under ``name``, compiled alone from the notebook's source."""
    source = (REPO / "notebooks" / f"{notebook}.py").read_text()
    defs = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert len(defs) == 1, f"notebooks/{notebook}.py defines {name} {len(defs)} times"
    namespace: dict = {"np": np}
    exec(compile(ast.Module(body=defs, type_ignores=[]), f"{notebook}.py", "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("notebook, check, name", EXERCISES, ids=[f"{nb}:{name}" for nb, _, name in EXERCISES])
def test_committed_stub_is_not_implemented(notebook, check, name, capsys):
    assert check(_stub(notebook, name)) == NOT_IMPLEMENTED
    out = capsys.readouterr().out
    assert out.startswith("not implemented yet — ") and check.todo in out


@pytest.mark.parametrize("notebook, check, name", EXERCISES, ids=[f"{nb}:{name}" for nb, _, name in EXERCISES])
def test_notebook_calls_this_check_on_the_stub(notebook, check, name):
    source = (REPO / "notebooks" / f"{notebook}.py").read_text()
    calls = (f"{check.__name__}({name})", f"{check.__name__}({name},")  # the stub alone, or with live data after it
    assert any(c in source for c in calls), f"notebooks/{notebook}.py never runs {check.__name__}({name})"


def test_every_notebook_has_two_exercises_and_hints():
    per_notebook = Counter(nb for nb, _, _ in EXERCISES)
    later = {"10_serving", "15_real_model", "16_at_scale"}
    for nb in sorted({p.stem for p in (REPO / "notebooks").glob("0[0-9]_*.py")} | later):
        assert per_notebook[nb] >= 2, f"{nb} has {per_notebook[nb]} exercises"
        source = (REPO / "notebooks" / f"{nb}.py").read_text()
        assert source.count("<details>") >= 2 * per_notebook[nb], f"{nb}: fewer than two hints per exercise"
        assert "# --- solution" not in source and "_solution(" not in source, f"{nb} ships a solution"


def test_stub_detection_only_on_first_call():
    """``None`` from a function that answered before is a wrong answer, not a stub."""
    calls = []

    def sometimes_none(pool, n):
        calls.append(n)
        return list(pool.free)[:n] if len(calls) < 3 else None

    with pytest.raises(ExerciseFailed):
        ex00.check_next_blocks(sometimes_none)


def test_append_reference_is_what_the_manager_does_after_a_fork():
    """The check's plain statement of copy-on-write is what KVCacheManager.append_slots does: same copies, same
    table, same refcounts, and None exactly when the manager has no room (random prompts, forks, appends)."""
    from minienv.kv.kv_cache_manager import KVCacheManager

    rng = np.random.default_rng(23)
    compared = copied = refused = 0
    for trial in range(60):
        bs = int(rng.choice([1, 2, 3, 4, 8]))
        mgr = KVCacheManager(int(rng.integers(6, 20)), bs)
        parent, alloc = admit(mgr, "p", [int(t) for t in rng.integers(0, 9, int(rng.integers(1, 4 * bs + 1)))])
        if alloc is None:
            continue
        compute(mgr, parent)
        kids = [f"c{i}" for i in range(int(rng.integers(1, 3)))]
        mgr.fork(parent, kids)
        reqs = {"p": parent} | {c: child(parent, c) for c in kids}
        for _ in range(6):
            rid = str(rng.choice(sorted(reqs)))
            req, k = reqs[rid], int(rng.integers(1, 2 * bs + 2))
            refs = [mgr.ref_cnt(b) for b in range(mgr.num_blocks)]
            table, n = mgr.block_ids(rid), mgr.num_tokens(rid)
            want = ex05.append_reference(table, refs, n, k, bs, [b for b, _ in mgr.free_queue()])
            got = append(mgr, req, [int(t) for t in rng.integers(0, 9, k)])
            if want is None:
                assert got is None, trial
                refused += 1
                continue
            assert got is not None, trial
            assert (mgr.block_ids(rid), [mgr.ref_cnt(b) for b in range(mgr.num_blocks)]) == want[:2], trial
            assert [tuple(c) for c in got.blocks_to_copy] == want[2], trial
            compute(mgr, req)  # (commit may then swap a full block for an equal indexed one: not the exercise's)
            compared += 1
            copied += bool(want[2])
    assert compared > 100 and copied > 20 and refused > 5, (compared, copied, refused)


def test_plan_reference_is_the_scheduler_rule():
    """plan_step's reference equals what minienv's scheduler schedules when memory is plentiful."""
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams

    eng = InferenceEngine(ex07.tiny_model(), ex07.TokenIdTokenizer(), kv_budget_tokens=4096, block_size=8,
                          max_num_seqs=4, max_num_batched_tokens=24)
    rng = np.random.default_rng(1)
    for _ in range(4):
        eng.add_request([int(t) for t in rng.integers(0, 128, int(rng.integers(5, 60)))],
                        SamplingParams(max_tokens=6, temperature=0))
    compared = 0
    while eng.has_unfinished_requests():
        before = {r.request_id: r.num_tokens_to_compute for r in eng.scheduler.running}
        order = [r.request_id for r in eng.scheduler.running]
        eng.step()
        plan = eng.history[-1].scheduler_output
        got = {s.request_id: s.num_new_tokens for s in plan.scheduled if not s.is_new}
        if order and not plan.preempted:
            want = ex07.plan_reference([before[r] for r in order], 24)
            assert [got.get(r, 0) for r in order] == want
            compared += 1
    assert compared > 5


# Chapters whose first exercise is checked in the chapter's own test file (tests/unit/test_block_size.py, ...):
# every exercise they ship, and at least two hints each.
LATER_CHAPTERS = [
    ("13_block_size", ("check_fragmentation_prediction(predict_fragmentation)",
                       "check_block_size_cost(block_size_cost)")),
    ("11_persistent_kv", ("check_next_victim(next_victim)", "check_num_tokens_to_load(num_tokens_to_load)")),
]


@pytest.mark.parametrize("notebook, calls", LATER_CHAPTERS, ids=[nb for nb, _ in LATER_CHAPTERS])
def test_later_chapters_have_two_exercises_and_hints(notebook, calls):
    source = (REPO / "notebooks" / f"{notebook}.py").read_text()
    for call in calls:
        assert call in source, f"{notebook} never runs {call}"
    assert source.count("<details>") >= 2 * len(calls), f"{notebook}: fewer than two hints per exercise"
    assert "# --- solution" not in source and "_solution(" not in source, f"{notebook} ships a solution"


def test_tokens_to_load_reference_is_what_a_restarted_engine_loads(tmp_path):
    """The rule num_tokens_to_load states is what the real engine does on a restart — also with a refused record."""
    from engine_harness import bundled
    from minienv.engine import InferenceEngine
    from minienv.kv_tier import SQLiteStore, block_keys
    from minienv.lab.kv_tier_lab import serve_with_tier

    model, tok = bundled()
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 2000, 100)]  # 6 full blocks + 4 tokens
    serve_with_tier(model, tok, prompt, tmp_path)  # computes and stores
    fingerprint = InferenceEngine(model, tok, kv_tier=tmp_path).kv_tier.fingerprint
    keys = block_keys(prompt, 16, fingerprint)
    store = SQLiteStore(tmp_path)
    stored = {record[0] for record in store.records()}
    raw = store.raw(keys[2])
    store.overwrite_raw(keys[2], raw[:200] + bytes([raw[200] ^ 0xFF]) + raw[201:])  # block 2 will be refused
    store.close()
    refused = serve_with_tier(model, tok, prompt, tmp_path)
    assert refused.loaded_tokens == ex11.num_tokens_to_load_reference(prompt, 0, stored - {keys[2]}, 16,
                                                                        fingerprint) == 32
    again = serve_with_tier(model, tok, prompt, tmp_path)  # block 2 was recomputed and stored again
    assert again.loaded_tokens == ex11.num_tokens_to_load_reference(prompt, 0, stored, 16, fingerprint) == 96
    assert again.token_ids == refused.token_ids


def test_conversations_that_fit_reference_is_what_the_manager_holds():
    """The rule exercise 15.1 states is what KVCacheManager does: conversations sharing a system prompt are allocated
    (and committed, so the next finds the prompt by hash) until the pool is out of blocks."""
    from minienv.kv.kv_cache_manager import KVCacheManager

    for num_blocks, b, s, n in [c for c, _ in ex15.FIT_CASES if c[0] * c[1] <= 20_000]:
        mgr = KVCacheManager(num_blocks, b)
        system = list(range(s))
        held = 0
        while True:
            conv = system + [10_000 + held] * (n - s)
            try:
                req, alloc = admit(mgr, held, conv)
                if alloc is None:
                    break
            except OutOfBlocksError:
                break
            compute(mgr, req)
            held += 1
        assert held == ex15.conversations_that_fit_reference(num_blocks, b, s, n), (num_blocks, b, s, n)


def test_prefix_hit_tokens_reference_is_what_the_engine_serves():
    """Exercise 15.2's rule against the engine's own count, on the bundled model: requests sharing a prefix, one
    after another."""
    from engine_harness import bundled
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams

    model, tok = bundled()
    for shared, lens, b in [c for c, _ in ex15.HIT_CASES]:
        eng = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=b, max_num_seqs=1)
        prompts = [list(range(1, shared + 1)) + [500 + i] * (n - shared) for i, n in enumerate(lens)]
        eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        assert eng.stats.prefix_cache_hits_tokens == ex15.prefix_hit_tokens_reference(shared, lens, b), (shared, lens)


def test_01s_trap_quotes_what_the_check_prints_for_it():
    """Notebook 01 describes its exercise-1 trap by the failure it gets (the code that made it was one edit from
    the answer): the quoted message is the check's own for an unweighted count, so it cannot drift."""
    source = (REPO / "notebooks" / "01_tokenizer.py").read_text()
    assert "def merge_step_unweighted" not in source
    quoted = source.split("# ```\n# ExerciseFailed: ", 1)[1].split("\n# ```", 1)[0]
    with pytest.raises(ExerciseFailed) as info:
        ex01.check_merge_step(_merge_step_with(weighted=False))
    assert quoted.replace("\n# ", "\n") == str(info.value)


def test_a_merge_step_answer_given_as_a_list_is_read_as_the_tuple(capsys):
    sol = _solutions("01_tokenizer").merge_step
    assert ex01.check_merge_step(lambda words: None if (got := sol(words)) is None else
                                 [list(got[0]), got[1], got[2]]) == PASSED


def test_12_shows_the_forgotten_residual_by_its_output_not_its_code():
    """The acceptance-rule section used to print a verifier one edit from exercise 1's answer."""
    source = (REPO / "notebooks" / "12_speculative_decoding.py").read_text()
    defs = [n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    assert "forget_the_residual" not in defs and "residual_forgotten" in source and "_draw" not in source
    assert source.index("check_accept_step(accept_step)") > source.index("def accept_step")
    cells = source.split("# %%")
    stub = next(c for c in cells if "def accept_step" in c)
    assert "check_accept_step(accept_step)" not in stub  # 00's format: the check has a cell of its own
