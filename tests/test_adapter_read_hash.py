"""A store read hashes the adapter's bytes beside their validation (engine.adapter_records.read_validated): what it
answers must be what the hash-first order answered, for a registered content that matches, one that changed (also
when the changed file no longer parses, or the checks refuse it), and an unregistered read."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

import engine.adapter_records as records
from engine.api import AdapterError
from engine.checkpoint import base_fingerprint, read_model_config
from engine.store import content_sha256, read_file
from tests.test_serving_helpers import corrupt_copy


def _sha(path) -> str:
    return content_sha256((path / "adapter_config.json").read_bytes(), read_file(path / "adapter_model.safetensors", sys.maxsize))


@pytest.fixture
def setup(demo_set):
    model = demo_set["model"]
    return read_model_config(model), base_fingerprint(model), sorted(demo_set["adapters"].items())


def _read(path, registered, cfg, fp):
    return records.read_validated(path, registered, cfg, 1 << 30, 64, fp)


@pytest.mark.parametrize("overlap", [False, True], ids=["hash_first", "hash_beside"])
def test_matching_content_gives_the_adapter_under_its_sha(monkeypatch, setup, overlap):
    monkeypatch.setattr(records, "OVERLAP_HASH_BYTES", 0 if overlap else 1 << 62)
    cfg, fp, adapters = setup
    for _, path in adapters:
        sha = _sha(path)
        got, adapter = _read(path, sha, cfg, fp)
        assert got == sha and adapter is not None and adapter.sha256 == sha
        free, free_adapter = _read(path, None, cfg, fp)  # unregistered: hashed first, whatever the size
        assert free == sha and free_adapter.sha256 == sha


@pytest.mark.parametrize("overlap", [False, True], ids=["hash_first", "hash_beside"])
def test_a_changed_file_is_reported_changed_even_where_it_no_longer_parses_or_passes(monkeypatch, setup, tmp_path, overlap):
    """Registered content A, files now B: (sha of B, None), the pool's adapter_changed; B valid, cut in half (parse
    error), or refused by the checks (a rank past max_lora_rank) alike. The same cut file read as unregistered raises."""
    monkeypatch.setattr(records, "OVERLAP_HASH_BYTES", 0 if overlap else 1 << 62)
    cfg, fp, adapters = setup
    (_, a), (_, b) = adapters[0], adapters[1]
    registered = _sha(a)
    cut = corrupt_copy(b, tmp_path / "cut")
    too_big = shutil.copytree(a, tmp_path / "rank")
    conf = json.loads((too_big / "adapter_config.json").read_text())
    conf["r"] = 4096
    (too_big / "adapter_config.json").write_text(json.dumps(conf))
    for path in (b, cut, too_big):
        got, adapter = _read(path, registered, cfg, fp)
        assert adapter is None and got == _sha(path) != registered, path.name
    with pytest.raises(AdapterError):
        _read(cut, None, cfg, fp)
    with pytest.raises(AdapterError):
        _read(cut, _sha(cut), cfg, fp)  # registered as the cut content itself: it matches, and its error is raised


def test_the_hash_runs_beside_the_validation(monkeypatch, setup):
    """Above OVERLAP_HASH_BYTES the sha256 is computed on the hashing threads, not the reading one."""
    import threading

    monkeypatch.setattr(records, "OVERLAP_HASH_BYTES", 0)
    names = []
    real = records.content_sha256

    def spy(*args):
        names.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(records, "content_sha256", spy)
    cfg, fp, adapters = setup
    path = adapters[0][1]
    _read(path, _sha(path), cfg, fp)
    assert len(names) == 1 and names[0].startswith("adapter-hash")


def test_the_reads_bench_times_both_orders_and_the_layout_for_every_rank():
    """`lorabatch bench reads` (engine.bench.reads) reads each adapter both ways, checks the sha it gets, and leaves the
    module's threshold as it found it; a shape it does not know is refused naming the option."""
    from typer.testing import CliRunner

    from consumer.cli import build_app
    from engine.bench.reads import run

    before = records.OVERLAP_HASH_BYTES
    out = run("tiny", [4, 8], per_rank=1, reps=1)
    assert records.OVERLAP_HASH_BYTES == before
    for key in ("hash_first_ms", "hash_beside_ms", "pages_ms"):
        assert sorted(out[key]) == [4, 8] and all(v > 0 for v in out[key].values()), (key, out[key])
    bad = CliRunner().invoke(build_app(), ["bench", "reads", "--shape", "llama-70b"])
    assert bad.exit_code != 0 and "--shape" in bad.output
    for ranks in ("8,x", "", "8,0"):
        bad = CliRunner().invoke(build_app(), ["bench", "reads", "--shape", "tiny", "--ranks", ranks])
        assert bad.exit_code != 0 and "--ranks" in bad.output, (ranks, bad.output)


def test_the_reads_bench_restores_what_it_changes_when_a_read_fails(monkeypatch):
    import torch

    from engine.bench.reads import run

    def fail(*args, **kwargs):
        raise OSError("the disk went away")

    threads, before = torch.get_num_threads(), records.OVERLAP_HASH_BYTES
    monkeypatch.setattr(records, "read_validated", fail)
    with pytest.raises(OSError):
        run("tiny", [4], per_rank=1, reps=1)
    assert torch.get_num_threads() == threads and records.OVERLAP_HASH_BYTES == before


@pytest.mark.parametrize("overlap", [False, True], ids=["hash_first", "hash_beside"])
def test_an_unexpected_error_of_a_changed_file_is_changed_and_an_interrupt_goes_up(monkeypatch, setup, overlap):
    """A changed file whose validation fails in a way no check foresaw (a ValueError) is still changed; an interrupt
    during the validation is never swallowed, whether the content changed or not."""
    monkeypatch.setattr(records, "OVERLAP_HASH_BYTES", 0 if overlap else 1 << 62)
    cfg, fp, adapters = setup
    (_, a), (_, b) = adapters[0], adapters[1]

    def boom(exc):
        def parse(*args, **kwargs):
            raise exc
        return parse

    monkeypatch.setattr(records, "parse_adapter", boom(ValueError("unforeseen")))
    assert _read(b, _sha(a), cfg, fp) == (_sha(b), None)
    with pytest.raises(ValueError):
        _read(a, _sha(a), cfg, fp)
    monkeypatch.setattr(records, "parse_adapter", boom(KeyboardInterrupt()))
    for path in (a, b):
        if overlap or path == a:  # hashed first, a changed file is answered before any validation runs
            with pytest.raises(KeyboardInterrupt):
                _read(path, _sha(a), cfg, fp)


def test_a_forked_child_hashes_with_threads_of_its_own():
    """The parent's hashing pool does not come over a fork (its threads do not): a hash given to the child's pool runs.
    (Only the pool: torch's own thread pools do not survive a fork either, so a whole read in a forked child is not
    something the engine does; its reader processes are spawned.)"""
    import os
    import time

    want = content_sha256(b"{}", bytearray(b"x" * 4096))
    assert records._hash_pool().submit(content_sha256, b"{}", bytearray(b"x" * 4096)).result() == want  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its hash completes, and never return into pytest
        ok = False
        try:
            ok = records._hash_pool().submit(content_sha256, b"{}", bytearray(b"x" * 4096)).result(timeout=20) == want
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's hash did not finish")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
