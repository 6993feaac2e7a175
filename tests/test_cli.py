"""The `lorabatch` command line: each command does its job and answers bad input with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumer.cli import build_app

app = build_app()
runner = CliRunner()


def run(*args: str, ok: bool = True):
    result = runner.invoke(app, list(args))
    if ok:
        assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def config(tmp_path, ledger_url):
    path = tmp_path / "lorabatch.toml"
    path.write_text(f'[ledger]\nurl = "{ledger_url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    return str(path)



@pytest.mark.parametrize(
    ("pairs", "says"),
    [
        (["1=50", "1=0", "2=10"], "version 1 is given twice (1=50 and 1=0); give each version once"),
        (["\u00b2=5"], "write VERSION=WEIGHT"),
        (["1=\uff15\uff10"], "write VERSION=WEIGHT"),
        (["1=99999999999", "2=0"], "weight 99999999999 is too large; give weights from 0 to 2147483647"),
        (["1=" + "9" * 5000, "2=0"], "weight 99999999999999999999... has 5000 digits; give weights from 0 to 2147483647"),
        (["1" * 5000 + "=5"], "version 11111111111111111111... has 5000 digits; a version has at most 9"),
    ],
    ids=["a version twice", "superscript digit", "fullwidth digits", "over the column", "a weight of 5,000 digits",
         "a version of 5,000 digits"],
)
def test_traffic_refuses_what_it_cannot_apply_as_written(config, demo_set, pairs, says):
    """`adapters traffic` answers a version given twice, digits that are not ASCII, a weight the column cannot hold and
    a number of more than 4,300 digits (int() raised ValueError, a traceback) with one error line (status 2) and changes nothing, where it kept the last pair in silence, stopped with a ValueError
    traceback, or passed the database's "integer out of range" on."""
    adapters = demo_set["adapters"]
    run("tenants", "add", "acme", "--config", config)
    for name in sorted(adapters)[:2]:
        run("adapters", "add", "--tenant", "acme", "support", str(adapters[name]), "--config", config)
    bad = run("adapters", "traffic", "--tenant", "acme", "support", *pairs, "--config", config, ok=False)
    assert bad.exit_code == 2, (bad.exception, bad.output)
    assert says in bad.output and "Traceback" not in bad.output, bad.output
    listed = run("adapters", "list", "--tenant", "acme", "--config", config).stdout
    assert [line.split("\u2502")[7].strip() for line in listed.splitlines() if "support@" in line] == ["0", "100"]

def test_config_show_is_valid_toml(config):
    out = run("config", "show", "--config", config).stdout
    assert tomllib.loads(out)["store"]["adapter_dir"].endswith("store")


def test_config_show_masks_the_passwords_in_its_urls(tmp_path):
    """`config show` printed ledger.url and routing.redis_url as written, passwords and all, to a terminal or a ticket;
    they read *** now, the output stays valid TOML, and --show-passwords prints them (to write a config file from)."""
    path = tmp_path / "lorabatch.toml"
    path.write_text('[ledger]\nurl = "postgresql+psycopg://billing:s3cr%40t@db.internal:5432/ledger"\n'
                    '[routing]\ncache = "redis"\nredis_url = "redis://:hunter2@cache.internal:6379/3"\n')
    out = run("config", "show", "--no-sizes", "--config", str(path)).stdout
    assert "s3cr" not in out and "hunter2" not in out, out
    data = tomllib.loads(out)
    assert data["ledger"]["url"] == "postgresql+psycopg://billing:***@db.internal:5432/ledger"
    assert data["routing"]["redis_url"] == "redis://:***@cache.internal:6379/3"
    shown = tomllib.loads(run("config", "show", "--no-sizes", "--show-passwords", "--config", str(path)).stdout)
    assert shown["ledger"]["url"].endswith("billing:s3cr%40t@db.internal:5432/ledger")
    assert shown["routing"]["redis_url"] == "redis://:hunter2@cache.internal:6379/3"


@pytest.mark.parametrize("url", ["sqlite:///.lorabatch/ledger.db", "postgresql+psycopg://billing@db/ledger",
                                 "redis://127.0.0.1:6379/0", "unix:///run/redis.sock?db=2", "not a url",
                                 "redis://cache:6379/0?client_name=a@b", "redis://[::1]:6379/0?client_name=a@b",
                                 "postgresql+psycopg://[::1]:5432/ledger", "postgresql+psycopg://billing@db/ledger?sslmode=require"])
def test_a_url_without_a_password_is_shown_as_written(url):
    from consumer.config import url_without_password

    assert url_without_password(url) == url


