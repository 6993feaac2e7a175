"""Operational mistakes at the `lorabatch` command line: one `error:` line on stderr that says what failed and the
fix, exit status 2, no traceback; `lorabatch --debug` shows the traceback as well. Run as a user runs them: the
real console script, in a process of its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer

from billing.db import SCHEMA_REVISION
from consumer.cli.common import operational_message, run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lorabatch(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    return subprocess.run([sys.executable, "-m", "consumer.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "lorabatch.toml"
    path.write_text(text)
    return str(path)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run's stderr is exactly one `error:` line (a progress bar's last frame aside), with no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip() and not x.startswith("submitting")]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.fixture
def jobs_file(tmp_path) -> str:
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return str(path)


def test_submit_with_the_broker_down(tmp_path, jobs_file):
    port = _free_port()
    cfg = _config(tmp_path, f'[kafka]\nbootstrap_servers = "127.0.0.1:{port}"\n')
    line = _one_error_line(_lorabatch(tmp_path, "submit", jobs_file, "--tenant", "acme", "--batch-id", "b1", "-c", cfg))
    assert f"the broker at 127.0.0.1:{port} failed (KafkaConnectionError" in line
    assert "start it with `lorabatch broker start`" in line and "submit again with --batch-id b1" in line


def test_results_with_the_broker_down(tmp_path):
    cfg = _config(tmp_path, f'[kafka]\nbootstrap_servers = "127.0.0.1:{_free_port()}"\n')
    line = _one_error_line(_lorabatch(tmp_path, "results", "--tenant", "acme", "--batch-id", "b1", "-c", cfg))
    assert "failed (KafkaConnectionError" in line and "then run the command again" in line


@pytest.mark.parametrize(("option", "args"), [("--tenant", ["--tenant", "-acme", "--batch-id", "b1"]),
                                              ("--batch-id", ["--tenant", "acme", "--batch-id", "b" * 300])])
def test_results_of_an_id_no_job_can_carry_is_refused_before_the_broker(tmp_path, option, args):
    """`results` for a tenant or batch id the job contract refuses: no job can hold it, and the command read the whole
    jobs topic before saying "no batch ..."; with the broker down it reported the broker instead. Said first, naming the
    option and the rule, as `submit` does."""
    cfg = _config(tmp_path, f'[kafka]\nbootstrap_servers = "127.0.0.1:{_free_port()}"\n')
    line = _one_error_line(_lorabatch(tmp_path, "results", *args, "-c", cfg))
    assert line.startswith(f"error: {option} ") and "is not usable: write" in line and "Kafka" not in line, line


@pytest.mark.parametrize("args", [["invoice", "--tenant", "acme", "--period", "2026-01"], ["report", "finance"], ["tenants", "list"]])
def test_ledger_unreachable(tmp_path, args):
    cfg = _config(tmp_path, f'[ledger]\nurl = "postgresql+psycopg://nobody@127.0.0.1:{_free_port()}/test"\n')
    line = _one_error_line(_lorabatch(tmp_path, *args, "-c", cfg))
    assert line.startswith("error: the ledger database cannot be reached (") and "Connection refused" in line
    assert "set ledger.url to a running one" in line


@pytest.mark.parametrize("args", [["invoice", "--tenant", "acme", "--period", "2026-01"], ["db", "upgrade"]])
def test_a_ledger_that_takes_the_connection_and_never_answers(tmp_path, args):
    """A server that is paused or cut off (`docker pause`): the TCP connection is taken (here by the kernel, for a socket
    that listens and never accepts) and nothing answers. The command ends with the one error line after libpq's
    connect_timeout (billing.db.PG_CONNECT_TIMEOUT_S), where it waited for ever."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        cfg = _config(tmp_path, f'[ledger]\nurl = "postgresql+psycopg://nobody@127.0.0.1:{port}/test"\n')
        line = _one_error_line(_lorabatch(tmp_path, *args, "-c", cfg, timeout=90))
    assert line.startswith("error: the ledger database cannot be reached (") and "timeout" in line, line


