"""The worker's local spool: ledger records survive in order across a restart of the process."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from consumer.spool import Spool, _encode

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _usage(i: int, tenant: str = "acme") -> UsageRecord:
    return UsageRecord(tenant_id=tenant, request_id=f"r{i}", status="succeeded", created_at=T0, base_us=100 + i,
                       output_tokens=3, result_json=f'{{"request_id": "r{i}"}}')


def _busy(i: int) -> BusyRecord:
    return BusyRecord(worker_id="w", gpu_kind="cpu", started_at=T0 + timedelta(seconds=i),
                      ended_at=T0 + timedelta(seconds=i + 1), busy_us=10, steps=1)


def _load(i: int) -> AdapterLoadRecord:
    return AdapterLoadRecord(adapter="a@1", adapter_sha256="0" * 64, tenant_id="acme", tier="disk", nbytes=5,
                             load_us=7, worker_id="w", created_at=T0 + timedelta(seconds=i))


def test_records_round_trip_in_order_and_survive_reopening(tmp_path):
    """What goes in comes out equal, oldest first, one kind per run; a reopened file keeps it all."""
    path = tmp_path / "spool.sqlite"
    s = Spool(path, max_records=100)
    s.put([_usage(0), _usage(1)])
    s.put([_busy(0)])
    s.put([_load(0), _usage(2)])
    s.close()
    s = Spool(path, max_records=100)
    assert len(s) == 5
    runs = []
    while len(s):
        kind, ids, records = s.oldest(10)
        runs.append((kind, records))
        s.remove(ids)
    assert runs == [("usage", [_usage(0), _usage(1)]), ("busy", [_busy(0)]), ("load", [_load(0)]), ("usage", [_usage(2)])]
    assert s.oldest(10) == ("", [], [])


def test_usage_lookup_by_identity(tmp_path):
    """A spooled answer is found by (tenant, request_id), never by request_id alone."""
    s = Spool(tmp_path / "s.sqlite", max_records=10)
    s.put([_usage(1, "acme"), _usage(1, "globex")])
    found = s.usage([("acme", "r1"), ("acme", "r9"), ("initech", "r1")])
    assert list(found) == [("acme", "r1")]
    assert found[("acme", "r1")] == _usage(1, "acme")
    assert s.usage([]) == {}


@pytest.mark.parametrize(("n", "full"), [(0, False), (2, False), (3, True), (4, True)])
def test_full_at_its_bound(tmp_path, n, full):
    """The spool reports full at max_records (the worker then pauses fetching); writes still succeed."""
    s = Spool(tmp_path / "s.sqlite", max_records=3)
    s.put([_usage(i) for i in range(n)])
    assert len(s) == n and s.full is full


def test_many_keys_are_looked_up_in_chunks(tmp_path):
    """More keys than one SQL statement binds are all answered."""
    s = Spool(tmp_path / "s.sqlite", max_records=5000)
    s.put([_usage(i) for i in range(1200)])
    assert len(s.usage([("acme", f"r{i}") for i in range(1500)])) == 1200


@pytest.mark.parametrize("how", ["folder", "file"])
def test_a_spool_deleted_while_open_is_made_afresh_with_its_records(tmp_path, how, caplog):
    """An operator's `rm -rf` of the spool folder (or of the file) while a worker runs: records then went into the
    deleted file, which dies with the process (a killed worker's 8 records were lost with their offsets committed).
    The next write makes the file afresh at its path with what the open one held, and says so."""
    import shutil

    path = tmp_path / "spool" / "w.sqlite"
    s = Spool(path, max_records=100)
    s.put([_usage(0), _usage(1)])
    if how == "folder":
        shutil.rmtree(path.parent)
    else:
        path.unlink()
    s.put([_usage(2)])
    s.close()
    reopened = Spool(path, max_records=100)  # what a replacement worker finds
    assert [r.request_id for r in reopened.oldest(10)[2]] == ["r0", "r1", "r2"]
    assert any("deleted or replaced while open" in r.getMessage() for r in caplog.records)


def test_a_spool_replaced_while_open_says_what_is_lost_and_goes_on(tmp_path, caplog):
    """Another SQLite file put at the path takes over the open one's journal (with this SQLite), so its records cannot
    be carried over: an error says so, and the spool goes on in the new file. (Where they can be read, they are carried
    over as for a deleted file.)"""
    path = tmp_path / "w.sqlite"
    s = Spool(path, max_records=100)
    s.put([_usage(0)])
    path.unlink()
    Spool(path, max_records=100).close()
    s.put([_usage(1)])
    kept = [r.request_id for r in s.oldest(10)[2]]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert (kept, "cannot be read" in said) in ((["r1"], True), (["r0", "r1"], False)) and "replaced while open" in said
    s.close()


def test_a_failed_write_raises_its_own_error_not_the_rollbacks(tmp_path, monkeypatch):
    """A full disk ends SQLite's transaction itself; the ROLLBACK after it raised "cannot rollback - no transaction is
    active" in place of the error that said why (the worker's log named no full disk)."""
    import sqlite3

    s = Spool(tmp_path / "s.sqlite", max_records=100)

    class Full:
        in_transaction = False

        def __init__(self, db):
            self.db = db

        def execute(self, sql, *a):
            return self.db.execute(sql, *a)

        def executemany(self, sql, rows):
            self.db.execute("ROLLBACK")  # as SQLite does on SQLITE_FULL
            raise sqlite3.OperationalError("database or disk is full")

    real = s._db
    s._db = Full(real)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        s.put([_usage(0)])
    s._db = real
    s.put([_usage(1)])
    assert len(s) == 1


def test_a_flush_across_the_reopen_removes_only_what_it_wrote(tmp_path):
    """The flusher takes the oldest records, writes them to the ledger, then removes them by id; a reopen in between
    (the file deleted, the deliverer spooling more) kept the records but numbered them afresh, so the removal deleted
    records that never reached the ledger. The carried records keep their ids."""
    path = tmp_path / "spool" / "w.sqlite"
    s = Spool(path, max_records=100)
    s.put([_usage(i) for i in range(4)])
    s.remove(s.oldest(2)[1])  # r0, r1 flushed earlier: ids start at 3 now
    _, ids, taken = s.oldest(10)  # the flusher takes r2, r3 ...
    path.unlink()
    s.put([_usage(10 + i) for i in range(4)])  # ... while the file is made afresh with them and four more
    s.remove(ids)  # ... and removes what it wrote
    assert [r.request_id for r in taken] == ["r2", "r3"]
    assert [r.request_id for r in s.oldest(10)[2]] == ["r10", "r11", "r12", "r13"]
    s.close()


def test_records_carried_over_wait_in_memory_while_the_new_file_refuses_them(tmp_path, monkeypatch):
    """Writing the deleted file's records into the new one can fail (the disk that is full): the write fails, they wait
    in memory (the old file's journal went to the new one, so it cannot be used again), and the next write carries
    them over, before its own."""
    import sqlite3

    path = tmp_path / "w.sqlite"
    s = Spool(path, max_records=100)
    s.put([_usage(0), _usage(1)])
    path.unlink()
    real = Spool._insert_carry

    def full(self):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Spool, "_insert_carry", full)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        s.put([_usage(2)])
    assert len(s._carry) == 2 and len(s) == 0
    monkeypatch.setattr(Spool, "_insert_carry", real)
    s.put([_usage(2)])
    assert s._carry == []
    s.close()
    assert [r.request_id for r in Spool(path, max_records=100).oldest(10)[2]] == ["r0", "r1", "r2"]


