"""Revision 0012: each price-list entry's currency, on SQLite (a temp file) and the machine's PostgreSQL.

Rows already there take the currency of the process that upgrades (`lorabatch db upgrade`'s ledger.currency,
`alembic -x currency=`); with price rows and no currency named, the upgrade changes nothing and says what to pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from billing import db
from billing.errors import LedgerConfigError
from migrations import SCRIPT_LOCATION
from tests.test_migrations import _revision

REPO_ROOT = Path(__file__).resolve().parents[1]
_GPU = "INSERT INTO gpu_prices (gpu_kind, effective_from, price_per_hour) VALUES ('h100', '2026-10-01 00:00:00+00', '3.60')"
_TOKENS = ("INSERT INTO token_prices (tier, effective_from, input_per_million, output_per_million) "
           "VALUES ('standard', '2026-10-01 00:00:00+00', '0.10', '0.30')")


def _at_0011_with_prices(url: str) -> None:
    db.upgrade(url, "0011", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text(_GPU))
            connection.execute(text(_TOKENS))
    finally:
        engine.dispose()


def _rows(url: str) -> list[tuple]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for table, what in (("gpu_prices", "gpu_kind"), ("token_prices", "tier"))
                    for row in connection.execute(text(f"SELECT {what}, currency FROM {table}"))]
    finally:
        engine.dispose()


def test_0012_labels_existing_prices_with_the_upgrading_currency(db_url: str) -> None:
    """Existing entries take the named currency; the column is NOT NULL; the downgrade drops it and keeps the rows."""
    _at_0011_with_prices(db_url)
    with pytest.raises(LedgerConfigError, match=r"holds prices \(1 GPU, 1 token\) with none named.*-x currency=CODE.*nothing was changed"):
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == "0011"
    db.upgrade(db_url, script_location=SCRIPT_LOCATION, currency="EUR")
    assert _revision(db_url) == "0012"
    assert _rows(db_url) == [("h100", "EUR"), ("standard", "EUR")]
    engine = db.make_engine(db_url)
    try:
        for table in ("gpu_prices", "token_prices"):
            (column,) = [c for c in inspect(engine).get_columns(table) if c["name"] == "currency"]
            assert column["nullable"] is False, column
        assert {ck["name"] for ck in inspect(engine).get_check_constraints("gpu_prices")} == {"ck_gpu_prices_price_not_negative"}
    finally:
        engine.dispose()
    db.downgrade(db_url, "0011", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    try:
        assert "currency" not in {c["name"] for c in inspect(engine).get_columns("gpu_prices")}
        with engine.connect() as connection:
            assert connection.execute(text("SELECT gpu_kind, price_per_hour FROM gpu_prices")).one()[0] == "h100"
            assert connection.execute(text("SELECT count(*) FROM token_prices")).scalar() == 1
    finally:
        engine.dispose()


def test_0012_downgrade_is_refused_while_prices_are_in_two_currencies(db_url: str) -> None:
    """Below 0012 an entry has no currency and a draft prices every entry in its ledger.currency: a downgrade with
    entries in EUR and USD would price the EUR numbers as USD (it dropped the labels and said nothing). It is refused,
    changing nothing; with the entries in one currency it runs."""
    _at_0011_with_prices(db_url)
    db.upgrade(db_url, script_location=SCRIPT_LOCATION, currency="EUR")
    engine = db.make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE token_prices SET currency = 'USD'"))
    finally:
        engine.dispose()
    with pytest.raises(LedgerConfigError, match=r"entries in EUR, USD.*nothing was changed"):
        db.downgrade(db_url, "0011", script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == "0012" and sorted(_rows(db_url)) == [("h100", "EUR"), ("standard", "USD")]
    engine = db.make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE token_prices SET currency = 'EUR'"))
    finally:
        engine.dispose()
    db.downgrade(db_url, "0011", script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == "0011"


def test_0012_on_an_empty_price_list_needs_no_currency(db_url: str) -> None:
    db.upgrade(db_url, "0011", script_location=SCRIPT_LOCATION)
    db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == "0012"


def test_0012_from_the_alembic_command_line(tmp_path: Path) -> None:
    """`alembic -x url=... -x currency=EUR upgrade head` labels the rows; a code that is not one is refused."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    _at_0011_with_prices(url)
    alembic = [sys.executable, "-m", "alembic", "-x", f"url={url}"]
    done = subprocess.run([*alembic, "-x", "currency=eur", "upgrade", "head"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "'eur' is not a currency code" in done.stderr, done.stderr
    done = subprocess.run([*alembic, "-x", "currency=EUR", "upgrade", "head"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _rows(url) == [("h100", "EUR"), ("standard", "EUR")]


def test_lorabatch_db_upgrade_labels_them_with_ledger_currency(tmp_path: Path) -> None:
    """`lorabatch db upgrade` names its config's ledger.currency: the currency every draft priced them in until now."""
    from typer.testing import CliRunner

    from consumer.cli import build_app

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    _at_0011_with_prices(url)
    config = tmp_path / "lorabatch.toml"
    config.write_text(f'[ledger]\nurl = "{url}"\ncurrency = "GBP"\n')
    result = CliRunner().invoke(build_app(), ["db", "upgrade", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert _rows(url) == [("h100", "GBP"), ("standard", "GBP")]