def test_wrong_model_dir(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    line = _one_error_line(_lorabatch(tmp_path, "generate", "--jobs", str(path), "--model", str(tmp_path / "no-model")))
    assert "no-model" in line and "is missing" in line and "set engine.model_dir (or --model)" in line
    assert "`lorabatch make-demo-model DIR`" in line


def test_a_sigterm_while_the_engine_process_builds_its_engine(tmp_path, demo_set):
    """SIGTERM during the worker's start-up, while its engine process builds the engine: the worker kills the child,
    logs why it stopped as its last JSON line and exits 0 (it died of the signal at once, and its child went on to build
    the engine, then printed a BrokenPipeError traceback)."""
    cfg = _config(tmp_path, f'[engine]\nmodel_dir = "{demo_set["model"]}"\ndevice = "cpu"\n'
                            f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n')
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    worker = subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "-c", cfg], cwd=tmp_path, env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(worker.stderr.readline())
        assert first["msg"].endswith("building its engine on cpu"), first
        child = int(first["msg"].split()[2])
        worker.send_signal(signal.SIGTERM)  # the child is still importing torch
        rest = worker.stderr.read()
        assert worker.wait(60) == 0, rest
    finally:
        worker.kill()
    lines = [json.loads(x) for x in rest.splitlines() if x.strip()]  # every line is JSON: no child's traceback
    assert lines and lines[-1]["msg"] == "stopped while the engine process was building its engine; nothing was fetched", rest
    assert not os.path.exists(f"/proc/{child}") or "zombie" in Path(f"/proc/{child}/status").read_text(), "the child is gone"


def test_a_worker_whose_spool_disk_is_full_waits_for_space(tmp_path, demo_set):
    """The disk under the spool is full when the worker starts (its file from an earlier run is there): the worker waits
    for space, a log line per attempt naming the full disk, and goes on once there is space (here to its broker, which
    is down); SIGTERM then exits 0. It exited with status 2 ("set worker.spool_path to a file in a writable folder"),
    which an orchestrator restarts: a crash loop, each turn building the engine again, for as long as the disk was full."""
    from billing.db import upgrade
    from consumer.spool import Spool
    from migrations import SCRIPT_LOCATION

    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("a full disk is a tmpfs of 1 MiB, which only root may mount")
    try:
        Spool(full / "w.sqlite", 100).close()  # a spool of the worker's earlier run
        with open(full / "filler", "wb") as filler, pytest.raises(OSError):
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
        upgrade(ledger, script_location=SCRIPT_LOCATION)
        cfg = _config(tmp_path, f'[kafka]\nbootstrap_servers = "127.0.0.1:{_free_port()}"\n'
                                f'[engine]\nmodel_dir = "{demo_set["model"]}"\ndevice = "cpu"\n'
                                f'[worker]\nspool_path = "{full / "w.sqlite"}"\nwait_max_s = 1.0\n[ledger]\nurl = "{ledger}"\n')
        env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
        worker = subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "-c", cfg], cwd=tmp_path, env=env,
                                  stderr=subprocess.PIPE, text=True)
        try:
            lines = []

            def until(start: str) -> dict:
                while line := worker.stderr.readline():
                    lines.append(json.loads(line))
                    if lines[-1]["msg"].startswith(start):
                        return lines[-1]
                raise AssertionError(f"the worker exited with {worker.wait()} before logging {start!r}: {lines}")

            waiting = until("waiting for space for the worker's spool: attempt 1 failed")
            assert "its disk is full" in waiting["msg"] and "free space" in waiting["msg"], waiting
            (full / "filler").unlink()
            until("waiting for the Kafka broker")
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(60) == 0, worker.stderr.read()
        finally:
            worker.kill()
    finally:
        subprocess.run(["umount", "-l", str(full)])


def test_db_upgrade_takes_its_revision_as_the_readme_writes_it(tmp_path):
    """`lorabatch db upgrade|downgrade REV` (the README's table): the revision positional for both, `--revision` still
    read; two revisions that differ are refused."""
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "0001", "-c", cfg).returncode == 0
    assert _lorabatch(tmp_path, "db", "upgrade", "head", "-c", cfg).returncode == 0
    down = _lorabatch(tmp_path, "db", "downgrade", "0001", "-c", cfg)
    assert down.returncode == 0 and "dropped with their data" in down.stderr, down.stderr
    assert _lorabatch(tmp_path, "db", "upgrade", "--revision", "head", "-c", cfg).returncode == 0
    both = _lorabatch(tmp_path, "db", "upgrade", "0002", "--revision", "head", "-c", cfg)
    assert both.returncode == 2 and "differ" in both.stderr, both.stderr


