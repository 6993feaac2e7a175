"""invoice and report take this UTC month when no --period is given; closing still names its month."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from billing import db
from billing.config import LedgerConfig
from billing.ledger import Ledger
from consumer.cli import build_app
from consumer.cli.common import current_month
from migrations import SCRIPT_LOCATION
from tests.test_ledger import usage_record

app = build_app()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A SQLite ledger with one acme request this month and one in the month before."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    now = datetime.now(UTC)
    last_month = now.replace(day=1) - timedelta(days=1)
    try:
        Ledger(engine, LedgerConfig(url=url)).record_usage([
            usage_record("this", created_at=now, input_tokens=5, output_tokens=7, base_us=1_000),
            usage_record("last", created_at=last_month, input_tokens=50, output_tokens=70, base_us=9_000),
        ])
    finally:
        engine.dispose()
    path = tmp_path / "lorabatch.toml"
    path.write_text(f'[ledger]\nurl = "{url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    return path


def _run(config: Path, *args: str):
    return CliRunner().invoke(app, [*args, "--config", str(config)])


def test_current_month_is_the_utc_month():
    assert current_month() == datetime.now(UTC).strftime("%Y-%m")


def test_invoice_defaults_to_this_month(config):
    out = _run(config, "invoice", "--tenant", "acme", "--format", "json")
    assert out.exit_code == 0, out.output
    inv = json.loads(out.stdout)
    assert inv["period"] == current_month() and inv["totals"]["input_tokens"] == 5
    same = json.loads(_run(config, "invoice", "--tenant", "acme", "--format", "json", "--period", current_month()).stdout)
    assert same == inv


@pytest.mark.parametrize("kind", ["finance", "sre", "reconcile"])
def test_reports_default_to_this_month(config, kind):
    out = _run(config, "report", kind, "--format", "json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["period"] == current_month()


def test_close_still_names_its_month(config):
    out = _run(config, "invoice", "--tenant", "acme", "--close")
    assert out.exit_code == 2
    assert "--close freezes an invoice for good: name its month with --period YYYY-MM" in " ".join(out.output.split())
    out = _run(config, "invoice")
    assert out.exit_code == 2 and "pass --tenant T" in out.output


@pytest.mark.parametrize("args", [["invoice", "--tenant", "acme"], ["invoice", "--tenant", "acme", "--close"],
                                  ["report", "finance"], ["report", "sre"], ["report", "reconcile"]])
def test_an_empty_period_is_refused_not_taken_as_this_month(config, args):
    """`--period "$P"` with P unset names no month: it is refused as any malformed period is, not read (or closed) as
    this month's."""
    out = _run(config, *args, "--period", "")
    assert out.exit_code == 2, out.output
    assert "period='' is not a billing period" in " ".join(out.output.split()), out.output
