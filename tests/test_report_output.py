"""`report ... -o FILE` as `results -o` does it: the path is checked before the ledger is read, a write that fails
leaves the file there as it was (it was cut to nothing first), and the error names the path."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from typer.testing import CliRunner

from billing import db
from consumer.cli import build_app
from migrations import SCRIPT_LOCATION

app = build_app()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    path = tmp_path / "lorabatch.toml"
    path.write_text(f'[ledger]\nurl = "{url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    return path


def _said(out) -> str:
    return " ".join(out.output.split())


def test_an_output_folder_that_does_not_exist_is_refused_before_the_ledger_is_read(tmp_path):
    """With a ledger that cannot be reached, the error is the -o path's: it was found only after the report was built."""
    cfg = tmp_path / "lorabatch.toml"
    cfg.write_text('[ledger]\nurl = "postgresql+psycopg://nobody@127.0.0.1:1/none"\n')
    out = CliRunner().invoke(app, ["report", "sre", "--period", "2026-01", "-o", str(tmp_path / "no" / "r.json"),
                                   "--config", str(cfg)])
    assert out.exit_code == 2, out.output
    assert f"cannot write -o {tmp_path / 'no' / 'r.json'}" in _said(out), out.output


def test_a_write_that_fails_leaves_the_report_there_as_it_was(config, tmp_path, monkeypatch):
    """A report that cannot be written whole (a file size limit of 200 bytes, set once the ledger is read, stops it as a
    full disk would) leaves last month's file whole, and the error names the path."""
    import billing.report_render

    report = tmp_path / "report.json"
    report.write_text("last month's report\n")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def render(report, fmt):
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, limit[1]))  # Python ignores SIGXFSZ: a write past it is EFBIG
        return "{" * 10_000

    monkeypatch.setattr(billing.report_render, "render_report", render)
    try:
        out = CliRunner().invoke(app, ["report", "sre", "--period", "2026-01", "-o", str(report), "--config", str(config)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert out.exit_code == 2, out.output
    assert f"cannot write -o {report}" in _said(out), out.output
    assert report.read_text() == "last month's report\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".report")] == []


def test_a_full_device_is_named(config):
    out = CliRunner().invoke(app, ["report", "sre", "--period", "2026-01", "--format", "json", "-o", "/dev/full",
                                   "--config", str(config)])
    assert out.exit_code == 2, out.output
    assert "cannot write -o /dev/full: No space left on device" in _said(out), out.output
