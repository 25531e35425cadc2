"""Output processing, in the order a sampled token meets it: **detokenize** (:class:`IncrementalDetokenizer`,
text released up to the last complete UTF-8 character), **decide the end** (:func:`append_token`: EOS, a stop
string, ``max_tokens``), **route** (:class:`OutputRouter`): every request belongs to one *consumer* — the
``step()`` caller, a ``generate()`` call or a ``stream()`` iterator. Whoever drives the engine, progress is recorded
for the owner, whose next read gets one output per request with everything new since its previous read.

Routing invariant: ``0 <= delivered_tokens <= num_output_tokens``, and the deltas a consumer received, concatenated,
are ``output_token_ids[:delivered_tokens]`` (text likewise); a final output is delivered exactly once, after which
the engine may forget the request.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from minienv.generate import trim_at_stop
from minienv.request import FinishReason, Request, RequestMetrics
from minienv.tokenizer import BPETokenizer


class IncrementalDetokenizer:
    """Output text grown one token at a time. A byte-level token can end inside a UTF-8 character, so text is
    released up to the last complete one: through Python's incremental UTF-8 decoder when the tokenizer exposes
    each token's bytes (``id_to_bytes``; O(1) per token, exactly ``decode(all ids)``), else by holding tokens in
    ``pending`` until ``decode(pending)`` no longer ends in U+FFFD."""

    def __init__(self, tokenizer: Any):
        self.decode = tokenizer.decode
        self.id_to_bytes = getattr(tokenizer, "id_to_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self.id_to_bytes else None
        # minienv's tokenizer keeps every token's bytes in a table: an index instead of a checked call per token.
        # Only when id_to_bytes is that tokenizer's own (a wrapper may override it, e.g. to fail on a token).
        own = getattr(type(tokenizer), "id_to_bytes", None) is BPETokenizer.id_to_bytes
        self._table: tuple[bytes, ...] | None = tokenizer.token_bytes if own else None
        self._texts: tuple[str | None, ...] | None = tokenizer.token_texts if own else None
        self._partial = False  # the UTF-8 decoder holds the start of a character
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        if self._utf8 is not None:
            table = self._table
            if table is not None and type(token_id) is int and 0 <= token_id < len(table):
                # most tokens are whole characters: with nothing pending, their text is known in advance
                text = None if self._partial else self._texts[token_id]  # type: ignore[index]
                if text is not None:
                    return text
                raw = table[token_id]
            else:
                raw = self.id_to_bytes(token_id)  # anything else: the tokenizer's checks decide
            text = self._utf8.decode(raw)
            self._partial = bool(self._utf8.getstate()[0])
            return text
        self.pending.append(token_id)
        text = self.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        if self._utf8 is not None:
            self._partial = False
            return self._utf8.decode(b"", final=True)
        text = self.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


@dataclass(frozen=True)
class RequestOutput:
    """What a request has produced so far (vLLM's ``RequestOutput``, one completion per request).

    ``token_ids`` are the generated ids (EOS excluded; the token completing a stop string included). ``text`` is cut
    before the stop string that finished it; while running it holds back the last ``len(longest stop) - 1``
    characters, which might yet start one, so streamed text is never taken back. ``delta_*`` is what is new since
    this consumer's previous output of the request; ``error`` says why it finished with ``"error"``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    stop_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: tuple[int, ...] = ()
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first admission."""
        return self.metrics.num_cached_tokens

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def tpot(self) -> float | None:
        return self.metrics.tpot

    @property
    def e2e_latency(self) -> float | None:
        return self.metrics.e2e_latency


def append_token(req: Request, token: int, eos_token_id: int | None) -> FinishReason | None:
    """Append a sampled token to the request's output and text; return why it ends now, or None. EOS ends it
    without joining the output; a stop string once it appears in the text (only the tail that could hold a new
    match is searched), the text cut before it; ``max_tokens`` last."""
    detok: IncrementalDetokenizer = req.detokenizer  # type: ignore[assignment]
    if eos_token_id is not None and token == eos_token_id:
        req.text += detok.flush()
        return "eos"
    piece = detok.push(token)  # first: a token the tokenizer cannot decode fails before the request changes
    req.append_output_token(token)
    before = len(req.text)
    req.text += piece
    params = req.sampling_params
    stops = params.stop_strings
    if stops:
        tail = req.text[max(0, before - max(map(len, stops)) + 1):]
        hit = [s for s in stops if s in tail]
        if hit:
            req.stop_reason = min(hit, key=req.text.find)
            req.text = trim_at_stop(req.text, stops)
            return "stop"
    if len(req.output_token_ids) >= params.max_tokens:  # num_output_tokens >= max_tokens
        req.text += detok.flush()
        return "length"
    return None


def visible_text(req: Request, finished: bool | None = None) -> str:
    """The text a consumer may see now: all of it once finished, else minus a possible stop-string start.
    ``finished``: ``req.is_finished`` if the caller has it already."""
    stops = req.sampling_params.stop_strings
    if not stops or (req.is_finished if finished is None else finished):
        return req.text
    return req.text[:max(0, len(req.text) - max(map(len, stops)) + 1)]


def make_output(req: Request, *, advance: bool) -> RequestOutput:
    """The request's output now; the delta is what its consumer has not been given. ``advance`` marks it given."""
    finished = req.is_finished
    text = visible_text(req, finished)
    ids = tuple(req.output_token_ids)
    n_tok, n_chr = req.delivered_tokens, req.delivered_chars
    if advance:
        req.delivered_tokens, req.delivered_chars = len(ids), len(text)
    out = RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_tuple, text=text,
        token_ids=ids, finished=finished, finish_reason=req.finish_reason, metrics=req.metrics.copy(),
        stop_reason=req.stop_reason, delta_text=text[n_chr:] if advance else "",
        delta_token_ids=ids[n_tok:] if advance else (), error=req.error)
    return out


class Consumer:
    """One reader of outputs. ``pending``: its requests with unread progress, in order, each once however many
    steps ran meanwhile; ``live``: its requests whose final output it has not read."""

    __slots__ = ("name", "pending", "live")

    def __init__(self, name: str):
        self.name = name
        self.pending: dict[str, Request] = {}
        self.live: dict[str, Request] = {}

    def __repr__(self) -> str:
        return f"Consumer({self.name!r}, live={len(self.live)}, pending={len(self.pending)})"


class OutputRouter:
    """Delivers each request's progress to its consumer, once: ``notify(req)`` after a change; ``drain(consumer)``
    returns its outputs and the requests whose final output it has now read (the engine then releases them)."""

    def attach(self, req: Request, consumer: Consumer) -> None:
        req.consumer = consumer
        consumer.live[req.request_id] = req

    def adopt(self, source: Consumer, target: Consumer) -> None:
        """Hand every live request of ``source`` to ``target`` (a consumer that stopped reading mid-way)."""
        for req in source.live.values():
            req.consumer = target
        target.pending.update(source.pending)
        target.live.update(source.live)
        source.pending.clear()
        source.live.clear()

    @staticmethod
    def notify(req: Request) -> None:
        req.consumer.pending[req.request_id] = req  # type: ignore[union-attr]

    @staticmethod
    def drain(consumer: Consumer) -> tuple[list[RequestOutput], list[Request]]:
        outs, done = [], []
        for req in consumer.pending.values():
            out = make_output(req, advance=True)
            if out.delta_token_ids or out.delta_text or out.finished:
                outs.append(out)
            if out.finished:
                consumer.live.pop(req.request_id, None)
                done.append(req)
        consumer.pending.clear()
        return outs, done
