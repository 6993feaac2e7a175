"""The worker's durable local spool: ledger records that wait while the ledger is down or behind its schema.

When a usage, GPU-busy or adapter-load write fails for a reason the ledger cannot fix by itself (the
database is unreachable, or its schema is missing or older than this code), the records go into a
SQLite file beside the worker, in one fsynced transaction, and the messages they answer count as done:
their results are published once and their offsets commit. A flusher writes the spooled records to the
ledger, oldest first, once it answers again; the ledger's idempotent keys make a flush that is
interrupted and retried add nothing twice. The worker pauses fetching while the spool holds
`max_records` or more, so an outage of any length costs disk up to a bound, never records.

Usage records keep their (tenant_id, request_id) in columns, so a resubmitted job whose first answer is
still spooled is answered from here (the ledger cannot see it yet).

Files of workers that are gone. A worker restarted under another id, or one of many short-lived workers, leaves its
file in the folder; the flusher of a worker beside it writes what it holds into the ledger (consumer.delivery
`flush_others`) and then deletes it (`remove_if_abandoned`). Who has a file open is told by a lock file beside it,
`<file>.lock` (flock): every worker that opens a spool, its own or another's, holds it shared for as long as it has
the file open, and a file is deleted only under the lock held exclusively, so never while any process has it open (a
deleted file's records would live only as long as that process). The kernel releases a killed worker's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord

log = logging.getLogger(__name__)

KINDS: dict[str, type] = {"usage": UsageRecord, "busy": BusyRecord, "load": AdapterLoadRecord}
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}
_TIMES = {f.name for cls in KINDS.values() for f in dataclasses.fields(cls) if f.type in ("datetime", datetime)}


def _encode(record) -> str:
    d = dataclasses.asdict(record)
    return json.dumps({k: v.isoformat() if isinstance(v, datetime) else v for k, v in d.items()})


def encode_record(record) -> tuple[str, str]:
    """A ledger record as the spool keeps it: its kind ("usage", "busy", "load") and its fields as JSON (times in ISO)."""
    return _KIND_OF[type(record)], _encode(record)


def _decode(kind: str, body: str):
    d = json.loads(body)
    return KINDS[kind](**{k: datetime.fromisoformat(v) if k in _TIMES and v is not None else v for k, v in d.items()})


def _readable(kind: str, body: str):
    """The record a row holds; None where this version cannot read it (a kind or field of another lorabatch's)."""
    try:
        return _decode(kind, body)
    except (KeyError, TypeError, ValueError):  # ValueError: JSON or a time that is not one
        return None


class SpoolNoSpace(Exception):
    """The spool file cannot be opened because its disk is full: a worker waits for space at start (`lorabatch worker`)
    rather than exit, which an orchestrator turned into a crash loop for as long as the disk stayed full."""

    retriable = True


def _no_space(e: BaseException, folder: Path) -> bool:
    """Whether opening a SQLite file in `folder` failed for want of space. SQLite says so (SQLITE_FULL) when a write
    finds the disk full, but an I/O error (SQLITE_IOERR_SHMSIZE) when a WAL file's shared memory cannot be made: that one
    is taken for a full disk when the disk has less than a MiB free."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    if code == sqlite3.SQLITE_FULL:
        return True
    try:
        return code == sqlite3.SQLITE_IOERR and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def _damaged(e: BaseException) -> bool:
    """Whether a spool call failed because its file is damaged under the worker (truncated, overwritten, replaced by
    something that is not SQLite): SQLITE_CORRUPT or SQLITE_NOTADB, or its table gone (a file truncated to nothing reads
    as an empty database)."""
    if not isinstance(e, sqlite3.DatabaseError):
        return False
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    return code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB) or "no such table: spool" in str(e)


def open_fix(e: BaseException, path: Path, key: str) -> str:
    """What to do about a spool file at `path` that cannot be opened for `e`; `key`: the setting that names it. A damaged
    file was said as a folder not writable, and the advice to point `key` elsewhere abandoned its records unsaid."""
    text = str(e)
    if isinstance(e, sqlite3.DatabaseError) and (not isinstance(e, sqlite3.OperationalError) or "no such " in text):
        return (f"it is damaged, or another program's file (not a spool of this lorabatch): move it aside and start "
                f"again; ledger records it holds are not in the ledger (`sqlite3 {path} .recover` salvages what it can)")
    return f"set {key} to a file in a writable folder"


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _hold(path: Path, how: int) -> int | None:
    """The lock file of the spool at `path`, open and flock'ed `how` (made, with its folder, if missing); None where
    LOCK_NB was asked and another holds it. A lock taken on a lock file that a sweeper deleted meanwhile is taken again
    on the one now at the path, so two processes never hold locks on two different files for one spool."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    return fd
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


class Spool:
    """A bounded, durable FIFO of ledger records in one SQLite file (thread-safe; calls are short)."""

    def __init__(self, path: str | Path, max_records: int, ledger: str = "", *, _held: int | None = None):
        """`ledger`: which ledger the records are for (a URL without its password), kept in the file, so that another
        worker flushes them only into the same one (`existing`); "" for none. `_held`: its lock file, held already."""
        assert max_records >= 1, max_records
        self.path = Path(path)
        self.ledger = ledger
        self.max_records = max_records
        self._lock = threading.Lock()
        self._carry: list[tuple] = []  # records of a file deleted while open, not yet written into its replacement
        self._unreadable: set[int] = set()  # ids of rows another lorabatch wrote that this one cannot read (`oldest`)
        self._lock_fd = _held
        try:
            if self._lock_fd is None:  # shared: never deleted while open (module docstring), whoever else opens it
                self._lock_fd = _hold(self.path, fcntl.LOCK_SH)
            self._db, self._inode = self._open()  # its folder made first: on a full disk that may fail too (ENOSPC)
            self._known = self._count()  # the last count (`known`)
        except (OSError, sqlite3.Error) as e:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            if _no_space(e, self.path.parent):
                raise SpoolNoSpace(f"the spool file {self.path} cannot be opened: its disk is full ({e}); free space "
                                   "there, or set worker.spool_path to a file on another disk") from e
            raise

    def _open(self) -> tuple[sqlite3.Connection, int]:
        """A connection to the file at `path` (made, with its folder, if missing) and the file's inode."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a spooled record survives a crash of the machine
        db.execute(
            "CREATE TABLE IF NOT EXISTS spool (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, "
            "tenant_id TEXT, request_id TEXT, body TEXT NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS spool_key ON spool (tenant_id, request_id)")
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        if self.ledger:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('ledger', ?)", (self.ledger,))
        return db, os.stat(self.path).st_ino

    def _guarded(self, call):
        """`call()` under the lock, on the open file; where the file was damaged while open, it is set aside
        (`_set_aside`) and `call()` runs once more on a new one. A damaged file raised out of every call: the flusher's
        pass, the fetch loop's look at the spool's size and the deliveries' writes, so the worker died, and at each
        restart refused to open the file."""
        with self._lock:
            if self._db is None:  # set aside earlier, and the new file could not be made then
                self._db, self._inode = self._open()
            try:
                return call()
            except sqlite3.DatabaseError as e:
                if not _damaged(e):
                    raise
                self._set_aside(e)
                return call()

    def _set_aside(self, e: sqlite3.DatabaseError) -> None:
        """Move the damaged file at the path (with its WAL and shared-memory files) to `<file>.damaged-<time>-<pid>`, kept
        for salvage, and make a new spool at the path; a file another worker of a shared spool set aside first (the
        path holds another file now) is not moved again. Under the lock."""
        aside = self.path.with_name(f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        moved = False
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(f"{self.path}{suffix}", f"{aside}{suffix}")
                moved = True
        # Closed before the new file is made: the last connection to a WAL file deletes `<path>-wal` by name as it
        # closes, which would be the new file's.
        old, self._db = self._db, None
        with contextlib.suppress(sqlite3.Error):
            old.close()
        log.error("the spool file %s is damaged (%s)%s; a new spool is made at its path and the worker goes on. The ledger "
                  "records the damaged file held are not in the ledger: salvage them with `sqlite3 %s .recover`, load "
                  "what it gives into a spool file and run a worker with worker.spool_path set to it", self.path, e,
                  f": moved aside to {aside}" if moved else " (another worker set it aside already)", aside if moved else
                  f"{self.path}.damaged-*")
        self._relock()
        self._db, self._inode = self._open()
        self._unreadable = set()  # ids of the old file

    def _still_there(self) -> None:
        """Reopen the spool at its path if its file was deleted or replaced while open (an operator's `rm -rf` of the
        spool folder, a cleanup job), carrying over what the open file holds. Records written into a deleted file
        live only as long as this process: the drill that found this lost a killed worker's 8 spooled records, with
        its offsets committed. Under the lock."""
        try:
            if os.stat(self.path).st_ino == self._inode:
                return
        except FileNotFoundError:
            pass
        try:
            rows = self._db.execute("SELECT id, kind, tenant_id, request_id, body FROM spool ORDER BY id").fetchall()
        except sqlite3.Error as e:  # another SQLite file in its place took over its journal: what it held is gone
            rows = None
            log.error("the spool file %s was replaced while open, and the records it held cannot be read (%s); they are "
                      "lost unless the ledger has them", self.path, e)
        self._relock()  # raises (the folder cannot be made): the open file stays, nothing is lost
        new, inode = self._open()  # as may this
        self._db, old, self._inode = new, self._db, inode
        old.close()
        if rows:
            # Written with the write that found this, in its transaction (`put`): should it fail (the disk that is full),
            # they wait here for the next one. Creating the new file took the old one's journal: they live here only.
            self._carry = [*self._carry, *rows]  # after any still waiting from an earlier deletion (older records)
        if rows is not None:
            log.warning("the spool file %s was deleted or replaced while open; made afresh there with the %d records it "
                        "held", self.path, len(rows))

    def _relock(self) -> None:
        """Hold the lock file at the path again where it went with the spool file (deleted or replaced)."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(_lock_path(self.path)).st_ino == os.fstat(self._lock_fd).st_ino:
                return
        fd = _hold(self.path, fcntl.LOCK_SH)
        os.close(self._lock_fd)
        self._lock_fd = fd

    def _insert_carry(self) -> None:
        """The records carried over from a deleted file, into the new one, in the caller's transaction; with their ids
        where they are free, since a flush between `oldest` and `remove` removes by id and new numbers would remove
        others' records."""
        try:
            self._db.execute("SAVEPOINT ids")
            self._db.executemany("INSERT INTO spool (id, kind, tenant_id, request_id, body) VALUES (?, ?, ?, ?, ?)", self._carry)
            self._db.execute("RELEASE ids")
        except sqlite3.IntegrityError:  # the ids are taken (another spool's file at the path): numbered afresh
            self._db.execute("ROLLBACK TO ids")
            self._db.execute("RELEASE ids")
            self._db.executemany("INSERT INTO spool (kind, tenant_id, request_id, body) VALUES (?, ?, ?, ?)", [r[1:] for r in self._carry])

    @classmethod
    def existing(cls, path: str | Path, max_records: int, ledger: str) -> Spool | None:
        """Another worker's spool file at `path`, opened to flush it into `ledger`; None if the file is not a spool
        (its tables are not exactly a spool's: nothing is created in a database, or beside it, that is something else),
        holds the records of another ledger (or says of none), or is open in another process (its worker is alive and
        flushes it, or another worker is flushing it now)."""
        try:
            probe = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=5)
            try:
                tables = {r[0] for r in probe.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                columns = [r[1] for r in probe.execute("PRAGMA table_info(spool)")] if "spool" in tables else []
                owner = probe.execute("SELECT value FROM meta WHERE key = 'ledger'").fetchone() if "meta" in tables else None
            finally:
                probe.close()
        except sqlite3.Error:
            return None
        if tables - {"spool", "sqlite_sequence", "meta"} or columns != ["id", "kind", "tenant_id", "request_id", "body"]:
            return None
        if not ledger or owner is None or owner[0] != ledger:
            return None
        held = _hold(Path(path), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if held is None:  # open in another process: its worker, alive, flushes it (or another worker is flushing it)
            return None
        if not Path(path).exists():  # deleted by another worker between the look and the lock: its lock file too
            _lock_path(Path(path)).unlink(missing_ok=True)
            os.close(held)
            return None
        fcntl.flock(held, fcntl.LOCK_SH)  # no longer alone: its worker may start again meanwhile
        try:  # deleted by another worker while the lock changed hands: not ours to open
            gone = not Path(path).exists() or os.stat(_lock_path(Path(path))).st_ino != os.fstat(held).st_ino
        except FileNotFoundError:
            gone = True
        if gone:
            os.close(held)
            return None
        return cls(path, max_records, _held=held)

    @staticmethod
    def remove_if_abandoned(path: str | Path) -> bool:
        """Delete the spool file at `path`, with its WAL, shared-memory and lock files, if it holds no record and no
        process has it open: taken exclusively, its lock file says no worker of this version does, and the WAL file
        that SQLite deletes with the last connection (this one's) says no other does. Whether it was deleted."""
        path = Path(path)
        held = _hold(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if held is None:
            return False
        try:
            if path.exists():
                try:
                    db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=5)
                    try:
                        if db.execute("SELECT count(*) FROM spool").fetchone()[0]:
                            return False
                    finally:
                        db.close()
                except sqlite3.Error:
                    return False
                if Path(f"{path}-wal").exists():
                    return False
                for p in (Path(f"{path}-shm"), path):
                    p.unlink(missing_ok=True)
            _lock_path(path).unlink(missing_ok=True)  # under the lock: a waiter finds it gone and takes a new one
            return True
        finally:
            os.close(held)

    def _count(self) -> int:
        """The records in the file, counted now (under the lock, or before the spool is shared). Counted, not remembered:
        workers on one host may share the file (each flushes what it finds; the ledger's keys make a record written by
        two of them land once). Rows this version cannot read are not counted: no flush empties them, and counted they
        would hold fetching."""
        return self._db.execute("SELECT count(*) FROM spool WHERE id NOT IN (SELECT value FROM json_each(?))",
                                (json.dumps(sorted(self._unreadable)),)).fetchone()[0]

    def __len__(self) -> int:
        """The records in the file, counted now: it may wait on the file's lock (SQLite's busy timeout, 30 s) and on a
        write of another thread waiting on it; never on the event loop (`known` is for that)."""
        n = self._guarded(self._count)
        self._known = n
        return n

    @property
    def known(self) -> int:
        """The records at the last count: of this spool's every write and removal, and of each `len` (the flusher's
        pass counts, off the loop, so what other workers of a shared file add is seen within `worker.ledger_flush_ms`).
        Neither reads the file nor waits on a lock: counted on the event loop, a file another process held locked (a
        `sqlite3 FILE 'BEGIN EXCLUSIVE;'` left open, another worker mid-transaction) stalled the loop for up to 30 s
        (heartbeats, fetches, deliveries, SIGTERM) behind a write waiting on it in a thread."""
        return self._known

    @property
    def full(self) -> bool:
        """Whether fetching pauses for it, by the last count (`known`): asked on the event loop at every turn."""
        return self._known >= self.max_records

    def put(self, records: Sequence) -> None:
        """Append records (any of the three kinds) in one durable transaction."""
        rows = []
        for r in records:
            kind = _KIND_OF[type(r)]
            key = (r.tenant_id, r.request_id) if kind == "usage" else (None, None)
            rows.append((kind, *key, _encode(r)))
        if not rows:
            return

        def put() -> None:
            self._still_there()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._carry:
                    self._insert_carry()
                self._db.executemany("INSERT INTO spool (kind, tenant_id, request_id, body) VALUES (?, ?, ?, ?)", rows)
                n = self._count()
                self._db.execute("COMMIT")
            except BaseException:
                _rollback(self._db)
                raise
            self._carry = []
            self._known = n

        self._guarded(put)

    def probe(self) -> None:
        """A durable write of nothing the spool holds: raises as `put` would while the file cannot be written (its disk
        full), so that a spool found full is said writable again without records to prove it."""
        def probe() -> None:
            self._still_there()
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('probe', datetime('now'))")

        self._guarded(probe)

    def oldest(self, limit: int) -> tuple[str, list[int], list]:
        """The oldest run of records of one kind: (kind, their ids, the records); ("", [], []) when empty.

        Rows this version cannot read (a kind or a field it does not know: the spool of a newer lorabatch, flushed after
        a rollback) raised out of here and ended the flusher, and so the worker, at every restart. They are passed over
        and left in the file as they are, said when found: the lorabatch that wrote them flushes them."""

        def oldest() -> tuple[str, list[int], list, list]:
            kind, ids, records, skipped = "", [], [], []
            rows = self._db.execute("SELECT id, kind, body FROM spool WHERE id NOT IN (SELECT value FROM json_each(?)) "
                                    "ORDER BY id", (json.dumps(sorted(self._unreadable)),))
            for i, k, body in rows:
                record = _readable(k, body)
                if record is None:
                    skipped.append((i, k))
                    continue
                if ids and (k != kind or len(ids) >= limit):
                    break
                kind = k
                ids.append(i)
                records.append(record)
            rows.close()
            self._unreadable.update(i for i, _ in skipped)
            return kind, ids, records, skipped

        kind, ids, records, skipped = self._guarded(oldest)
        if skipped:
            log.error("the spool file %s holds %d ledger records this lorabatch cannot read (kinds %s; written by another "
                      "version, a newer one's spool after a rollback?): they are left in the file, not written to the "
                      "ledger; run the lorabatch that wrote them with worker.spool_path set to this file to flush them",
                      self.path, len(skipped), ", ".join(sorted({k for _, k in skipped})))
        return kind, ids, records

    def remove(self, ids: Iterable[int]) -> None:
        ids = list(ids)

        def remove() -> None:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for i in range(0, len(ids), 500):
                    chunk = ids[i: i + 500]
                    self._db.execute(f"DELETE FROM spool WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                n = self._count()
                self._db.execute("COMMIT")
            except BaseException:
                _rollback(self._db)
                raise
            self._known = n

        self._guarded(remove)

    def usage(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], UsageRecord]:
        """Spooled usage records of the given (tenant_id, request_id) keys (the first one of each)."""
        keys = list(set(keys))

        def usage() -> dict[tuple[str, str], UsageRecord]:
            out: dict[tuple[str, str], UsageRecord] = {}
            for i in range(0, len(keys), 400):
                chunk = keys[i: i + 400]
                where = " OR ".join("(tenant_id = ? AND request_id = ?)" for _ in chunk)
                params = [p for k in chunk for p in k]
                for tenant, rid, body in self._db.execute(
                        f"SELECT tenant_id, request_id, body FROM spool WHERE kind = 'usage' AND ({where}) ORDER BY id",
                        params):
                    if (tenant, rid) not in out and (record := _readable("usage", body)) is not None:
                        out[(tenant, rid)] = record
            return out

        return self._guarded(usage)

    def close(self) -> None:
        with self._lock:
            if self._carry:
                log.error("the spool at %s closes with %d records of its deleted file that could not be written again "
                          "(%s); they are lost unless the ledger has them", self.path, len(self._carry), "disk full?")
            if self._db is not None:
                self._db.close()
            if self._lock_fd is not None:  # after the file: its lock says the file is open
                os.close(self._lock_fd)
                self._lock_fd = None


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back what failed, if SQLite has not already: on a full disk it ends the transaction itself, and a ROLLBACK
    then raised "no transaction is active" in place of the error that says why (the log read "cannot rollback")."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
