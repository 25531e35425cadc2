"""Byte-level BPE: train, encode, decode, and save/load in Hugging Face ``tokenizer.json`` form.

Why byte-level: the tokenizer works on the UTF-8 *bytes* of the text, and all 256 byte values are in the
vocabulary. Any string -- emoji, CJK, combining marks, control characters -- therefore encodes without an
"unknown" token and decodes back to exactly the same string.

Why BPE: start from bytes and repeatedly merge the most frequent adjacent pair into a new token. Frequent
words become single tokens (short sequences), rare words fall back to pieces (a small vocabulary).

The pipeline, the same one the ``tokenizers`` library runs on our ``tokenizer.json``:

1. **special tokens** (``<|endoftext|>``) are cut out of the text first and map to their own ids;
2. **pre-tokenization** splits the rest with :data:`PRETOKENIZE_PATTERN` into words, numbers, punctuation
   runs and whitespace runs. Merges never cross a pre-token boundary, which is what makes encoding
   cacheable per pre-token;
3. **BPE** turns each pre-token's bytes into ids by applying the learned merges, lowest rank first.

The pattern is deliberately ASCII-only. GPT-2's pattern uses ``\\p{L}`` / ``\\p{N}``, which Python's ``re``
does not support, and ``\\s`` means different things in Python (Unicode whitespace) and in Oniguruma (the
engine behind ``tokenizers``). With explicit character sets both engines split every string identically,
so the reference test can demand identical ids. Non-ASCII letters simply fall into the "other" class; that
costs a little compression on non-English text and nothing in correctness.

stdlib only for this pattern (no ``regex``, no ``tokenizers`` at runtime); a real model's standard pre-tokenizer
comes from :mod:`minienv.pretokenizers`. Reading a ``tokenizer.json`` safely is :mod:`minienv.tokenizer_json`'s job.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from minienv.tokenizer_json import (
    TokenizerError,
    check_dense_ids,
    check_pipeline,
    read_added_tokens,
    read_bpe_model,
    read_json_object,
    read_merges,
    read_vocab,
)

__all__ = ["BPETokenizer", "PRETOKENIZE_PATTERN", "TokenizerError", "bytes_to_unicode", "load_tokenizer",
           "pretokenize"]

# Whitespace spelled out: the six ASCII whitespace characters, written with escapes both engines read alike.
_WS = r" \t\n\r\x0b\x0c"
#: The pre-tokenizer: contractions ('s 't 'd 'm 'll 've 're -- "perform'd" is everywhere in Shakespeare),
#: words with an optional leading space, numbers, runs of other characters, and whitespace runs (a run that is
#: followed by a word leaves its last space to that word, so " the" stays one pre-token).
PRETOKENIZE_PATTERN = (
    r"'(?:[sdmt]|ll|ve|re)"
    r"| ?[A-Za-z]+"
    r"| ?[0-9]+"
    rf"| ?[^{_WS}A-Za-z0-9]+"
    rf"|[{_WS}]+(?![^{_WS}])"
    rf"|[{_WS}]+"
)
_PRETOKENIZE_RE = re.compile(PRETOKENIZE_PATTERN)


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into pre-tokens (no special-token handling). ``"".join(result) == text``.

    Mirrors ``Split(pattern, behavior="isolated")`` in ``tokenizers``: matches and the (here always empty)
    gaps between them both become pieces.
    """
    pieces: list[str] = []
    pos = 0
    for m in _PRETOKENIZE_RE.finditer(text):
        if m.start() > pos:  # never happens with this pattern, kept for fidelity with "isolated"
            pieces.append(text[pos : m.start()])
        pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ``ByteLevel`` alphabet).

    ``tokenizer.json`` stores tokens as strings, and raw bytes such as ``0x0a`` or ``0x20`` would be invisible
    or clash with the space that separates a merge pair. Printable bytes map to themselves; the rest are moved
    up to code points 256+. So ``" the"`` is stored as ``"Ġthe"`` and a newline as ``"Ċ"``.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _token_str(raw: bytes) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in raw)


def _token_bytes(token: str) -> bytes:
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError as exc:
        raise ValueError(f"token {token!r} is not in the byte-level alphabet") from exc