def test_a_file_is_deleted_only_while_no_process_has_it_open(tmp_path):
    """`remove_if_abandoned` deletes an empty spool's files only while its lock can be taken exclusively: never while a
    worker has it open, nor while it holds records. A worker starting under that id while it is deleted (waiting on the
    lock) gets a file and lock of its own at the path, not the deleted ones, so it is not deleted under it after."""
    import fcntl
    import threading

    from consumer.spool import _hold

    path = tmp_path / "w.sqlite"
    owner = Spool(path, max_records=10)
    assert not Spool.remove_if_abandoned(path) and path.exists(), "open: kept"
    owner.put([_usage(0)])
    owner.close()
    assert not Spool.remove_if_abandoned(path) and path.exists(), "holds a record: kept"
    owner = Spool(path, max_records=10)
    owner.remove([i for i in owner.oldest(10)[1]])
    owner.close()
    sweeper = _hold(path, fcntl.LOCK_EX)  # a sweeper in the middle of deleting it, as `remove_if_abandoned` is
    started: list[Spool] = []
    thread = threading.Thread(target=lambda: started.append(Spool(path, max_records=10)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive(), "a worker starting under the id waits for the sweeper"
    for p in (path, tmp_path / "w.sqlite.lock"):
        p.unlink()
    import os

    os.close(sweeper)
    thread.join(5)
    restarted = started[0]
    restarted.put([_usage(1)])
    assert not Spool.remove_if_abandoned(path), "its lock is the one at the path"
    assert [r.request_id for r in restarted.oldest(10)[2]] == ["r1"]
    restarted.close()
    assert not Spool.remove_if_abandoned(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.sqlite", "w.sqlite.lock"]


def test_a_spool_deleted_while_open_holds_its_lock_again(tmp_path):
    """An operator's `rm -rf` of the folder takes the lock file too: the file made afresh is locked again, so a worker
    beside it does not delete it while it is open."""
    import shutil

    path = tmp_path / "spool" / "w.sqlite"
    s = Spool(path, max_records=100)
    shutil.rmtree(path.parent)
    s.put([_usage(0)])
    s.remove(s.oldest(10)[1])
    assert not Spool.remove_if_abandoned(path) and path.exists()
    s.close()
    assert Spool.remove_if_abandoned(path) and list(path.parent.iterdir()) == []


def test_records_this_version_cannot_read_are_kept_aside_not_raised(tmp_path, caplog):
    """A record written by another lorabatch (a field or a kind this one does not know: a newer one's spool, flushed
    after a rollback) raised TypeError or KeyError out of `oldest`, which ended the flusher and so the worker, at every
    restart. Now such records stay in the file, set aside and said (the file named, and the fix), and the others flow."""
    import json
    import sqlite3

    path = tmp_path / "s.sqlite"
    s = Spool(path, max_records=10)
    s.put([_usage(0)])
    newer = json.loads(_encode(_usage(1)))
    newer["carbon_grams"] = 3
    raw = sqlite3.connect(path)
    raw.execute("INSERT INTO spool (kind, tenant_id, request_id, body) VALUES ('usage', 'acme', 'r1', ?)",
                (json.dumps(newer),))
    raw.execute("INSERT INTO spool (kind, body) VALUES ('gpu_power', '{}')")
    raw.commit()
    raw.close()
    s.put([_busy(2)])
    assert s.usage([("acme", "r0"), ("acme", "r1")]) == {("acme", "r0"): _usage(0)}
    runs = []
    while len(s):
        kind, ids, records = s.oldest(10)
        runs.append((kind, records))
        s.remove(ids)
    assert runs == [("usage", [_usage(0)]), ("busy", [_busy(2)])]
    s.close()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT count(*) FROM spool").fetchone()[0] == 2  # kept, for the lorabatch that wrote them
    raw.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert said and str(path) in said[0] and "lorabatch" in said[0], said
    assert not Spool.remove_if_abandoned(path)  # never deleted as empty by a worker beside it


_CRASH_AFTER_REOPEN = """
import os, shutil, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
from consumer.spool import Spool
from tests.test_spool import _usage
path, how = Path(sys.argv[1]), sys.argv[2]
s = Spool(path, max_records=100)
s.put([_usage(0), _usage(1)])
if how == "folder":
    shutil.rmtree(path.parent)
elif how == "file":
    path.unlink()
else:  # replaced: another spool made at the path and closed
    path.unlink()
    Spool(path, max_records=100).close()
s.put([_usage(2)])  # reopens at the path, then closes the old file's connection
s.put([_usage(3)])
os._exit(0)  # killed: nothing checkpointed, the new file's records are in its -wal alone
"""


@pytest.mark.parametrize("how", ["folder", "file", "replaced"])
def test_the_old_connection_closing_keeps_the_new_files_wal(tmp_path, how):
    """The reopen (`_still_there`) makes the new file before it closes the old file's connection, its last: SQLite
    deletes `<path>-wal` by name as the last connection of a WAL file closes, which would be the new file's, and a kill
    before a checkpoint would then lose what went into it. SQLite leaves the WAL of a file that was moved or deleted
    under it alone (checked here with a killed process): the records are all at the path afterwards."""
    import subprocess
    import sys

    path = tmp_path / "spool" / "w.sqlite"
    subprocess.run([sys.executable, "-c", _CRASH_AFTER_REOPEN, str(path), how], check=True, cwd=Path(__file__).parents[1])
    reopened = Spool(path, max_records=100)
    kept = [r.request_id for r in reopened.oldest(10)[2]]
    reopened.close()
    assert kept in ((["r2", "r3"], ["r0", "r1", "r2", "r3"]) if how == "replaced" else (["r0", "r1", "r2", "r3"],))
