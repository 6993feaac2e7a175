"""The ledger schema under Alembic, on SQLite (a temp file) and the machine's PostgreSQL.

The database fixtures (`db_url`, `migrated_url`, `engine`) are in tests/db_fixtures.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError

from billing import db
from billing.errors import LedgerConfigError
from billing.models import Base

from migrations import SCRIPT_LOCATION
from tests.db_fixtures import fresh_pg_schema
LEDGER_TABLES = {
    "tenants", "adapters", "usage", "adapter_loads", "gpu_busy", "gpu_prices", "token_prices", "billing_periods",
    "cold_start_shares", "invoices", "invoice_lines",
}
REPO_ROOT = Path(__file__).resolve().parents[1]


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _revision(url: str) -> str | None:
    engine = db.make_engine(url)
    try:
        return db.current_revision(engine)
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    """Every revision has a working downgrade: head -> base removes the ledger, base -> head rebuilds it."""
    db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == db.head_revision(SCRIPT_LOCATION)
    assert LEDGER_TABLES <= _tables(db_url)

    db.downgrade(db_url, "base", script_location=SCRIPT_LOCATION)
    assert _revision(db_url) is None
    assert _tables(db_url) & LEDGER_TABLES == set()

    db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    assert _revision(db_url) == db.head_revision(SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (id, display_name) VALUES ('acme', 'Acme')"))
            row = connection.execute(text("SELECT tier, weight FROM tenants")).one()
        assert tuple(row) == ("standard", 1)  # server defaults came back with the rebuilt schema
    finally:
        engine.dispose()


def test_migrated_schema_matches_models(migrated_url: str) -> None:
    """The migrations and billing/models.py describe the same schema: autogenerate finds no difference."""
    engine = db.make_engine(migrated_url)
    try:
        with engine.connect() as connection:
            diffs = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diffs == []


def test_constraint_names_follow_the_convention(engine: Engine) -> None:
    """Constraints and indexes carry the naming convention's names, so later revisions can drop them by name."""
    inspector = inspect(engine)
    assert {uq["name"] for uq in inspector.get_unique_constraints("usage")} == {"uq_usage_tenant_id_request_id"}
    assert {uq["name"] for uq in inspector.get_unique_constraints("adapters")} == {"uq_adapters_tenant_id_name_version"}
    assert {ck["name"] for ck in inspector.get_check_constraints("usage")} == {"ck_usage_status"}
    assert {ck["name"] for ck in inspector.get_check_constraints("tenants")} == {"ck_tenants_weight_positive"}
    assert [fk["name"] for fk in inspector.get_foreign_keys("adapters")] == ["fk_adapters_tenant_id_tenants"]
    assert {ix["name"] for ix in inspector.get_indexes("usage")} >= {
        "ix_usage_tenant_id_invoice_period", "ix_usage_invoice_period_adapter", "ix_usage_period_adapter"
    }
    assert {ix["name"] for ix in inspector.get_indexes("adapter_loads")} >= {"ix_adapter_loads_period_adapter", "ix_adapter_loads_invoice_period_adapter"}
    assert {uq["name"] for uq in inspector.get_unique_constraints("adapter_loads")} == {"uq_adapter_loads_worker_id_adapter_created_at"}
    assert {uq["name"] for uq in inspector.get_unique_constraints("gpu_busy")} == {"uq_gpu_busy_worker_id_started_at"}
    assert [fk["name"] for fk in inspector.get_foreign_keys("invoice_lines")] == ["fk_invoice_lines_invoice_id_invoices"]
    for table in LEDGER_TABLES:
        assert inspector.get_pk_constraint(table)["name"] == f"pk_{table}"


def test_foreign_keys_are_enforced(engine: Engine) -> None:
    """An adapter cannot name a tenant that does not exist, on SQLite as on PostgreSQL."""
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO adapters (tenant_id, name, version, sha256, rank, alpha, target_modules, nbytes) "
                "VALUES ('nobody', 'x', 1, :sha, 8, 16, '[]', 1)"
            ),
            {"sha": "0" * 64},
        )