def test_worker_with_a_wrong_model_dir(tmp_path):
    """The worker's ledger is fine (migrated), its model folder is not there: the model is named, not a traceback."""
    db = tmp_path / "ledger.db"
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{db}"\n[engine]\nmodel_dir = "{tmp_path / "nothing"}"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "-c", cfg).returncode == 0
    out = _lorabatch(tmp_path, "worker", "-c", cfg)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    last = json.loads(out.stderr.strip().splitlines()[-1])  # the worker logs JSON lines, its last word too
    assert last["level"] == "ERROR" and "nothing" in last["msg"] and "set engine.model_dir" in last["msg"]
    assert all(json.loads(x) for x in out.stderr.splitlines() if x.strip())


def test_missing_config_file(tmp_path, jobs_file):
    line = _one_error_line(_lorabatch(tmp_path, "submit", jobs_file, "--tenant", "acme", "-c", str(tmp_path / "nope.toml")))
    assert "nope.toml does not exist" in line


@pytest.mark.parametrize("text", ["[kafka\nx=", "[kafka]\npartitions = 'four'\n", "[nosuch]\nx = 1\n", "\x00\x01"])
def test_bad_config(tmp_path, text):
    line = _one_error_line(_lorabatch(tmp_path, "config", "show", "-c", _config(tmp_path, text)))
    assert "lorabatch.toml" in line


def test_bad_ledger_url(tmp_path):
    line = _one_error_line(_lorabatch(tmp_path, "tenants", "list", "-c", _config(tmp_path, '[ledger]\nurl = "nonsense"\n')))
    assert "ledger" in line


def test_debug_shows_the_traceback(tmp_path):
    """--debug: the traceback, then the same one line, and still exit status 2."""
    cfg = _config(tmp_path, f'[ledger]\nurl = "postgresql+psycopg://nobody@127.0.0.1:{_free_port()}/test"\n')
    out = _lorabatch(tmp_path, "--debug", "tenants", "list", "-c", cfg)
    assert out.returncode == 2
    assert "Traceback (most recent call last)" in out.stderr and "sqlalchemy.exc.OperationalError" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: the ledger database cannot be reached")


def test_a_long_error_is_not_wrapped(tmp_path):
    """A path longer than any terminal stays on the error's one line."""
    long = tmp_path / ("d" * 150) / "x.toml"
    line = _one_error_line(_lorabatch(tmp_path, "config", "show", "-c", str(long)))
    assert str(long) in line


class _Typed(Exception):
    retriable = False


@pytest.mark.parametrize(("error", "said"), [
    (_Typed("the thing failed; do this"), "the thing failed; do this"),
    (FileNotFoundError(2, "No such file or directory", "/x/y"), "No such file or directory: /x/y; check the path"),
    (ConnectionRefusedError(111, "Connection refused"), "a connection failed"),
    (_Typed("two\nlines"), "two lines"),
])
def test_operational_errors_are_recognised(error, said):
    assert said in operational_message(error)


@pytest.mark.postgres
def test_a_refused_login_and_a_missing_database_are_not_called_unreachable():
    """A ledger.url whose role PostgreSQL does not know, or whose database it does not hold, and a routing.redis_url
    whose credentials Redis refuses, were each said to be "cannot be reached ...; start it": the service was up, and
    it was the URL to fix. The errors are the services' own (the machine's PostgreSQL and Redis)."""
    import redis
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    said = []
    for url in ("postgresql+psycopg://no_such_role@127.0.0.1:5432/test", "postgresql+psycopg://postgres@127.0.0.1:5432/no_such_db"):
        db = create_engine(url)
        with pytest.raises(OperationalError) as e:
            db.connect()
        db.dispose()
        said.append(operational_message(e.value))
    client = redis.Redis.from_url("redis://no_such_user:wrong@127.0.0.1:6379/13")
    with pytest.raises(redis.AuthenticationError) as e:
        client.ping()
    client.close()
    said.append(operational_message(e.value))
    assert said[0].startswith("the ledger database refused the login (") and "USER:PASSWORD@HOST" in said[0], said
    assert said[1].startswith("the ledger database does not exist (") and "createdb" in said[1], said
    assert said[2].startswith("Redis refused the login (") and "routing.redis_url" in said[2], said
    assert not any("cannot be reached" in x for x in said), said


@pytest.mark.parametrize("error", [AssertionError("x"), TypeError("y"), KeyError("z"), ValueError("v"), ZeroDivisionError()])
def test_programmer_mistakes_keep_their_traceback(error, monkeypatch):
    """A bug is not dressed up as an operational error: run() lets it through for its traceback."""
    assert operational_message(error) is None
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        raise error

    monkeypatch.setattr(sys, "argv", ["lorabatch"])
    with pytest.raises(type(error)):
        run(app)


