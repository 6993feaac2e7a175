"""Files that a command reads whole (consumer.files): `--config`, `kafka.sasl_*_file`, `adapters add --manifest`. A device
or a FIFO is refused at once (reading /dev/zero never ended, and a FIFO with no writer blocked the open), a file over its
limit is refused unread; the error names the option or key, the limit and the fix. `submit FILE` streams its file (a
pipe is fine) but refuses a device such as /dev/zero, whose one endless line was read past for ever."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import consumer.bulk_adapters as bulk
import consumer.config as config
from consumer.batch_file import SubmitError, read_lines
from consumer.config import ConfigError, load_settings


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)  # no writer ever opens it
    return path


def _ends(call):
    """call()'s exception, from a thread: a read that hangs fails the test rather than hanging it."""
    got: list[BaseException] = []

    def target():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test to assert on
            got.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the read never ended"
    assert got, "no error was raised"
    return got[0]


def _big(tmp_path: Path, size: int, name: str = "big") -> Path:
    path = tmp_path / name
    with path.open("wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "too-large"])
def test_config_file_bounded(tmp_path, fifo, case):
    """--config: a device, a FIFO and a file over CONFIG_MAX_BYTES are each one ConfigError naming the file, what is
    wrong (or the limit) and the fix."""
    path = {"dev-zero": lambda: Path("/dev/zero"), "fifo": lambda: fifo,
            "too-large": lambda: _big(tmp_path, config.CONFIG_MAX_BYTES + 1, "big.toml")}[case]()
    e = _ends(lambda: load_settings(path))
    assert isinstance(e, ConfigError), repr(e)
    said = str(e)
    assert f"config file {path} " in said and "pass --config with a TOML file of at most 1 MiB" in said, said
    assert ("over the 1 MiB limit" if case == "too-large" else "not a regular file") in said, said


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "too-large"])
def test_sasl_credential_file_bounded(tmp_path, fifo, case):
    """kafka.sasl_password_file is read whole: a device, a FIFO or a file over CREDENTIAL_MAX_BYTES is a ConfigError
    naming the key and the fix."""
    path = {"dev-zero": lambda: Path("/dev/zero"), "fifo": lambda: fifo,
            "too-large": lambda: _big(tmp_path, config.CREDENTIAL_MAX_BYTES + 1)}[case]()
    cfg = tmp_path / "lorabatch.toml"
    cfg.write_text(f'[kafka]\nsasl_password_env = "LORABATCH_TEST_UNSET_{os.getpid()}"\nsasl_password_file = "{path}"\n')
    e = _ends(lambda: load_settings(cfg))
    assert isinstance(e, ConfigError), repr(e)
    said = str(e)
    assert f"kafka.sasl_password_file = {path}" in said and "point it at a regular file" in said, said
    assert ("over the 64 KiB limit" if case == "too-large" else "not a regular file") in said, said


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "too-large"])
def test_manifest_bounded(tmp_path, fifo, monkeypatch, case):
    """adapters add --manifest: a device, a FIFO or a file over MANIFEST_MAX_BYTES is a BulkError naming --manifest,
    the limit and the fix (split it: the option repeats); nothing is registered."""
    if case == "too-large":
        monkeypatch.setattr(bulk, "MANIFEST_MAX_BYTES", 1 << 20)  # the same check, with a smaller file to write
    path = {"dev-zero": Path("/dev/zero"), "fifo": fifo, "too-large": tmp_path / "big"}[case]
    if case == "too-large":
        _big(tmp_path, (1 << 20) + 1)
    e = _ends(lambda: bulk.from_manifest(path, bulk.Flags("acme", False, None)))
    assert isinstance(e, bulk.BulkError), repr(e)
    said = str(e)
    assert f"--manifest {path} " in said and f"of at most {1 if case == 'too-large' else 64} MiB" in said and "--manifest may be given more" in said, said
    assert ("over the 1 MiB limit" if case == "too-large" else "not a regular file") in said, said


def test_a_manifest_at_the_limit_is_read(tmp_path, monkeypatch):
    """The limit is inclusive, and a file under it reads as before."""
    line = b'{"name": "a", "path": "a"}\n'
    monkeypatch.setattr(bulk, "MANIFEST_MAX_BYTES", len(line))
    path = tmp_path / "m.jsonl"
    path.write_bytes(line)
    (entry,) = bulk.from_manifest(path, bulk.Flags("acme", False, None))
    assert entry.name == "a"


def test_submit_refuses_a_device():
    """submit /dev/zero: refused before a byte is read, with the fix (a file, or a pipe)."""
    e = _ends(lambda: next(read_lines(Path("/dev/zero"), "acme", "b1", max_message_bytes=1 << 20)))
    assert isinstance(e, SubmitError) and "is a device, not a batch file" in str(e) and "pipe the lines in" in str(e), e


def test_submit_still_reads_a_pipe(tmp_path, fifo):
    """A FIFO with a writer is read to its end, as a pipe's lines are."""
    def write():
        with open(fifo, "w") as f:
            f.write('{"prompt": "hi", "request_id": "r1"}\n')

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    lines = list(read_lines(fifo, "acme", "b1", max_message_bytes=1 << 20))
    writer.join()
    assert [line.job.request_id for line in lines] == ["r1"], lines


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_generate_refuses_jobs_that_are_no_regular_file(tmp_path, fifo, kind):
    """generate --jobs: a FIFO or a device is refused by one FileUnfit naming --jobs, from a check made on the descriptor
    it opened, before the engine is built. It checked is_file() and read the path after building the engine: a FIFO
    swapped in meanwhile blocked read_bytes, and one there already was said to be "no such file"."""
    from consumer.files import FileUnfit
    from consumer.offline import run_offline
    from engine.config import EngineConfig

    path = fifo if kind == "fifo" else Path("/dev/zero")
    e = _ends(lambda: next(run_offline(EngineConfig(model_dir=str(tmp_path / "no-model")), {}, path)))
    assert isinstance(e, FileUnfit), repr(e)
    assert f"--jobs {path} is a " in str(e) and "not a regular file" in str(e) and "give a JSONL file" in str(e), e