@pytest.mark.postgres
def test_concurrent_upgrades_on_postgresql(pg_database: URL) -> None:
    """Worker processes that start together and all migrate leave one schema at head, and none of them fails."""
    # Processes, not threads: Alembic keeps its running context in module globals, one per process.
    with fresh_pg_schema(pg_database) as url:
        script = "import sys; from billing import db; from migrations import SCRIPT_LOCATION; db.upgrade(sys.argv[1], script_location=SCRIPT_LOCATION)"
        workers = [
            subprocess.Popen([sys.executable, "-c", script, url], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
            for _ in range(6)
        ]
        outcomes = [(worker.communicate(timeout=120)[1], worker.returncode) for worker in workers]
        assert [stderr for stderr, returncode in outcomes if returncode != 0] == []
        assert _revision(url) == db.head_revision(SCRIPT_LOCATION)


def _alembic(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "LORABATCH_LEDGER_URL"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=120
    )


def test_alembic_command_line_from_the_repository_root(tmp_path: Path) -> None:
    """`alembic upgrade/downgrade` from the repo root find the migrations and take the URL from -x, never the environment."""
    url = f"sqlite:///{tmp_path / 'cli' / 'ledger.db'}"
    done = _alembic("-x", f"url={url}", "upgrade", "head")
    assert done.returncode == 0, done.stderr
    assert _revision(url) == db.head_revision(SCRIPT_LOCATION)

    done = _alembic("-x", f"url={url}", "downgrade", "base")
    assert done.returncode == 0, done.stderr
    assert _tables(url) & LEDGER_TABLES == set()

    done = _alembic("upgrade", "head", env={"LORABATCH_LEDGER_URL": url})
    assert done.returncode != 0
    assert "-x url=" in done.stderr
    assert _revision(url) is None


def test_models_name_the_head_revision() -> None:
    """billing.db.SCHEMA_REVISION, which workers and commands require, is the head of migrations/versions."""
    assert db.SCHEMA_REVISION == db.head_revision(SCRIPT_LOCATION)


def test_billing_loads_neither_migrations_nor_alembic() -> None:
    """billing imports no migrations package, and reading or writing the ledger loads no Alembic."""
    script = ("import sys; import billing.db, billing.ledger, billing.invoice, consumer.services; "
              "print(sorted(m for m in ('migrations', 'alembic') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"], done.stdout


def test_offline_sql_names_constraints() -> None:
    """`alembic upgrade head --sql` renders the PostgreSQL DDL, constraint names included, without a database."""
    done = _alembic("-x", "url=postgresql+psycopg://nobody@127.0.0.1:1/none", "upgrade", "head", "--sql")
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE usage" in done.stdout
    assert "CONSTRAINT uq_usage_tenant_id_request_id UNIQUE (tenant_id, request_id)" in done.stdout
    assert "pg_advisory_xact_lock" not in done.stdout  # the lock is for live runs only


def test_make_engine_prepares_sqlite(tmp_path: Path) -> None:
    """A SQLite ledger gets its folder created, enforces foreign keys and runs in WAL mode on every connection."""
    path = tmp_path / "a" / "b" / "ledger.db"
    engine = db.make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.SQLITE_BUSY_TIMEOUT_S * 1000
        assert path.is_file()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "driver"),
    [("postgresql://u@h/db", "postgresql+psycopg"), ("postgresql+psycopg://u@h/db", "postgresql+psycopg"), ("sqlite://", "sqlite")],
)
def test_make_engine_picks_the_driver(url: str, driver: str) -> None:
    """PostgreSQL always goes through psycopg 3, even from a bare postgresql:// URL."""
    engine = db.make_engine(url)
    try:
        assert engine.url.drivername == driver
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", ["mysql://u@h/db", "postgresql+psycopg2://u@h/db", "sqlite+aiosqlite:///x.db", ".lorabatch/ledger.db"])
def test_make_engine_refuses_other_databases(url: str) -> None:
    """An unsupported URL fails at once with an error that names the URLs the ledger does take."""
    with pytest.raises(LedgerConfigError, match=r"sqlite:///.*postgresql\+psycopg://"):
        db.make_engine(url)


