"""Where records live: an embedded SQLite store (the default, no server) and a Redis store (shared by instances).

Both keep the same structure: records keyed by block key, each remembering its parent key and how many stored
children it has. That is what makes eviction safe for chains:

1. **no orphans** — a block is stored only if its parent is (or it is a sequence's first block), checked in the
   same transaction as the write. A child without its parent is useless: nobody can reach it, because a lookup
   walks the chain from the root and stops at the first miss.
2. **evict chain tails first** — only *leaves* (records with no stored child) are eviction candidates, least
   recently used first; evicting a leaf may make its parent a leaf. So eviction shortens prefixes from the end and
   never cuts one in the middle (which would strand every later block).
3. **LRU refresh on hit** — every record returned by :meth:`TierStore.get_many` gets a fresh access stamp (the
   SQLite store skips the refresh rather than wait when another process holds the write lock: a stale stamp
   costs an eviction order, waiting costs a step).
4. **never half visible** — a record, its metadata and the byte count change in one SQLite transaction / one Redis
   Lua script (Redis runs a script atomically), so a concurrent reader sees the old state or the new one.
5. ``bytes_used <= capacity_bytes`` after every write (a record bigger than the whole capacity is refused).

Why SQLite for the embedded store rather than one file per block with atomic rename: the record, its parent link,
its children count, the LRU stamp and the byte total must change *together*, and leaf-first LRU eviction is one
indexed query. With files, rename makes one record atomic but the index beside it would need its own crash-safe
bookkeeping — a database by hand. SQLite ships with Python, serializes writers from many processes with a file
lock (WAL mode lets readers run alongside), and its transactions survive a crash mid-write.

**A step never waits for another process's lock for long.** SQLite serializes writers with a file lock; a
process that holds a write transaction open makes every other writer wait for the connection's busy timeout.
After construction (which may wait ``timeout_s``), the SQLite store's operations wait at most ``lock_timeout_s``
(50 ms by default): lookups and record reads need no lock in WAL mode, an LRU refresh that cannot get the lock is
skipped, and a write that cannot is a transient :class:`TierBackendError` — the connector then leaves the tier
alone for ``retry_interval_s``. So a lock held for minutes costs at most one ``lock_timeout_s`` stall per retry
interval instead of a ``timeout_s`` stall per admission.

Errors: a store that cannot be opened or used raises :class:`TierConfigError` at construction, naming the path or
URL; a failure during use raises :class:`TierBackendError` (``permanent=True`` when it ran out of space or became read-only),
which the connector counts and survives.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from minienv.kv.hashing import ROOT_HASH

__all__ = ["PutResult", "RedisStore", "SQLiteStore", "TierBackendError", "TierConfigError", "TierStore",
           "open_store"]

SCHEMA_VERSION = 1
DB_NAME = "kv_tier.sqlite3"


class TierConfigError(ValueError):
    """The tier cannot be used as configured (a path that is a file, an unwritable place, a bad Redis URL...)."""


class TierBackendError(RuntimeError):
    """The store failed during use. ``permanent``: it will not get better by waiting (out of space, read-only),
    so the connector switches the tier off; otherwise (Redis down, a lock timeout) it retries later."""

    def __init__(self, message: str, *, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class PutResult:
    """``status``: "stored", "replaced", "present" (already there), "orphan" (parent not stored), "too_big"."""

    status: str
    evicted: int = 0


class TierStore(Protocol):
    kind: str
    capacity_bytes: int | None

    def contains_prefix(self, keys: Sequence[bytes]) -> int: ...
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...
    def put(self, key: bytes, parent: bytes, record: bytes, *, replace: bool = False) -> PutResult: ...
    def usage(self) -> tuple[int, int]: ...
    def evictions(self) -> int: ...
    def close(self) -> None: ...


def _check_capacity(capacity_bytes: int | None) -> int | None:
    if capacity_bytes is None:
        return None
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise TierConfigError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
    return capacity_bytes


# ---------------------------------------------------------------------- SQLite
class SQLiteStore:
    """Records in ``<directory>/kv_tier.sqlite3``; see the module docstring for the invariants.

    ``directory`` is created if missing. A path that is a file, a place that cannot be written, or a database file
    that is not this store's raises :class:`TierConfigError` here, before any request runs.
    """

    kind = "sqlite"

    def __init__(self, directory: str | os.PathLike, *, capacity_bytes: int | None = None, timeout_s: float = 10.0,
                 lock_timeout_s: float = 0.05):
        self.capacity_bytes = _check_capacity(capacity_bytes)
        for name, value in (("timeout_s", timeout_s), ("lock_timeout_s", lock_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TierConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
        self.lock_timeout_s = float(lock_timeout_s)
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise TierConfigError(f"KV tier path {str(path)!r} is a file; the tier needs a directory to keep "
                                  f"{DB_NAME} in")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierConfigError(f"cannot create the KV tier directory {str(path)!r}: {exc.strerror or exc}") from exc
        self.directory = path
        self.path = path / DB_NAME
        self.lru_refresh_skipped = 0  #: hits whose LRU refresh was skipped because another process held the lock
        try:
            # check_same_thread=False: an engine may be built in one thread and stepped in another (a server's
            # worker); it is never stepped from two at once, so one connection is used by one thread at a time.
            self._db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise TierConfigError(f"{self.path} has store schema version {version}; this minienv reads "
                                      f"{SCHEMA_VERSION} (use another directory or delete the file)")
            with self._write():
                self._db.execute("CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, parent BLOB NOT NULL, "
                                 "record BLOB NOT NULL, nbytes INTEGER NOT NULL, last_access INTEGER NOT NULL, "
                                 "children INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID")
                self._db.execute("CREATE INDEX IF NOT EXISTS leaves ON blocks(children, last_access)")
                self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('clock', 0), ('bytes', 0), ('evictions', 0)")
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # from now on a step waits for another process's write lock at most this long (module docstring)
            self._db.execute(f"PRAGMA busy_timeout={int(self.lock_timeout_s * 1000)}")
        except sqlite3.DatabaseError as exc:
            raise TierConfigError(f"cannot use {str(self.path)!r} as a KV tier store: {exc}") from exc

    # -- transactions
    class _Tx:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self):
            self.db.execute("BEGIN IMMEDIATE")  # take the write lock now: no upgrade deadlock between writers
            return self.db

        def __exit__(self, exc_type, exc, tb):
            if exc_type is None:
                self.db.execute("COMMIT")
            elif self.db.in_transaction:  # some errors (SQLITE_FULL) have rolled back already
                self.db.execute("ROLLBACK")
            return False

    def _write(self) -> "_Tx":
        return SQLiteStore._Tx(self._db)

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except sqlite3.Error as exc:
            permanent = any(word in str(exc) for word in ("full", "readonly", "read-only"))
            raise TierBackendError(f"SQLite KV tier {str(self.path)!r}: {exc}", permanent=permanent) from exc

    _RECOUNT = {"clock": "SELECT coalesce(max(last_access), 0) FROM blocks",
                "bytes": "SELECT coalesce(sum(nbytes), 0) FROM blocks", "evictions": "SELECT 0"}

    def _meta(self, name: str) -> int:
        """A counter of the ``meta`` table, validated: the file is shared with other processes, so a row another
        process deleted or overwrote with a non-integer is recounted from the records (and written back inside a
        write transaction) instead of failing a lookup."""
        row = self._db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
        if row is not None and type(row[0]) is int:
            return row[0]
        value = self._db.execute(self._RECOUNT[name]).fetchone()[0]
        if self._db.in_transaction:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))
        return value

    # -- reads
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one). No side effects."""
        if not keys:
            return 0

        def run():
            marks = ",".join("?" * len(keys))
            present = {row[0] for row in self._db.execute(f"SELECT key FROM blocks WHERE key IN ({marks})", keys)}
            n = 0
            while n < len(keys) and keys[n] in present:
                n += 1
            return n
        return self._run(run)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The records of ``keys`` (None where absent); the found ones get a fresh LRU stamp."""
        if not keys:
            return []

        def run():
            marks = ",".join("?" * len(keys))  # a read: WAL mode serves it while another process writes
            found = dict(self._db.execute(f"SELECT key, record FROM blocks WHERE key IN ({marks})", keys).fetchall())
            if found:
                try:
                    with self._write() as db:
                        clock = self._meta("clock") + 1
                        db.execute("UPDATE meta SET value=? WHERE name='clock'", (clock,))
                        db.execute(f"UPDATE blocks SET last_access=? WHERE key IN ({','.join('?' * len(found))})",
                                   (clock, *found))
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) and "busy" not in str(exc):
                        raise
                    self.lru_refresh_skipped += 1  # another process holds the write lock: serve, do not wait
            return [found.get(k) for k in keys]
        return self._run(run)

    # -- writes
    def put(self, key: bytes, parent: bytes, record: bytes, *, replace: bool = False) -> PutResult:
        """Store one record (its parent must be stored, unless it is a first block); evict leaves past capacity."""
        if self.capacity_bytes is not None and len(record) > self.capacity_bytes:
            return PutResult("too_big")

        def run():
            with self._write() as db:
                row = db.execute("SELECT nbytes FROM blocks WHERE key=?", (key,)).fetchone()
                if row is not None and not replace:
                    return PutResult("present")
                clock = self._meta("clock") + 1
                db.execute("UPDATE meta SET value=? WHERE name='clock'", (clock,))
                self._meta("bytes")  # (re)counted if another process removed it: the update below is relative
                if row is not None:  # replace a record refused on load (corrupt): same key, same place in the chain
                    db.execute("UPDATE blocks SET record=?, nbytes=?, last_access=? WHERE key=?",
                               (record, len(record), clock, key))
                    db.execute("UPDATE meta SET value=value+? WHERE name='bytes'", (len(record) - row[0],))
                    status = "replaced"
                else:
                    if parent != ROOT_HASH:
                        if db.execute("SELECT 1 FROM blocks WHERE key=?", (parent,)).fetchone() is None:
                            return PutResult("orphan")
                        db.execute("UPDATE blocks SET children=children+1 WHERE key=?", (parent,))
                    db.execute("INSERT INTO blocks VALUES (?, ?, ?, ?, ?, 0)", (key, parent, record, len(record),
                                                                                clock))
                    db.execute("UPDATE meta SET value=value+? WHERE name='bytes'", (len(record),))
                    status = "stored"
                evicted = self._evict_locked(db)
            return PutResult(status, evicted)
        return self._run(run)

    def _evict_locked(self, db: sqlite3.Connection) -> int:
        if self.capacity_bytes is None:
            return 0
        evicted = 0
        while self._meta("bytes") > self.capacity_bytes:
            victim = db.execute("SELECT key, parent, nbytes FROM blocks WHERE children=0 "
                                "ORDER BY last_access LIMIT 1").fetchone()
            if victim is None:
                break
            key, parent, nbytes = victim
            db.execute("DELETE FROM blocks WHERE key=?", (key,))
            db.execute("UPDATE blocks SET children=children-1 WHERE key=?", (parent,))
            db.execute("UPDATE meta SET value=value-? WHERE name='bytes'", (nbytes,))
            evicted += 1
        if evicted:
            db.execute("UPDATE meta SET value=value+? WHERE name='evictions'", (evicted,))
        return evicted

    # -- observers
    def usage(self) -> tuple[int, int]:
        """``(records, bytes)`` stored."""
        return self._run(lambda: (self._db.execute("SELECT count(*) FROM blocks").fetchone()[0], self._meta("bytes")))

    def evictions(self) -> int:
        return self._run(self._meta, "evictions")

    def records(self) -> list[tuple[bytes, bytes, int, int]]:
        """``(key, parent, children, last_access)`` of every record (tests, notebooks)."""
        return self._run(lambda: self._db.execute(
            "SELECT key, parent, children, last_access FROM blocks ORDER BY last_access").fetchall())

    def raw(self, key: bytes) -> bytes | None:
        """A record's bytes without touching its LRU stamp (tests, notebooks)."""
        row = self._run(lambda: self._db.execute("SELECT record FROM blocks WHERE key=?", (key,)).fetchone())
        return None if row is None else row[0]

    def overwrite_raw(self, key: bytes, record: bytes) -> None:
        """Replace a record's bytes as they are, checksum and all (fault injection in tests and notebooks)."""
        self._run(lambda: self._db.execute("UPDATE blocks SET record=? WHERE key=?", (record, key)))

    def clear(self) -> None:
        """Delete every record (tests, notebooks)."""
        def run():
            with self._write() as db:
                db.execute("DELETE FROM blocks")
                db.execute("UPDATE meta SET value=0 WHERE name='bytes'")
        self._run(run)

    def check_invariants(self) -> None:
        """No orphans, children counts exact, byte total exact, within capacity."""
        rows = self._db.execute("SELECT key, parent, nbytes, children FROM blocks").fetchall()
        keys = {r[0] for r in rows}
        kids: dict[bytes, int] = {}
        for key, parent, _, _ in rows:
            assert parent == ROOT_HASH or parent in keys, f"record {key.hex()[:12]} is stored without its parent"
            kids[parent] = kids.get(parent, 0) + 1
        for key, _, _, children in rows:
            assert children == kids.get(key, 0), f"record {key.hex()[:12]}: children {children} != {kids.get(key, 0)}"
        total = sum(r[2] for r in rows)
        assert total == self._meta("bytes"), f"byte total {self._meta('bytes')} != {total}"
        assert self.capacity_bytes is None or total <= self.capacity_bytes

    def close(self) -> None:
        self._db.close()

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.directory)!r}, capacity_bytes={self.capacity_bytes})"