def test_run_turns_an_operational_error_into_exit_2(capsys, monkeypatch):
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        raise _Typed("the ledger is behind;\n run `lorabatch db upgrade`")

    monkeypatch.setattr(sys, "argv", ["lorabatch"])
    with pytest.raises(SystemExit) as exit_:
        run(app)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: the ledger is behind; run `lorabatch db upgrade`" in err


def test_no_user_visible_text_names_the_design_notes():
    """Messages, help and the README point to the README's sections, never to files users do not have."""
    root = Path(__file__).resolve().parents[1]
    named = []
    user_facing = ["README.md", "consumer/schemas.py", "consumer/submit.py", "consumer/openai_batch.py", "consumer/offline.py",
                   "consumer/demo.py", "consumer/config.py", "consumer/logs.py"]
    for path in [*(root / p for p in user_facing), *root.glob("consumer/cli/*.py")]:
        text = path.read_text(encoding="utf-8")
        for word in ("DESIGN.md", "STYLE.md", "../shared"):
            if word in text:
                named.append(f"{path.relative_to(root)}: {word}")
    assert named == []
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "## Job and result contract" in readme


@pytest.mark.postgres
def test_db_commands_do_not_print_the_ledger_password(tmp_path, pg_database):
    """What `db upgrade` and `db downgrade` print names the ledger with its password masked (they printed the URL
    whole). The machine's PostgreSQL trusts local connections, so any password reaches a schema of the test's own."""
    from sqlalchemy.engine import make_url

    from tests.db_fixtures import fresh_pg_schema

    with fresh_pg_schema(pg_database) as url:
        secret = make_url(url).set(password="hunter2-secret").render_as_string(hide_password=False)
        cfg = _config(tmp_path, f"[ledger]\nurl = '{secret}'\n")
        for args in (("upgrade",), ("downgrade", "0001")):
            out = _lorabatch(tmp_path, "db", *args, "-c", cfg)
            assert out.returncode == 0, out.stderr
            assert "hunter2-secret" not in out.stdout + out.stderr and "***" in out.stdout, (out.stdout, out.stderr)


def test_a_metrics_port_in_use_names_the_port_and_the_key():
    """A metrics port another process holds: the error names the port and worker.metrics_port, not "check the path"."""
    from consumer.config import ConfigError
    from consumer.metrics import WorkerMetrics

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port}.*worker.metrics_port"):
            WorkerMetrics().serve(port)


def test_a_broker_killed_and_not_yet_reaped_is_not_running(tmp_path):
    """`lorabatch broker start` right after a kill -9: the dead process, not yet reaped by its parent, holds its pid;
    it is not taken for a running broker (an operator's drill got a misleading bootstrap error, then a second try
    worked)."""
    from consumer.broker import BrokerDaemon

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):  # exited, not waited for: a zombie
        if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            break
        time.sleep(0.01)
    daemon = BrokerDaemon(tmp_path / "state", "127.0.0.1", 1)
    daemon.state_dir.mkdir(parents=True, exist_ok=True)
    daemon.pid_file.write_text(str(child.pid))
    try:
        assert daemon.pid() is None
    finally:
        child.wait()