def test_registry_commands(config, demo_set):
    adapters = demo_set["adapters"]
    name = sorted(adapters)[0]
    run("tenants", "add", "acme", "--rpm", "100", "--config", config)
    assert "acme" in run("tenants", "list", "--config", config).stdout
    assert "exists already" in run("tenants", "add", "acme", "--config", config, ok=False).output
    out = run("adapters", "add", "--tenant", "acme", "support", str(adapters[name]), "--default", "--config", config).stdout
    assert "support@1 registered" in out
    assert "unchanged" in run("adapters", "add", "--tenant", "acme", "support", str(adapters[name]), "--config", config).stdout
    run("adapters", "add", "--tenant", "acme", "support", str(adapters[sorted(adapters)[1]]), "--canary", "20", "--config", config)
    assert "support@1: 80%, support@2: 20%" in run("adapters", "traffic", "--tenant", "acme", "support", "1=80", "2=20",
                                                   "--config", config).stdout
    assert "support@2" in run("adapters", "list", "--config", config).stdout
    out = run("routes", "add", "--tenant", "acme", "--kind", "prefix", "/sql", "support", "--config", config).stdout
    rule_id = out.split()[1]
    assert "/sql" in run("routes", "list", "--config", config).stdout
    run("routes", "remove", rule_id, "--config", config)
    bad = run("routes", "add", "--tenant", "acme", "--kind", "regex", "(", "support", "--config", config, ok=False)
    assert bad.exit_code == 2 and "does not compile" in bad.output
    for args, says in ((["billing", "globex-private-nonexistent"], "ADAPTER 'globex-private-nonexistent' does not exist"),
                       (["refund", "sup@x"], "write NAME or NAME@VERSION"),
                       (["refund", "support@7"], "'support' has no version 7"),
                       (["--position", "-999999999999999999999", "refund", "support"], "give --position a whole number")):
        refused = run("routes", "add", "--tenant", "acme", *args, "--config", config, ok=False)
        assert refused.exit_code == 2 and says in refused.stderr and "ledger database" not in refused.stderr, refused.output
    assert "refund" not in run("routes", "list", "--config", config).stdout
    missing = run("adapters", "add", "--tenant", "ghost", "x", str(adapters[name]), "--config", config, ok=False)
    assert "tenants add ghost" in missing.output


def test_names_that_look_like_markup_are_listed_as_written(config):
    """A display name is the tenant's to choose: "[/oops]" or "[bold]x" in a table cell is text, not rich markup."""
    run("tenants", "add", "evil", "--name", "[/oops] [bold]x", "--config", config)
    assert "[/oops] [bold]x" in run("tenants", "list", "--config", config).stdout


def test_commands_refuse_an_unmigrated_ledger(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "empty.db"}"\n')
    out = run("tenants", "list", "--config", str(path), ok=False)
    assert out.exit_code == 2 and "lorabatch db upgrade" in out.output


def test_bad_config_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[worker]\nmax_batch_size = -1\n")
    out = run("config", "show", "--config", str(path), ok=False)
    assert out.exit_code == 2 and "worker.max_batch_size" in out.output