def _merge_word(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """Replace every non-overlapping (a, b), left to right, by ``new``."""
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _utf8_or_none(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


class BPETokenizer:
    """A byte-level BPE tokenizer.

    Ids ``0..255`` are the single bytes (in byte order), then one id per learned merge (in the order the merges
    were learned, which is also their priority), then the special tokens.

    Build one with :meth:`train` or :meth:`load`; use :meth:`encode` / :meth:`decode`.
    """

    def __init__(self, merges: Sequence[tuple[int, int]], special_tokens: Sequence[str] = ("<|endoftext|>",)) -> None:
        """Build from merge pairs of ids in the layout ``[256 bytes][merges][specials]``.

        Prefer :meth:`train` or :meth:`load`; :meth:`load` keeps whatever id layout the file has.
        """
        vocab: list[bytes | None] = [bytes([b]) for b in range(256)]
        for a, b in merges:
            vocab.append(vocab[a] + vocab[b])  # type: ignore[operator]
        merged_ids = list(range(256, 256 + len(merges)))
        special_ids = list(range(len(vocab), len(vocab) + len(special_tokens)))
        vocab += [None] * len(special_tokens)
        self._setup(vocab, list(range(256)), [tuple(m) for m in merges], merged_ids,
                    dict(zip(special_tokens, special_ids)))

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def _from_layout(
        cls,
        id_bytes: list[bytes | None],
        byte_ids: list[int],
        merges: list[tuple[int, int]],
        merged_ids: list[int],
        specials: dict[str, int],
    ) -> "BPETokenizer":
        self = cls.__new__(cls)
        self._setup(id_bytes, byte_ids, merges, merged_ids, specials)
        return self

    def _setup(self, id_bytes, byte_ids, merges, merged_ids, specials) -> None:
        self._id_bytes: list[bytes | None] = id_bytes  # None for special tokens
        self._byte_ids: list[int] = byte_ids  # byte value -> id
        self.merges: list[tuple[int, int]] = merges  # by rank
        #: (left id, right id) -> (rank, merged id)
        self._merge_rank: dict[tuple[int, int], tuple[int, int]] = {
            pair: (rank, new) for rank, (pair, new) in enumerate(zip(merges, merged_ids))
        }
        self.special_tokens: dict[str, int] = dict(specials)
        self._special_by_id = {i: s for s, i in self.special_tokens.items()}
        self._token_strs: list[str] = [
            self._special_by_id[i] if raw is None else _token_str(raw) for i, raw in enumerate(id_bytes)
        ]
        self._str_to_id = {s: i for i, s in enumerate(self._token_strs)}
        #: every token's exact bytes by id (:meth:`id_to_bytes` without its checks, for per-token hot paths)
        self.token_bytes: tuple[bytes, ...] = tuple(
            self._special_by_id[i].encode("utf-8") if raw is None else raw for i, raw in enumerate(id_bytes))
        #: each token's text when its bytes are complete UTF-8 on their own, else None (it starts or ends inside a
        #: character): what an incremental decoder with nothing pending returns for it
        self.token_texts: tuple[str | None, ...] = tuple(_utf8_or_none(b) for b in self.token_bytes)
        if self.special_tokens:
            # longest first, so a special token that contains another wins
            alts = sorted(self.special_tokens, key=len, reverse=True)
            self._special_re: re.Pattern[str] | None = re.compile("|".join(re.escape(s) for s in alts))
        else:
            self._special_re = None
        self._cache: dict[str, tuple[int, ...]] = {}
        #: how text is cut into pre-tokens before BPE: minienv's own ASCII pattern unless :meth:`from_vocab` named a
        #: standard one (:mod:`minienv.pretokenizers`)
        self._split = _PRETOKENIZE_RE.findall
        self.pre_tokenizer = "minienv"
        self._eos_override: int | None = None

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], merges: Sequence[str], special_ids: Sequence[int], *,
                   pre_tokenizer: str, eos_token_id: int | None = None, source: str = "vocabulary") -> "BPETokenizer":
        """A tokenizer from a vocabulary in the byte-level alphabet (id = position), its merges (``"left right"``,
        by rank) and the ids of its special tokens, pre-tokenizing as the standard ``pre_tokenizer`` named (see
        :data:`minienv.pretokenizers.PRE_TOKENIZERS`, e.g. ``"gpt2"`` or ``"smollm"``): what a GGUF file's
        ``tokenizer.ggml.*`` metadata describes. ``eos_token_id`` is where generation stops (a chat model's
        end-of-turn token, not necessarily ``<|endoftext|>``). Problems are :class:`TokenizerError` naming ``source``.
        """
        from minienv.pretokenizers import get_pre_tokenizer

        try:
            split = get_pre_tokenizer(pre_tokenizer)
        except ValueError as exc:
            raise TokenizerError(f"{source}: {exc}") from exc
        specials = {tokens[i]: i for i in special_ids}
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError(f"{source}: the vocabulary repeats a token")
        id_bytes: list[bytes | None] = [None] * len(tokens)
        for i, tok in enumerate(tokens):
            if i not in specials.values():
                try:
                    id_bytes[i] = _token_bytes(tok)
                except ValueError as exc:
                    raise TokenizerError(f"{source}: {exc}") from exc
        byte_ids = []
        for b in range(256):
            ch = _BYTE_TO_CHAR[b]
            # A byte-level vocabulary may lack bytes that never occur in its training text (SmolLM2 lacks 21: a
            # few control characters and bytes that are never valid UTF-8); `tokenizers` drops such a byte (there
            # is no unknown token), and so does :meth:`_bpe` (id -1 marks it).
            byte_ids.append(vocab.get(ch, -1))
        if byte_ids.count(-1) > 128:
            raise TokenizerError(f"{source}: {byte_ids.count(-1)} of the 256 byte tokens are missing; not a "
                                 "byte-level vocabulary")
        pairs, merged_ids = read_merges(Path(source), {"merges": list(merges)}, vocab)
        self = cls._from_layout(id_bytes, byte_ids, pairs, merged_ids, specials)
        self._split, self.pre_tokenizer = split, pre_tokenizer
        if eos_token_id is not None:
            self._check_id(eos_token_id)
            self._eos_override = int(eos_token_id)
        return self

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        special_tokens: Sequence[str] = ("<|endoftext|>",),
        *,
        verbose: bool = False,
    ) -> "BPETokenizer":
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``text``.

        Each step merges the most frequent adjacent pair of tokens inside pre-tokens; ties go to the pair
        whose bytes sort first, so training is deterministic. Pair counts are updated incrementally (only
        the words containing the merged pair are touched) and the best pair comes from a lazy max-heap, so
        a few MB of text trains in seconds rather than minutes.
        """
        if not isinstance(text, str):
            raise TypeError(f"train() needs a str, got {type(text).__name__}")
        n_merges = vocab_size - 256 - len(special_tokens)
        if n_merges < 0:
            raise ValueError(f"vocab_size={vocab_size} is smaller than 256 bytes + {len(special_tokens)} specials")
        if len(set(special_tokens)) != len(special_tokens) or any(not s for s in special_tokens):
            raise ValueError("special tokens must be distinct, non-empty strings")

        # word counts over pre-tokens; special tokens are cut out so no merge learns across them
        counts: Counter[str] = Counter()
        chunks = [text]
        if special_tokens:
            splitter = re.compile("|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True)))
            chunks = splitter.split(text)
        for chunk in chunks:
            counts.update(pretokenize(chunk))

        words: list[list[int]] = [list(w.encode("utf-8")) for w in counts]
        freqs: list[int] = list(counts.values())
        vocab: list[bytes] = [bytes([b]) for b in range(256)]

        pair_counts: dict[tuple[int, int], int] = {}
        where: dict[tuple[int, int], set[int]] = {}
        for wi, (w, f) in enumerate(zip(words, freqs)):
            for pair in zip(w, w[1:]):
                pair_counts[pair] = pair_counts.get(pair, 0) + f
                where.setdefault(pair, set()).add(wi)

        def key(pair: tuple[int, int]) -> tuple:
            return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]])

        heap = [(*key(p), p) for p in pair_counts]
        heapq.heapify(heap)

        merges: list[tuple[int, int]] = []
        while len(merges) < n_merges and heap:
            neg, _, _, pair = heapq.heappop(heap)
            current = pair_counts.get(pair, 0)
            if current <= 0:
                continue
            if -neg != current:  # stale entry: re-push with the current count
                heapq.heappush(heap, (*key(pair), pair))
                continue
            a, b = pair
            new = len(vocab)
            vocab.append(vocab[a] + vocab[b])
            merges.append(pair)
            if verbose and len(merges) % 200 == 0:
                print(f"  merge {len(merges)}/{n_merges}: {vocab[new]!r} ({current})")
            touched: set[tuple[int, int]] = set()
            for wi in list(where.get(pair, ())):
                w, f = words[wi], freqs[wi]
                for p in zip(w, w[1:]):  # remove this word's old pairs ...
                    pair_counts[p] -= f
                    touched.add(p)
                w2 = list(_merge_word(tuple(w), a, b, new))
                words[wi] = w2
                for p in zip(w, w[1:]):
                    s = where.get(p)
                    if s is not None:
                        s.discard(wi)
                for p in zip(w2, w2[1:]):  # ... and add its new ones
                    pair_counts[p] = pair_counts.get(p, 0) + f
                    where.setdefault(p, set()).add(wi)
                    touched.add(p)
            pair_counts.pop(pair, None)
            where.pop(pair, None)
            for p in touched:
                if pair_counts.get(p, 0) > 0:
                    heapq.heappush(heap, (*key(p), p))
        return cls(merges, special_tokens)

    # -- properties ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding rows)."""
        return len(self._token_strs)

    @property
    def eos_token_id(self) -> int | None:
        """Where generation stops: ``<|endoftext|>`` (documents are joined with it in training), unless the model's
        file names another end token (a chat model's ``<|im_end|>``)."""
        if self._eos_override is not None:
            return self._eos_override
        return self.special_tokens.get("<|endoftext|>")

    def id_to_token(self, token_id: int) -> str:
        """The token's *text* (bytes decoded leniently), e.g. ``" the"`` -- what the colored-token view shows."""
        self._check_id(token_id)
        raw = self._id_bytes[token_id]
        return self._special_by_id[token_id] if raw is None else raw.decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes of a token (a token may hold part of a multi-byte character)."""
        self._check_id(token_id)
        raw = self._id_bytes[token_id]
        return self._special_by_id[token_id].encode("utf-8") if raw is None else raw

    def id_to_stored(self, token_id: int) -> str:
        """The token as stored in ``tokenizer.json`` (byte-level alphabet, e.g. ``"Ġthe"``)."""
        self._check_id(token_id)
        return self._token_strs[token_id]

    def token_to_id(self, token: str) -> int:
        """Inverse of :meth:`id_to_token` for tokens whose bytes are valid UTF-8; also accepts the stored form."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, got {type(token).__name__}")
        if token in self.special_tokens:
            return self.special_tokens[token]
        stored = _token_str(token.encode("utf-8"))
        if stored in self._str_to_id:
            return self._str_to_id[stored]
        if token in self._str_to_id:
            return self._str_to_id[token]
        raise ValueError(f"{token!r} is not a single token in this vocabulary")

    def _check_id(self, token_id: int) -> None:
        if isinstance(token_id, bool) or not isinstance(token_id, (int,)) and not hasattr(token_id, "__index__"):
            raise TypeError(f"token id must be an int, got {type(token_id).__name__}")
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"unknown token id {int(token_id)} (vocab_size={self.vocab_size})")

    # -- encode / decode -----------------------------------------------------------------------------------

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-token: start from bytes, apply the lowest-rank merge present until none applies."""
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = [self._byte_ids[b] for b in piece.encode("utf-8")]
        if -1 in word:  # a byte the vocabulary lacks is dropped, and merges join its neighbours (as `tokenizers`)
            word = [t for t in word if t != -1]
        result = self._merge(word)
        if len(self._cache) < 500_000:
            self._cache[piece] = tuple(result)
        return tuple(result)

    def _merge(self, word: list[int]) -> list[int]:
        """Apply the lowest-rank merge present until none applies."""
        ranks = self._merge_rank
        while len(word) > 1:
            best = None
            for pair in zip(word, word[1:]):
                r = ranks.get(pair)
                if r is not None and (best is None or r[0] < best[0]):
                    best = r
                    best_pair = pair
            if best is None:
                break
            word = list(_merge_word(tuple(word), best_pair[0], best_pair[1], best[1]))
        return word

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        for piece in self._split(text):  # the pattern covers every character, see pretokenize()
            out.extend(self._bpe(piece))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text map to their ids (as in ``tokenizers``)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        out: list[int] = []
        if self._special_re is None:
            self._encode_ordinary(text, out)
            return out
        pos = 0
        for m in self._special_re.finditer(text):
            self._encode_ordinary(text[pos : m.start()], out)
            out.append(self.special_tokens[m.group()])
            pos = m.end()
        self._encode_ordinary(text[pos:], out)
        return out

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Bytes that do not form valid UTF-8 (a cut in the middle of a character) become
        U+FFFD, as in ``tokenizers``; the ids of any encoded string decode back to exactly that string."""
        if isinstance(ids, (str, bytes)):
            raise TypeError("decode() needs a sequence of int ids, not a string")
        chunks: list[bytes] = []
        n = self.vocab_size
        id_bytes = self._id_bytes
        for i in ids:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise TypeError(f"token ids must be ints, got {type(i).__name__}")
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"unknown token id {i} (vocab_size={n})")
            raw = id_bytes[i]
            if raw is None:
                if skip_special_tokens:
                    continue
                raw = self._special_by_id[i].encode("utf-8")
            chunks.append(raw)
        return b"".join(chunks).decode("utf-8", errors="replace")

    def tokens(self, text: str) -> list[str]:
        """The text of each token of ``text`` (for display)."""
        return [self.id_to_token(i) for i in self.encode(text)]

    # -- tokenizer.json ------------------------------------------------------------------------------------

    def to_hf_dict(self) -> dict:
        """The ``tokenizer.json`` structure that ``tokenizers.Tokenizer.from_file`` reads."""
        if self.pre_tokenizer != "minienv":
            raise TokenizerError(f"only minienv's own pre-tokenizer is written to tokenizer.json, not "
                                 f"{self.pre_tokenizer!r} (this tokenizer came from a model file: keep that file)")
        vocab = {s: i for i, s in enumerate(self._token_strs)}
        merges = [[self._token_strs[a], self._token_strs[b]] for a, b in self.merges]
        added = [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for s, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": PRETOKENIZE_PATTERN}, "behavior": "Isolated",
                     "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
                ],
            },
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": vocab, "merges": merges,
            },
        }

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` (HF format). ``path`` may be a file or a directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_dict(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """Read a ``tokenizer.json`` written by :meth:`save` (or any file with the same pipeline).

        Only the pipeline minienv implements is accepted -- byte-level BPE behind our Split pattern -- and any
        other file fails loudly here rather than encoding differently from ``tokenizers`` later. Every problem is
        a :class:`TokenizerError` naming the file. Ids must fill a dense range ``[0, n)``; that is checked before
        anything of size ``n`` is allocated, so a stray huge id costs nothing.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        data = read_json_object(path)
        model = read_bpe_model(path, data)
        check_pipeline(path, data, PRETOKENIZE_PATTERN)
        vocab = read_vocab(path, model)
        specials = read_added_tokens(path, data, vocab)
        size = check_dense_ids(path, vocab, specials)
        id_bytes: list[bytes | None] = [None] * size
        for tok, i in vocab.items():
            if specials.get(tok) != i:
                try:
                    id_bytes[i] = _token_bytes(tok)
                except ValueError as exc:
                    raise TokenizerError(f"{path}: {exc}") from exc
        byte_ids = []
        for b in range(256):
            ch = _BYTE_TO_CHAR[b]
            if ch not in vocab:
                raise TokenizerError(f"{path}: byte token {ch!r} missing; not a byte-level vocabulary")
            byte_ids.append(vocab[ch])
        merges, merged_ids = read_merges(path, model, vocab)
        return cls._from_layout(id_bytes, byte_ids, merges, merged_ids, specials)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BPETokenizer):
            return NotImplemented
        return (self._token_strs == other._token_strs and self.merges == other.merges
                and self.special_tokens == other.special_tokens)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")


def load_tokenizer(path: str | Path | None = None) -> BPETokenizer:
    """Load a tokenizer; with no ``path``, the bundled ``assets/tokenizer.json``."""
    if path is None:
        from minienv.paths import assets_dir

        path = assets_dir() / "tokenizer.json"
    return BPETokenizer.load(path)
