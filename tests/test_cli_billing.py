"""The billing command lines: prices, invoices (draft, close, close a month), reports to a file, the ledger bench."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from billing import db
from billing.bench.ledger import bench_ledger
from billing.config import LedgerConfig
from billing.ledger import Ledger
from consumer.cli import build_app
from migrations import SCRIPT_LOCATION
from tests.test_ledger import usage_record

app = build_app()


@pytest.fixture
def cli(tmp_path: Path) -> tuple[CliRunner, Path]:
    """A SQLite ledger with October 2025 usage of acme, and a config file pointing at it."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    try:
        Ledger(engine, LedgerConfig(url=url)).record_usage(
            [usage_record("r1", created_at=datetime(2025, 10, 3, tzinfo=timezone.utc), input_tokens=10**6, output_tokens=10**6, base_us=3_600_000)]
        )
    finally:
        engine.dispose()
    config = tmp_path / "lorabatch.toml"
    config.write_text(f'[ledger]\nurl = "{url}"\ngpu_kind = "h100"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    return CliRunner(), config


def run(cli: tuple[CliRunner, Path], *args: str) -> str:
    runner, config = cli
    result = runner.invoke(app, [*args, "--config", str(config)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_prices_then_invoice_then_close(cli: tuple[CliRunner, Path]) -> None:
    """prices set-gpu / set-tokens / list, then the draft invoice at those prices, then --close freezes it."""
    run(cli, "tenants", "add", "acme", "--tier", "gold")
    assert "h100: 7.20" in run(cli, "prices", "set-gpu", "h100", "7.20", "--from", "2025-10-01")
    run(cli, "prices", "set-tokens", "gold", "--input", "1.5", "--output", "2", "--from", "2025-10-01")
    listed = json.loads(run(cli, "prices", "list", "--format", "json"))
    assert listed["gpu"] == [{"gpu_kind": "h100", "from": "2025-10-01", "price_per_hour": "7.20", "currency": "USD"}]
    assert listed["tokens"][0]["input_per_million"] == "1.50"
    draft = json.loads(run(cli, "invoice", "--tenant", "acme", "--period", "2025-10", "--format", "json"))
    assert (draft["status"], draft["totals"]["cost"], draft["totals"]["revenue"]) == ("draft", "0.007200000", "3.500000000")
    closed = json.loads(run(cli, "invoice", "--tenant", "acme", "--period", "2025-10", "--close", "--format", "json"))
    assert closed["status"] == "closed" and closed["lines"] == draft["lines"]
    assert "(closed " in run(cli, "invoice", "--tenant", "acme", "--period", "2025-10")
    everything = json.loads(run(cli, "invoice", "--close-period", "2025-10", "--format", "json"))
    assert [i["tenant"] for i in everything] == ["acme"]


def test_prices_are_set_in_ledger_currency_and_a_switch_is_refused_not_relabelled(cli: tuple[CliRunner, Path]) -> None:
    """set-gpu under EUR records EUR (list shows it); the invoice under USD then ends with one error line naming both
    currencies and the fix, status 2, instead of a USD draft priced with the EUR numbers; set-gpu for a day of a closed
    month is refused naming it."""
    runner, config = cli
    eur = config.with_name("eur.toml")
    eur.write_text(config.read_text().replace("[ledger]\n", '[ledger]\ncurrency = "EUR"\n'))
    assert "h100: 7.20 EUR per hour" in run((runner, eur), "prices", "set-gpu", "h100", "7.20", "--from", "2025-10-01")
    assert "7.20 EUR" in run(cli, "prices", "list")
    result = runner.invoke(app, ["invoice", "--tenant", "acme", "--period", "2025-10", "--config", str(config)])
    assert result.exit_code == 2
    assert "set in EUR, and this invoice is in ledger.currency USD" in result.output and "prices set-gpu h100 PRICE" in result.output
    run((runner, eur), "invoice", "--close-period", "2025-10")
    result = runner.invoke(app, ["prices", "set-gpu", "h100", "3", "--from", "2025-10-15", "--config", str(eur)])
    assert result.exit_code == 2 and "2025-10, which is closed" in result.output, result.output


def test_prices_list_prints_days_as_yyyy_mm_dd_in_both_formats(cli: tuple[CliRunner, Path]) -> None:
    """An entry from day 0001-01-01 lists as 0001-01-01 in the table and in JSON (the table's strftime printed 1-01-01)."""
    run(cli, "prices", "set-gpu", "h100", "7.20", "--from", "0001-01-01")
    run(cli, "prices", "set-tokens", "gold", "--input", "1.5", "--output", "2", "--from", "0001-01-01")
    table = run(cli, "prices", "list")
    assert [line.split()[2] for line in table.splitlines() if " from " in line] == ["0001-01-01", "0001-01-01"], table
    listed = json.loads(run(cli, "prices", "list", "--format", "json"))
    assert [e["from"] for e in listed["gpu"] + listed["tokens"]] == ["0001-01-01", "0001-01-01"]


def test_closing_an_empty_month_as_csv_prints_the_columns(cli: tuple[CliRunner, Path]) -> None:
    """A month with no usage closes no invoice: --format csv still prints the header (it printed nothing), json `[]`."""
    out = run(cli, "invoice", "--close-period", "2025-09", "--format", "csv")
    assert out.splitlines() == [out.strip()] and out.startswith("tenant,period,status,currency,adapter"), out
    one = run(cli, "invoice", "--tenant", "acme", "--period", "2025-10", "--format", "csv")
    assert one.splitlines()[0] == out.strip()  # the same columns as an invoice's
    assert json.loads(run(cli, "invoice", "--close-period", "2025-09", "--format", "json")) == []


def test_invoice_errors_say_what_to_do(cli: tuple[CliRunner, Path]) -> None:
    """Bad input fails with exit code 2 and a message naming the fix."""
    runner, config = cli
    for args, hint in [
        (["invoice"], "--close-period"),  # no tenant (a missing --period is this month: tests/test_cli_periods.py)
        (["invoice", "--tenant", "acme", "--close"], "name its month with --period"),
        (["invoice", "--tenant", "acme", "--period", "2025-13"], "YYYY-MM"),
        (["invoice", "--tenant", "acme", "--period", "2999-01", "--close"], "after it has ended"),
        (["prices", "set-gpu", "h100", "abc", "--from", "2025-10-01"], "decimal"),
        (["prices", "set-gpu", "h100", "1.0000000001", "--from", "2025-10-01"], "more than 9 decimal places"),
        (["prices", "set-gpu", "h100", "1", "--from", "2025-1-1"], "YYYY-MM-DD"),
        (["report", "sre", "--period", "2025-10", "--format", "pdf"], "html"),
        (["invoice", "--tenant", "nobody", "--period", "2025-10"], "tenant 'nobody' is unknown"),
        (["invoice", "--tenant", "nobody", "--period", "2025-10", "--close"], "tenant 'nobody' is unknown"),
        (["invoice", "--tenant", "acme", "--period", "2062-10"], "period 2062-10 cannot be billed: it has not begun"),
        (["invoice", "--close-period", "9999-12"], "period 9999-12 cannot be billed"),
        (["report", "finance", "--period", "2062-10"], "period 2062-10 cannot be billed"),
        (["report", "reconcile", "--period", "0000-01"], "period 0000-01 cannot be billed"),
        (["report", "finance", "--period", "2025-10", "--flag-factor", "1e999999"], "at most 1000000"),
        (["report", "finance", "--period", "2025-10", "--flag-factor", "0"], "above 0"),
        (["tenants", "add", "blank", "--tier", ""], "tier '' is invalid"),
        (["tenants", "add", "spaced", "--tier", " gold"], "without surrounding spaces"),
        (["tenants", "add", "long", "--tier", "t" * 33], "1-32 characters"),
    ]:
        result = runner.invoke(app, [*args, "--config", str(config)])
        assert result.exit_code == 2, (args, result.output)
        assert hint in " ".join(result.output.split()), (args, result.output)


def test_closing_a_month_is_refused_for_one_tenant(cli: tuple[CliRunner, Path]) -> None:
    """`--close-period` closes every tenant's invoice: with `--tenant` it is refused (exit 2, the command that closes
    one tenant's named) and nothing is frozen; without, it counts every invoice it froze."""
    runner, config = cli
    run(cli, "tenants", "add", "acme")
    run(cli, "tenants", "add", "globex")
    for tenant in ("acme", "nobody"):
        result = runner.invoke(app, ["invoice", "--tenant", tenant, "--close-period", "2025-10", "--config", str(config)])
        assert result.exit_code == 2 and f"--tenant {tenant} --period 2025-10 --close" in " ".join(result.output.split())
    assert json.loads(run(cli, "invoice", "--tenant", "acme", "--period", "2025-10", "--format", "json"))["status"] == "draft"
    result = runner.invoke(app, ["invoice", "--close-period", "2025-10", "--format", "json", "--config", str(config)])
    assert result.exit_code == 0 and "closed: 1 invoices frozen" in result.stderr  # acme's: globex used nothing


def test_a_second_close_of_a_month_says_it_changed_nothing(cli: tuple[CliRunner, Path]) -> None:
    """`--close-period` counts apart the invoices closed before it (one tenant's own close, or a first close of the
    month) and says since when: it said "N invoices frozen" of them, as if it had closed them."""
    runner, config = cli
    run(cli, "tenants", "add", "acme")
    run(cli, "invoice", "--tenant", "acme", "--period", "2025-10", "--close")
    result = runner.invoke(app, ["invoice", "--close-period", "2025-10", "--config", str(config)])
    assert result.exit_code == 0 and "closed: 0 invoices frozen now, 1 closed before (from 20" in result.stderr, result.stderr
    again = runner.invoke(app, ["invoice", "--close-period", "2025-10", "--config", str(config)])
    assert again.exit_code == 0 and again.stdout == result.stdout
    assert "closed: 0 invoices frozen now, 1 closed before" in again.stderr, again.stderr


def test_a_config_price_the_ledger_cannot_store_is_refused_at_load(cli: tuple[CliRunner, Path]) -> None:
    """ledger.gpu_price_per_hour follows `prices set-gpu`'s rules: refused when the config loads (exit 2, one line
    naming the key), not by the first close's insert."""
    runner, config = cli
    text = config.read_text()
    for price, hint in [("2.1234567891", "more than 9 decimal places"), ("1e10", "too large"), ("-1", "greater than or equal to 0")]:
        config.write_text(text.replace('gpu_kind = "h100"', f'gpu_kind = "h100"\ngpu_price_per_hour = "{price}"'))
        result = runner.invoke(app, ["invoice", "--tenant", "acme", "--period", "2025-10", "--close", "--config", str(config)])
        assert result.exit_code == 2 and "gpu_price_per_hour" in result.output and hint in result.output, (price, result.output)


def test_reports_to_files(cli: tuple[CliRunner, Path], tmp_path: Path) -> None:
    """report finance / sre write each format; -o writes one self-contained HTML file with embedded charts."""
    finance = json.loads(run(cli, "report", "finance", "--period", "2025-10", "--format", "json", "--flag-factor", "2"))
    assert finance["summary"]["flag_factor"] == "2" and finance["tenants"][0]["tenant"] == "acme"
    out = tmp_path / "sre.html"
    run(cli, "report", "sre", "--period", "2025-10", "--format", "html", "-o", str(out))
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page
    assert "adapters" in run(cli, "report", "sre", "--period", "2025-10")


def test_report_reconcile(cli: tuple[CliRunner, Path]) -> None:
    """report reconcile: the month's measured and attributed time, every residue named, in each format."""
    document = json.loads(run(cli, "report", "reconcile", "--period", "2025-10", "--format", "json"))
    assert document["report"] == "reconcile" and document["summary"]["invoiced_ms"] == "3600.000"
    lines = {line["item"]: line for line in document["lines"]}
    assert lines["base"]["us"] == 3_600_000 and lines["gpu_busy"]["us"] == 0  # no busy record was written: all of it unexplained
    assert lines["unexplained_busy"]["us"] == -3_600_000 and document["summary"]["conserved"] is False
    table = run(cli, "report", "reconcile", "--period", "2025-10")
    assert table.startswith("Reconciliation 2025-10\n") and "redelivered_work" in table
    assert run(cli, "report", "reconcile", "--period", "2025-10", "--format", "csv").splitlines()[1].startswith("summary,")


def test_bench_ledger_prints_a_table_then_one_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench fills a scratch copy, prints its figures and one JSON line, and leaves no file behind (no timing asserted)."""
    figures = bench_ledger(f"sqlite:///{tmp_path / 'bench.db'}", rows=3_000, script_location=SCRIPT_LOCATION, batch=1_000)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == figures
    assert {"rows", "insert_rows_per_s", "invoice_s", "close_s"} <= figures.keys() and figures["rows"] == 3_000
    assert figures["closed_invoices"] > 0
    assert list(tmp_path.iterdir()) == []
    assert Decimal(str(figures["insert_s"])) > 0


def test_a_report_and_a_close_show_a_spinner_on_a_terminal_and_nothing_elsewhere(cli: tuple[CliRunner, Path],
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A report over a million-row month ran 9 to 27 s and a close as long with nothing on the screen; on a terminal each
    now shows what it reads with the time elapsed, on stderr, gone at its end; off a terminal stdout is the output alone."""
    import io

    from rich.console import Console

    import consumer.cli.common as common

    plain = run(cli, "report", "finance", "--period", "2025-10", "--format", "csv")
    screen = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=screen, force_terminal=True, width=120))
    assert run(cli, "report", "finance", "--period", "2025-10", "--format", "csv") == plain
    run(cli, "invoice", "--close-period", "2025-10")
    assert "reading the ledger for the finance report of 2025-10" in screen.getvalue()
    assert "closing 2025-10" in screen.getvalue()