# ---------------------------------------------------------------------- Redis
# One Lua script per operation: Redis runs a script atomically, so a record and its metadata appear together. A
# script is not rolled back if a command inside fails, so the write script carries a shebang without `allow-oom`:
# a server out of memory refuses it before its first command, never halfway (the read script may refresh LRU stamps).
# Key names: <ns>:rec:<hex> the record; hashes <ns>:parent / :size / :kids (hex -> value); sorted sets <ns>:lru (all
# records by access stamp) and <ns>:leaves (records without stored children, by stamp); counters <ns>:bytes,
# :clock, :evictions.
_LUA_PUT = """#!lua
local ns, key, parent, rec, cap, replace, root = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7]
local rk = ns .. ':rec:' .. key
if redis.call('EXISTS', rk) == 1 then
  if replace ~= '1' then return {0, 0} end
  local old = tonumber(redis.call('HGET', ns .. ':size', key))
  redis.call('SET', rk, rec)
  redis.call('HSET', ns .. ':size', key, #rec)
  redis.call('INCRBY', ns .. ':bytes', #rec - old)
  return {2, 0}
end
if parent ~= root and redis.call('EXISTS', ns .. ':rec:' .. parent) == 0 then return {-1, 0} end
local clock = redis.call('INCR', ns .. ':clock')
redis.call('SET', rk, rec)
redis.call('HSET', ns .. ':parent', key, parent)
redis.call('HSET', ns .. ':size', key, #rec)
redis.call('HSET', ns .. ':kids', key, 0)
redis.call('ZADD', ns .. ':lru', clock, key)
redis.call('ZADD', ns .. ':leaves', clock, key)
if parent ~= root then
  if redis.call('HINCRBY', ns .. ':kids', parent, 1) == 1 then redis.call('ZREM', ns .. ':leaves', parent) end
end
local bytes = redis.call('INCRBY', ns .. ':bytes', #rec)
local evicted = 0
while cap > 0 and bytes > cap do
  local v = redis.call('ZRANGE', ns .. ':leaves', 0, 0)[1]
  if not v then break end
  local p = redis.call('HGET', ns .. ':parent', v)
  bytes = redis.call('INCRBY', ns .. ':bytes', -tonumber(redis.call('HGET', ns .. ':size', v)))
  redis.call('DEL', ns .. ':rec:' .. v)
  redis.call('HDEL', ns .. ':parent', v)
  redis.call('HDEL', ns .. ':size', v)
  redis.call('HDEL', ns .. ':kids', v)
  redis.call('ZREM', ns .. ':lru', v)
  redis.call('ZREM', ns .. ':leaves', v)
  if p ~= root and redis.call('HINCRBY', ns .. ':kids', p, -1) == 0 then
    redis.call('ZADD', ns .. ':leaves', redis.call('ZSCORE', ns .. ':lru', p), p)
  end
  evicted = evicted + 1
end
redis.call('INCRBY', ns .. ':evictions', evicted)
return {1, evicted}
"""