def test_generate_offline_in_input_order(tmp_path, demo_set):
    """One result line per job, in input order; bad lines become failed lines in their place."""
    adapters = demo_set["adapters"]
    a, b = sorted(adapters)[:2]
    jobs = tmp_path / "jobs.jsonl"
    lines = [
        {"prompt": "hello world", "max_new_tokens": 4, "adapter": a, "logprobs": 2},
        {"input_ids": [1, 10, 20], "max_new_tokens": 3},
        "{broken",
        {"prompt": "x", "adapter": "not-given"},
        {"prompt": "hi there", "max_new_tokens": 5, "adapter": b, "temperature": 0.9, "seed": 4},
    ]
    jobs.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = run("generate", "--model", str(demo_set["model"]), "--adapter", f"{a}={adapters[a]}",
              "--adapter", f"{b}={adapters[b]}", "--jobs", str(jobs)).stdout
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["request_id"] for r in results] == ["line-1", "line-2", "line-3", "line-4", "line-5"]
    first, second, broken, unknown, sampled = results
    assert first["status"] == "succeeded" and len(first["output_ids"]) <= 4 and first["adapter"] == a
    assert len(first["logprobs"]["content"]) == len(first["output_ids"])
    assert len(first["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert second["finish_reason"] in ("length", "eos", "stop")
    assert broken["status"] == "failed" and "line 3" in broken["error"]["message"]
    assert unknown["error"]["code"] == "unknown_adapter" and "--adapter not-given=DIR" in unknown["error"]["message"]
    assert sampled["status"] == "succeeded"
    again = run("generate", "--model", str(demo_set["model"]), "--adapter", f"{a}={adapters[a]}",
                "--adapter", f"{b}={adapters[b]}", "--jobs", str(jobs)).stdout
    assert again == out, "greedy and seeded jobs are reproducible"


def test_generate_names_a_line_of_other_bytes_and_goes_on(tmp_path, demo_set):
    """A line that is not UTF-8 is that line's failed result, a BOM before the first line no content, and a field's
    error says what the field takes: the whole command ended in a UnicodeDecodeError traceback, and a BOM failed line 1."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "caf\xe9"}\n{"prompt": "b", "stop": [""]}\n')
    out = run("generate", "--model", str(demo_set["model"]), "--jobs", str(jobs)).stdout
    first, latin1, stop = [json.loads(line) for line in out.splitlines()]
    assert first["status"] == "succeeded", first
    assert latin1["error"]["message"] == "line 2: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"
    assert stop["error"]["field"] == "stop.0" and "send a list of up to 8 strings" in stop["error"]["message"]


def test_generate_bad_arguments(tmp_path, demo_set):
    out = run("generate", "--model", str(demo_set["model"]), "--adapter", "no-equals-sign", "--jobs", "x.jsonl", ok=False)
    assert "NAME=DIR" in out.output


def test_make_demo_model(tmp_path):
    out = run("make-demo-model", str(tmp_path / "demo")).stdout
    assert (tmp_path / "demo" / "model" / "tokenizer.json").is_file()
    assert out.count("adapter ") == 8


_NO_ENGINE = """
import sys
from consumer.cli import build_app
app = build_app()
for args in ([], ["tenants", "list"], ["adapters", "list"], ["routes", "list"], ["prices", "list"], ["config", "show", "--no-sizes"]):
    try:
        app([*args, *sys.argv[1:]] if args else ["--help"], standalone_mode=False)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "triton", "aiokafka") if m in sys.modules))
"""


def test_admin_commands_load_no_engine(config):
    """`lorabatch --help` and the registry, price and config commands never import torch, triton or aiokafka (`config show`
    only for the engine sizes it derives from the device, which --no-sizes leaves out)."""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _NO_ENGINE, "--config", config], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


_LISTING = """
import sys
from consumer.cli import build_app
try:
    build_app()(["tenants", "list", *sys.argv[1:]], standalone_mode=False)
except SystemExit:
    pass
print(sorted(m for m in ("torch", "triton", "aiokafka", "sqlalchemy.orm", "billing.models", "consumer.registry") if m in sys.modules))
"""


def test_tenants_list_loads_no_orm(config):
    """`lorabatch tenants list` reads through SQLAlchemy Core: it imports neither torch nor sqlalchemy.orm
    (nor the ORM models or the registry), and still lists what `tenants add` wrote."""
    run("tenants", "add", "acme", "--config", config)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _LISTING, "--config", config], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "[]", done.stdout
    assert any("acme" in line for line in lines[:-1]), done.stdout


@pytest.mark.parametrize("url, shown", [
    # SQLAlchemy reads a password up to the first @, slashes and all (a base64 secret holds /): it was printed whole
    ("postgresql+psycopg://billing:ab/cd+ef@db:5432/ledger", "postgresql+psycopg://billing:***@db:5432/ledger"),
    ("postgresql+psycopg://billing:a/b?c@db/ledger", "postgresql+psycopg://billing:***@db/ledger"),
    # a password as a query parameter (libpq's and redis-py's `password=`, redis-py's way for a unix socket)
    ("postgresql+psycopg://billing@db/ledger?password=s3cret&sslmode=require",
     "postgresql+psycopg://billing@db/ledger?password=***&sslmode=require"),
    ("unix:///run/redis.sock?db=2&password=s3cret", "unix:///run/redis.sock?db=2&password=***"),
    ("redis://cache:6379/0?Password=s3cret", "redis://cache:6379/0?Password=***"),
    # an @ in the query does not move the user part past the host
    ("redis://:s3cret@cache:6379?client_name=a@b", "redis://:***@cache:6379?client_name=a@b"),
    ("redis://:s3@cret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    ("postgresql+psycopg://billing:s3cret@[::1]:5432/ledger", "postgresql+psycopg://billing:***@[::1]:5432/ledger"),
    ("postgresql+psycopg://billing:s3cret@/ledger?host=/run/pg", "postgresql+psycopg://billing:***@/ledger?host=/run/pg"),
])
def test_a_password_anywhere_in_a_url_is_masked(url, shown):
    """The masked URL never holds the password, wherever a parser of the URL would find it."""
    from consumer.config import url_without_password

    out = url_without_password(url)
    assert "s3cret" not in out and "cd+ef" not in out and "s3@cret" not in out, out
    assert out == shown