@pytest.mark.parametrize("named", ["foreign", "0", "-1", "1"])
def test_broker_stop_signals_nothing_but_its_own_broker(tmp_path, named):
    """A pid file outlives its broker and its number may be another process's: `broker stop` signalled whatever it
    named (an unrelated process; with 0 its own process group, with -1 every process). Now a pid file that does not
    name this port's Tansu broker is stale: removed, nothing signalled, and `stop` says no broker ran."""
    from consumer.broker import BrokerDaemon

    daemon = BrokerDaemon(tmp_path / "state", "127.0.0.1", 19999)
    daemon.state_dir.mkdir(parents=True, exist_ok=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        daemon.pid_file.write_text(str(live.pid) if named == "foreign" else named)
        assert daemon.pid() is None and not daemon.pid_file.exists()
        daemon.pid_file.write_text(str(live.pid) if named == "foreign" else named)
        assert daemon.stop(timeout_s=0.5) is False and not daemon.pid_file.exists()
        assert live.poll() is None, "the unrelated process was signalled"
    finally:
        live.kill()
        live.wait()


def test_broker_daemon_knows_its_own_broker(tmp_path):
    """The broker `start` ran is recognised by its pid file (its command line names this port), and stopped."""
    from consumer.broker import BrokerDaemon, free_port

    daemon = BrokerDaemon(tmp_path / "state", "127.0.0.1", free_port())
    pid = daemon.start(["t"], 1, 20.0)
    try:
        assert daemon.pid() == pid
        other = BrokerDaemon(tmp_path / "state", "127.0.0.1", daemon.port + 1)
        other.pid_file.write_text(str(pid))  # another port's pid file naming this broker: not that port's broker
        assert other.pid() is None
    finally:
        assert daemon.stop() is True
    assert daemon.pid() is None


def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "nonutf.toml"
    path.write_bytes(b"\xff\xfe[worker]\n")
    line = _one_error_line(_lorabatch(tmp_path, "config", "show", "--config", str(path)))
    assert "nonutf.toml is not UTF-8 text" in line


def test_a_config_path_that_is_a_directory(tmp_path):
    (tmp_path / "adir").mkdir()
    line = _one_error_line(_lorabatch(tmp_path, "config", "show", "--config", "adir"))
    assert "config file adir is a directory" in line


def test_the_worker_refuses_a_section_that_is_not_a_table_as_config_show_does(tmp_path):
    """`worker = 5` with --worker-id: the worker says what `config show` says (it logged a CRITICAL TypeError)."""
    cfg = _config(tmp_path, "worker = 5\n")
    worker = _one_error_line(_lorabatch(tmp_path, "worker", "--config", cfg, "--worker-id", "w1"))
    assert worker == _one_error_line(_lorabatch(tmp_path, "config", "show", "--config", cfg))
    assert "worker: must be a table, not 5" in worker


@pytest.mark.parametrize("worker_id", ["w" * 300, "../../escape", ".hidden"])
def test_a_worker_id_is_checked_before_the_worker_starts(tmp_path, worker_id):
    """The worker id names the spool file: 300 characters stopped the worker with sqlite's "unable to open database
    file", and '../../escape' wrote the spool outside .lorabatch/spool."""
    (tmp_path / "run").mkdir()
    line = _one_error_line(_lorabatch(tmp_path / "run", "worker", "--worker-id", worker_id))
    assert line.startswith("error: --worker-id '") and "is not a worker id: write 1 to 64" in line
    assert "worker.worker_id" in line
    assert not list(tmp_path.rglob("*.sqlite")), "no spool file was made"


@pytest.mark.parametrize("command", ["upgrade", "downgrade"])
def test_db_migrate_to_a_revision_that_does_not_exist(tmp_path, command):
    """An unknown REVISION: one line naming it and the valid ones (Alembic's CommandError was a traceback); a downgrade
    says so before its warning about dropped data, which does not apply."""
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "-c", cfg).returncode == 0
    line = _one_error_line(_lorabatch(tmp_path, "db", command, "nosuchrev", "-c", cfg))
    assert "REVISION 'nosuchrev'" in line and "Can't locate revision" in line
    assert "0001, 0002" in line and f"{SCHEMA_REVISION} is the newest" in line


def test_db_downgrade_to_a_later_revision_names_the_ledger_revision(tmp_path):
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "0002", "-c", cfg).returncode == 0
    out = _lorabatch(tmp_path, "db", "downgrade", "0003", "-c", cfg)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: REVISION '0003'") and "the ledger is at 0002" in out.stderr


@pytest.mark.parametrize("args", [["tenants", "list"], ["invoice", "--tenant", "acme", "--period", "2026-01"],
                                  ["db", "upgrade"], ["db", "downgrade", "0001"]])
def test_a_ledger_newer_than_this_lorabatch(tmp_path, args):
    """A ledger a newer lorabatch migrated: upgrade lorabatch, not `db upgrade` (which cannot move it, and was a
    traceback)."""
    import sqlite3

    db = tmp_path / "ledger.db"
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{db}"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "-c", cfg).returncode == 0
    with sqlite3.connect(db) as c:
        c.execute("UPDATE alembic_version SET version_num = '9999_future'")
    line = _one_error_line(_lorabatch(tmp_path, *args, "-c", cfg))
    assert (f"is at revision 9999_future, which this lorabatch does not know (newer than its {SCHEMA_REVISION}?); "
            f"upgrade lorabatch") in line
    assert "run `lorabatch db upgrade`" not in line


@pytest.mark.parametrize(("option", "value"), [("--batch-id", "bad id/\u00fc;$(x)"), ("--tenant", "ac me"),
                                               ("--batch-id", "b" * 129), ("--tenant", "-acme")])
