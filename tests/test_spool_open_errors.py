"""A worker whose spool file cannot be opened says why and the fix in one message (consumer.spool `open_fix`): a spool
folder that is a file names the key to change; a file that is damaged or another program's is said as such, to move it
aside and salvage its records, not as a folder that cannot be written."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

from consumer.cli.common import operational_message
from consumer.config import ConfigError, load_settings
from consumer.registry import RegistrySnapshot
from consumer.spool import Spool
from consumer.worker import Worker
from engine.config import EngineConfig
from tests.test_spool import _usage


def _start_error(tmp_path: Path, spool_path: Path) -> str:
    """The one-line message of a worker built with `spool_path` (it must refuse to start)."""
    s = load_settings(None, {"worker.spool_path": str(spool_path)})
    engine = SimpleNamespace(config=EngineConfig(max_batch_size=32))
    registry = SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=SimpleNamespace(root=tmp_path / "store"))
    with pytest.raises(ConfigError) as e:
        Worker(s, engine, registry, ledger=None)
    message = operational_message(e.value)
    assert message is not None
    return message


def test_a_spool_path_under_a_file_names_the_key(tmp_path):
    """worker.spool_path whose folder is a file: the error names the key (it said "File exists: ...; check the path")."""
    (tmp_path / "afile").write_text("")
    message = _start_error(tmp_path, tmp_path / "afile" / "spool.sqlite")
    assert "afile/spool.sqlite cannot be opened" in message and "set worker.spool_path to a file in a writable folder" in message


@pytest.mark.parametrize("content", ["random", "truncated", "other_schema"])
def test_a_damaged_spool_file_is_said_as_damaged_not_as_an_unwritable_folder(tmp_path, content):
    """A spool file that is not SQLite, truncated, or another program's database in its place: the start said "set
    worker.spool_path to a file in a writable folder", which abandons the file and whatever records it holds without a
    word. Now the error names the file, says what is wrong with it, and to move it aside (salvaging with .recover)."""
    path = tmp_path / "spool.sqlite"
    if content == "random":
        path.write_bytes(bytes(range(256)) * 32)
    elif content == "truncated":
        spool = Spool(path, 1000)
        spool.put([_usage(i) for i in range(200)])
        spool.close()
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE spool (id INTEGER PRIMARY KEY, payload BLOB)")
        db.close()
    message = _start_error(tmp_path, path)
    assert f"spool file {path}" in message and "move it aside" in message and ".recover" in message, message
    assert "writable folder" not in message, message
