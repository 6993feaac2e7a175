"""The adapter store reads only regular files, checked on the descriptor it opened (engine.store.open_regular). A FIFO
swapped in after adapter_files checked the folder blocked the reader's open for ever (waiting for a writer), and a
device such as /dev/zero read as an empty file; each is now one AdapterError(adapter_unsafe) naming the path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import engine.adapter_records as records
import engine.store as store_mod
from engine.api import AdapterError
from engine.checkpoint import base_fingerprint, read_model_config
from engine.store import AdapterStore, read_file
from tests.test_bounded_reads import _ends

MB = 1 << 20


def _refused(e: BaseException, path: Path) -> None:
    assert isinstance(e, AdapterError), repr(e)
    assert e.code == "adapter_unsafe" and f"{path} is not a regular file" in str(e) and "replace it" in str(e), e


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_read_file_refuses_what_is_not_a_regular_file(tmp_path, kind):
    """read_file of a FIFO with no writer, or of a device, raises at once instead of blocking (or reading nothing)."""
    path = Path("/dev/zero") if kind == "dev-zero" else tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    _refused(_ends(lambda: read_file(path, MB)), path)


def test_read_file_still_reads_a_regular_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert read_file(path, MB) == b"abc"


def _swapping(module, name: str):
    """adapter_files as `module` calls it, with file `name` turned into a FIFO after the check passed: the race."""
    real = module.adapter_files

    def checked_then_swapped(src_dir, max_bytes):
        paths = real(src_dir, max_bytes)
        victim = Path(src_dir) / name
        victim.unlink()
        os.mkfifo(victim)
        return paths

    return checked_then_swapped


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_put_refuses_a_fifo_swapped_in_after_the_check(demo_set, tmp_path, monkeypatch, name):
    """store.put (`lorabatch adapters add`): a file swapped for a FIFO between the check and the read is refused, and
    nothing is left in the store."""
    src = Path(shutil.copytree(demo_set["adapters"]["qv-r4"], tmp_path / "adapter"))
    store = AdapterStore(tmp_path / "store", max_bytes=64 * MB)
    monkeypatch.setattr(store_mod, "adapter_files", _swapping(store_mod, name))
    _refused(_ends(lambda: store.put(src)), (src / name).resolve())
    assert list(store.root.iterdir()) == []


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_worker_read_refuses_a_fifo_swapped_in_after_the_check(demo_set, tmp_path, monkeypatch, name):
    """A worker's read of a store entry (engine.adapter_records.read_validated) refuses a FIFO swapped in after
    adapter_files checked the folder."""
    model = demo_set["model"]
    src = Path(shutil.copytree(demo_set["adapters"]["qv-r4"], tmp_path / "adapter"))
    monkeypatch.setattr(records, "adapter_files", _swapping(records, name))
    call = lambda: records.read_validated(src, None, read_model_config(model), 1 << 30, 64, base_fingerprint(model))  # noqa: E731
    _refused(_ends(call), (src / name).resolve())


def test_a_sha_with_a_final_newline_is_no_adapter_name(tmp_path):
    """Only 64 hex digits name a stored adapter: with `$`, one with a newline after them passed the check (a folder name
    the store never makes, whose error then said 'not in the store, put it first' rather than what was wrong)."""
    store = AdapterStore(tmp_path / "store", max_bytes=MB)
    sha = "a" * 64
    (tmp_path / "store" / f"{sha}\n").mkdir()
    with pytest.raises(AdapterError, match="is not an adapter sha256"):
        store.path(f"{sha}\n")
    assert f"{sha}\n" not in store