def test_submit_checks_its_ids_once_before_the_lines(tmp_path, option, value):
    """A batch id or tenant the job contract refuses: one line naming the option and the rule, before any line is read
    or the broker dialled (each of the file's lines was rejected with the same message, and the exit status was 1)."""
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{n}"}) + "\n" for n in range(20)))
    ids = {"--tenant": "acme", "--batch-id": "b1", option: value}
    cfg = _config(tmp_path, f'[kafka]\nbootstrap_servers = "127.0.0.1:{_free_port()}"\n')
    out = _lorabatch(tmp_path, "submit", str(path), *[x for kv in ids.items() for x in kv], "-c", cfg)
    line = _one_error_line(out)
    assert line.startswith(f"error: {option} ") and "is not usable: write 1 to" in line
    assert out.stdout == ""


def test_a_sqlite_ledger_fault_is_said_as_what_it_is_not_as_unreachable(tmp_path):
    """A SQLite ledger's file that this user cannot write, a table missing from it: sqlite3 raises OperationalError for
    both, and both were said as "the ledger database cannot be reached (...); start it, or set ledger.url to a running
    one", which a file cannot be. Each now names its own fix."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    path = tmp_path / "ledger.db"
    sqlite3.connect(path).close()
    said = []
    for uri, statement in ((f"file:{path}?mode=ro", "CREATE TABLE t (x)"), (f"file:{path}", "SELECT * FROM usage")):
        with pytest.raises(sqlite3.OperationalError) as e:
            sqlite3.connect(uri, uri=True).execute(statement)
        said.append(operational_message(OperationalError(statement, {}, e.value)))
    assert not any("cannot be reached" in x or "start it" in x for x in said), said
    assert "readonly database" in said[0] and "write access to the ledger file and its folder" in said[0]
    assert "no such table: usage" in said[1] and "run `lorabatch db upgrade`" in said[1]


@pytest.mark.parametrize("content", [b"not a ledger\n" * 100, b"SQLite format 3\x00" + b"\x00" * 4080])
def test_a_ledger_url_naming_a_file_that_is_no_sqlite_database(tmp_path, content):
    """ledger.url at a file that is not a SQLite database (a typo naming another file, a damaged copy) is said as such;
    it was told to run `lorabatch db upgrade`, which fails the same way."""
    (tmp_path / "notes.txt").write_bytes(content)
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{tmp_path / "notes.txt"}"\n')
    for args in (("tenants", "list"), ("db", "upgrade")):
        line = _one_error_line(_lorabatch(tmp_path, *args, "-c", cfg))
        assert "db upgrade" not in line, line
        assert "not a SQLite database" in line and "set ledger.url" in line, line


@pytest.mark.parametrize("kind", ["character device", "folder", "FIFO (a named pipe)"])
def test_a_ledger_url_naming_no_regular_file(tmp_path, kind):
    """ledger.url at /dev/null (a folder, a FIFO) is named as no regular file, so no SQLite database, with the key and the
    fix; /dev/null was said as "free space on the ledger file's disk" by `db upgrade` and as "no schema yet; run
    `lorabatch db upgrade`" by the others."""
    path = {"character device": Path("/dev/null"), "folder": tmp_path / "ledger.db", "FIFO (a named pipe)": tmp_path / "pipe"}[kind]
    if kind == "folder":
        path.mkdir()
    elif kind.startswith("FIFO"):
        os.mkfifo(path)
    cfg = _config(tmp_path, f'[ledger]\nurl = "sqlite:///{path}"\n')
    for args in (("tenants", "list"), ("db", "upgrade")):
        line = _one_error_line(_lorabatch(tmp_path, *args, "-c", cfg, timeout=60))
        assert f"ledger.url names {path}, a {kind}, not a regular file: it is no SQLite database" in line, line
        assert "set ledger.url to the ledger's file" in line and "free space" not in line, line


def test_the_projects_own_error_keeps_its_fix_past_400_characters():
    """A typed error says its fix last; one naming a long path twice (a spool file's, 250 characters) was cut at 400
    characters, fix and all, by the brief that bounds libraries' messages."""
    from consumer.config import ConfigError

    path = "/srv/" + "deep/" * 50 + "spool.sqlite"
    message = operational_message(ConfigError(f"the spool file {path} cannot be opened; move {path} aside and start again"))
    assert message is not None and message.endswith("move " + path + " aside and start again"), message
