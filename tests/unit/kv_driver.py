"""Driving a KV manager by hand, as the scheduler does: the caller owns each request (a ``KVRequest``: its tokens
and how many are computed) and the manager only reads it."""

from __future__ import annotations

from minienv.kv.interface import KVRequest


def admit(mgr, rid, tokens, num_new_tokens=None):
    """A new request over ``tokens``, allocated: ``(request, allocation)`` (allocation None: no room)."""
    req = KVRequest(rid, list(tokens))
    return req, mgr.allocate(req, num_new_tokens)


def append(mgr, req, tokens):
    """Append ``tokens`` to the request and reserve their slots; on None (no room) the tokens are taken back."""
    req.all_token_ids.extend(tokens)
    alloc = mgr.append_slots(req, len(tokens))
    if alloc is None:
        del req.all_token_ids[len(req.all_token_ids) - len(tokens):]
    return alloc


def compute(mgr, req):
    """The step computed every reserved token: advance ``num_computed_tokens`` and commit (blocks indexed)."""
    req.num_computed_tokens = mgr.request(req.request_id).num_tokens
    return mgr.commit(req)


def child(parent, rid):
    """A forked child's own request: a copy of the parent's tokens and progress."""
    return KVRequest(rid, list(parent.all_token_ids), parent.num_computed_tokens)