def test_0002_keeps_existing_rows(db_url: str) -> None:
    """Upgrading a v0 ledger files its usage and loads in their own period and drops loads written twice; downgrading keeps the rows."""
    db.upgrade(db_url, "0001", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    usage = ("INSERT INTO usage (tenant_id, request_id, status, route_reason, input_tokens, output_tokens, cached_tokens, base_us, lora_us, "
             "routing_us, kv_saved_us, queue_us, ttft_us, total_us, cost, period, created_at, worker_id) VALUES "
             "('acme', 'r1', 'succeeded', '', 1, 1, 0, 5, 0, 0, 0, 0, 0, 5, 0, '2026-03', '2026-03-02 10:00:00+00', 'w0')")
    load = ("INSERT INTO adapter_loads (adapter, adapter_sha256, tenant_id, tier, nbytes, load_us, worker_id, created_at, period) VALUES "
            f"('x@1', '{'a' * 64}', 'acme', 'disk', 1, 7, 'w0', '2026-03-02 09:00:00+00', '2026-03')")
    try:
        with engine.begin() as connection:
            connection.execute(text(usage))
            connection.execute(text(load))
            connection.execute(text(load))  # v0 had no key on loads: the same load twice
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id, invoice_period FROM usage")).all() == [("r1", "2026-03")]
            assert connection.execute(text("SELECT load_us, invoice_period FROM adapter_loads")).all() == [(7, "2026-03")]
        db.downgrade(db_url, "0001", script_location=SCRIPT_LOCATION)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id, period FROM usage")).all() == [("r1", "2026-03")]
            assert connection.execute(text("SELECT count(*) FROM adapter_loads")).scalar() == 1
    finally:
        engine.dispose()


def test_0004_adds_result_json_and_keeps_rows(db_url: str) -> None:
    """0004 adds the nullable usage.result_json (old rows read NULL); its downgrade drops the column and keeps the rows."""
    db.upgrade(db_url, "0003", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    usage = ("INSERT INTO usage (tenant_id, request_id, status, route_reason, input_tokens, output_tokens, cached_tokens, base_us, lora_us, "
             "routing_us, kv_saved_us, queue_us, ttft_us, total_us, cost, period, invoice_period, created_at, worker_id) VALUES "
             "('acme', 'r1', 'succeeded', '', 1, 1, 0, 5, 0, 0, 0, 0, 0, 5, 0, '2026-03', '2026-03', '2026-03-02 10:00:00+00', 'w0')")
    try:
        with engine.begin() as connection:
            connection.execute(text(usage))
        db.upgrade(db_url, "0004", script_location=SCRIPT_LOCATION)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id, result_json FROM usage")).all() == [("r1", None)]
        db.downgrade(db_url, "0003", script_location=SCRIPT_LOCATION)
        engine.dispose()  # SQLite's batch mode rebuilt the table under the pooled connections
        assert "result_json" not in {c["name"] for c in inspect(engine).get_columns("usage")}
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id FROM usage")).all() == [("r1",)]
    finally:
        engine.dispose()


def test_0008_widens_invoice_amounts_and_keeps_rows(db_url: str) -> None:
    """0008 lets a frozen invoice's cost and revenue reach 10^9 and more on PostgreSQL (numeric(18, 9) stopped below it),
    keeping the rows; its downgrade narrows them again."""
    db.upgrade(db_url, "0007", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    invoice = ("INSERT INTO invoices (tenant_id, period, tier, currency, closed_at, requests, failed, input_tokens, output_tokens, "
               "cached_tokens, base_us, lora_us, routing_us, kv_saved_us, cold_start_us, unpriced_requests, cost, revenue) VALUES "
               "('{tenant}', '2026-03', 'standard', 'IDR', '2026-04-02 00:00:00+00', 1, 0, 1, 1, 0, 5, 0, 0, 0, 0, 0, '{cost}', '0')")
    try:
        with engine.begin() as connection:
            connection.execute(text(invoice.format(tenant="acme", cost="999999999.999999999")))
        db.upgrade(db_url, "0008", script_location=SCRIPT_LOCATION)
        with engine.begin() as connection:
            connection.execute(text(invoice.format(tenant="globex", cost="1036800000.000000001")))
            costs = connection.execute(text("SELECT tenant_id, cost FROM invoices ORDER BY tenant_id")).all()
        assert [(tenant, str(cost)) for tenant, cost in costs] == [("acme", "999999999.999999999"), ("globex", "1036800000.000000001")]
        with engine.begin() as connection:
            connection.execute(text("DELETE FROM invoices WHERE tenant_id = 'globex'"))
        db.downgrade(db_url, "0007", script_location=SCRIPT_LOCATION)
        with engine.connect() as connection:
            assert [str(c) for c in connection.execute(text("SELECT cost FROM invoices")).scalars()] == ["999999999.999999999"]
    finally:
        engine.dispose()


def _kill_upgrade_at(url: str, statement: int) -> int:
    """Run `db.upgrade(url)` in a child that dies (os._exit, as kill -9 would) before its `statement`-th SQL statement."""
    script = (
        "import os, sys\n"
        "from sqlalchemy import event\nfrom sqlalchemy.engine import Engine\n"
        "from billing import db\nfrom migrations import SCRIPT_LOCATION\n"
        "seen = [0]\n"
        "@event.listens_for(Engine, 'before_cursor_execute')\n"
        "def _die(*_a):\n"
        "    seen[0] += 1\n"
        f"    if seen[0] == {statement}:\n"
        "        os._exit(9)\n"
        f"db.upgrade({url!r}, script_location=SCRIPT_LOCATION, currency='EUR')\n"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=60).returncode


@pytest.mark.parametrize("start, statement", [("base", 20), ("0005", 20)])
def test_an_upgrade_killed_part_way_is_undone_whole_and_runs_again(db_url: str, start: str, statement: int) -> None:
    """An upgrade killed mid-way leaves the ledger at the revision it started from, and `db upgrade` finishes it. On
    SQLite each CREATE/DROP ran outside the migration's transaction, so a kill left the tables (or a batch rebuild's
    `_alembic_tmp_` table) of a revision never recorded, and every later upgrade failed on "table ... already exists"."""
    if start != "base":
        db.upgrade(db_url, start, script_location=SCRIPT_LOCATION)
    before = _tables(db_url) if start != "base" else set()
    assert _kill_upgrade_at(db_url, statement) == 9
    assert _revision(db_url) == (None if start == "base" else start)
    assert _tables(db_url) - {"alembic_version"} == before - {"alembic_version"}
    db.upgrade(db_url, script_location=SCRIPT_LOCATION, currency="EUR")
    assert _revision(db_url) == db.head_revision(SCRIPT_LOCATION)


def test_an_upgrade_refused_by_0012_changes_nothing_and_runs_again(db_url: str) -> None:
    """0012's refusal (prices, no currency named) says "nothing was changed": on SQLite a batch rebuild of 0006 had
    already committed its `_alembic_tmp_invoices` table, and the upgrade with the currency then failed on it."""
    db.upgrade(db_url, "0005", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO gpu_prices (gpu_kind, effective_from, price_per_hour) "
                                    "VALUES ('H100', '2026-01-01 00:00:00', '2')"))
    finally:
        engine.dispose()
    before = _tables(db_url)
    with pytest.raises(LedgerConfigError, match="nothing was changed"):
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    assert (_revision(db_url), _tables(db_url)) == ("0005", before)
    db.upgrade(db_url, script_location=SCRIPT_LOCATION, currency="EUR")
    assert _revision(db_url) == db.head_revision(SCRIPT_LOCATION)


@pytest.mark.parametrize("start", ["base", "0005"])
def test_ctrl_c_during_db_upgrade_says_the_schema_was_left_unchanged(db_url: str, start: str, tmp_path: Path) -> None:
    """SIGINT while `lorabatch db upgrade` is three revisions in: exit 130 and one line saying it was interrupted and the
    ledger left at the revision it started from (the whole run is one transaction on both backends); it exited 130
    with nothing said. The revisions really are undone."""
    import signal

    if start != "base":
        db.upgrade(db_url, start, script_location=SCRIPT_LOCATION)
    before = _tables(db_url)
    config = tmp_path / "lorabatch.toml"
    config.write_text(f'[ledger]\nurl = "{db_url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as at a terminal, whatever the test runner set
        "import alembic.runtime.migration as m\n"
        "done, record = [0], m.HeadMaintainer.update_to_step\n"
        "def step(self, s):\n"
        "    record(self, s)\n"
        "    done[0] += 1\n"
        "    if done[0] == 3:\n"
        "        print('three revisions in', file=sys.stderr, flush=True)\n"
        "        time.sleep(60)\n"
        "m.HeadMaintainer.update_to_step = step\n"
        "from consumer.cli import main\n"
        f"sys.argv = ['lorabatch', 'db', 'upgrade', '--config', {str(config)!r}]\n"
        "main()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stderr.readline() == "three revisions in\n"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    at = "base, no schema" if start == "base" else start
    assert child.returncode == 130 and out == "", (out, err)
    assert len(err.splitlines()) == 1 and "db upgrade interrupted" in err, err
    assert f"was left unchanged, at {at} (the upgrade runs as one transaction, rolled back whole)" in " ".join(err.split()), err
    assert (_revision(db_url), _tables(db_url)) == (None if start == "base" else start, before)