_LUA_GET = """#!lua flags=allow-oom
local ns = ARGV[1]
local out = {}
local clock = nil
for i = 2, #ARGV do
  local key = ARGV[i]
  local rec = redis.call('GET', ns .. ':rec:' .. key)
  if rec then
    if not clock then clock = redis.call('INCR', ns .. ':clock') end
    redis.call('ZADD', ns .. ':lru', 'XX', clock, key)
    redis.call('ZADD', ns .. ':leaves', 'XX', clock, key)
    out[#out + 1] = rec
  else
    out[#out + 1] = false
  end
end
return out
"""


class RedisStore:
    """Records in a Redis server under ``namespace``; same invariants as :class:`SQLiteStore`.

    The URL is checked and the server pinged here: a malformed URL, a bad port, an unknown host or nobody
    listening raises :class:`TierConfigError`. Later failures (the server went away) raise
    :class:`TierBackendError`; redis-py reconnects by itself on the next command once the server is back.
    Retries are off (one attempt per command): the connector decides when to try again, so a dead server costs
    one refused connection per attempt, not a backoff loop inside a request's step.
    """

    kind = "redis"

    def __init__(self, url: str, *, capacity_bytes: int | None = None, namespace: str = "minienv:kv",
                 socket_timeout_s: float = 2.0):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TierConfigError("the Redis KV tier needs redis-py: pip install 'minienv[tier]'") from exc
        self.capacity_bytes = _check_capacity(capacity_bytes)
        if not isinstance(url, str) or not url:
            raise TierConfigError(f"Redis URL must be a non-empty str like 'redis://127.0.0.1:6379/0', got {url!r}")
        if not isinstance(namespace, str) or not namespace or ":rec:" in namespace:
            raise TierConfigError(f"namespace must be a non-empty str without ':rec:', got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self._errors = redis.exceptions.RedisError
        try:
            self._r = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0))
        except ValueError as exc:
            raise TierConfigError(f"bad Redis URL {url!r}: {exc}") from exc
        try:
            self._r.ping()
            self._put = self._r.register_script(_LUA_PUT)
            self._get = self._r.register_script(_LUA_GET)
        except redis.exceptions.RedisError as exc:
            raise TierConfigError(f"cannot reach Redis at {url!r}: {exc}") from exc

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as exc:
            permanent = any(word in str(exc) for word in ("OOM", "maxmemory", "READONLY"))
            raise TierBackendError(f"Redis KV tier {self.url!r}: {type(exc).__name__}: {exc}",
                                   permanent=permanent) from exc

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def run():
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(f"{self.namespace}:rec:{k.hex()}")
            n = 0
            for present in pipe.execute():
                if not present:
                    break
                n += 1
            return n
        return self._run(run)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        out = self._run(lambda: self._get(args=[self.namespace, *(k.hex() for k in keys)]))
        return [r if r else None for r in out]

    def put(self, key: bytes, parent: bytes, record: bytes, *, replace: bool = False) -> PutResult:
        if self.capacity_bytes is not None and len(record) > self.capacity_bytes:
            return PutResult("too_big")
        code, evicted = self._run(lambda: self._put(args=[self.namespace, key.hex(), parent.hex(), record,
                                                          self.capacity_bytes or 0, "1" if replace else "0",
                                                          ROOT_HASH.hex()]))
        status = {0: "present", 1: "stored", 2: "replaced", -1: "orphan"}[int(code)]
        return PutResult(status, int(evicted))

    def usage(self) -> tuple[int, int]:
        return self._run(lambda: (int(self._r.zcard(f"{self.namespace}:lru")),
                                  int(self._r.get(f"{self.namespace}:bytes") or 0)))

    def evictions(self) -> int:
        return self._run(lambda: int(self._r.get(f"{self.namespace}:evictions") or 0))

    def raw(self, key: bytes) -> bytes | None:
        return self._run(self._r.get, f"{self.namespace}:rec:{key.hex()}")

    def overwrite_raw(self, key: bytes, record: bytes) -> None:
        self._run(lambda: self._r.set(f"{self.namespace}:rec:{key.hex()}", record, xx=True))

    def clear(self) -> None:
        """Delete every key of this namespace (tests, notebooks)."""
        def run():
            for k in self._r.scan_iter(match=f"{self.namespace}:*", count=1000):
                self._r.delete(k)
        self._run(run)

    def check_invariants(self) -> None:
        ns, r = self.namespace, self._r
        parents = {k.decode(): v.decode() for k, v in r.hgetall(f"{ns}:parent").items()}
        kids = {k.decode(): int(v) for k, v in r.hgetall(f"{ns}:kids").items()}
        sizes = {k.decode(): int(v) for k, v in r.hgetall(f"{ns}:size").items()}
        root = ROOT_HASH.hex()
        counted: dict[str, int] = {}
        for key, parent in parents.items():
            assert r.exists(f"{ns}:rec:{key}"), f"metadata without record {key[:12]}"
            assert parent == root or parent in parents, f"record {key[:12]} is stored without its parent"
            counted[parent] = counted.get(parent, 0) + 1
        for key in parents:
            assert kids[key] == counted.get(key, 0), f"record {key[:12]}: children {kids[key]}"
        leaves = {k.decode() for k in r.zrange(f"{ns}:leaves", 0, -1)}
        assert leaves == {k for k in parents if kids[k] == 0}, "leaf set out of step"
        total = sum(sizes.values())
        assert total == int(r.get(f"{ns}:bytes") or 0)
        assert self.capacity_bytes is None or total <= self.capacity_bytes

    def close(self) -> None:
        self._r.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, namespace={self.namespace!r}, capacity_bytes={self.capacity_bytes})"


def open_store(spec: object, *, capacity_bytes: int | None = None) -> TierStore:
    """A store from a spec: a store object as is, ``"redis://..."`` -> :class:`RedisStore`, a path ->
    :class:`SQLiteStore` (a directory). Anything else is a :class:`TierConfigError`."""
    if hasattr(spec, "get_many") and hasattr(spec, "put"):
        return spec  # type: ignore[return-value]
    if isinstance(spec, str) and spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, capacity_bytes=capacity_bytes)
    if isinstance(spec, (str, os.PathLike)) and str(spec):
        return SQLiteStore(spec, capacity_bytes=capacity_bytes)
    raise TierConfigError(f"kv_tier must be a directory path, a 'redis://host:port/db' URL or a store object, "
                          f"got {spec!r}")
