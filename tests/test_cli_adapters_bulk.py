"""`lorabatch adapters add` of many adapters in one call (--dir, --glob, --manifest): the good ones are registered, each
bad one is reported by its path with the reason and leaves no row and no file behind, the exit status says whether any
failed, and a second identical call changes nothing."""

from __future__ import annotations

import json
import os
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from billing.db import make_engine, session_factory
from consumer.cli import build_app
from consumer.registry import Registry
from engine.demo_model import write_demo_adapter
from engine.store import AdapterStore

app = build_app()
runner = CliRunner()
SUMMARY = "{} adapters: {} registered, {} unchanged, {} failed"


def run(*args: str, code: int = 0):
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def config(tmp_path, ledger_url, demo_set):
    path = tmp_path / "lorabatch.toml"
    path.write_text(f'[ledger]\nurl = "{ledger_url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n'
                    f'[engine]\nmodel_dir = "{demo_set["model"]}"\n')
    run("tenants", "add", "acme", "--config", str(path))
    run("tenants", "add", "globex", "--config", str(path))
    return str(path)


@pytest.fixture
def registry(config, ledger_url, tmp_path):
    engine = make_engine(ledger_url)
    yield Registry(session_factory(engine), AdapterStore(tmp_path / "store", max_bytes=10**9))
    engine.dispose()


def _copy(demo_set, kind: str, dst: Path) -> Path:
    shutil.copytree(demo_set["adapters"][kind], dst)
    return dst


def _store_entries(tmp_path: Path) -> list[str]:
    """What the store holds: its entries and any temporary folder a failed write would have left."""
    return sorted(p.name for p in (tmp_path / "store").iterdir())


def _failures(result) -> dict[str, str]:
    """The `failed:` lines of a run's stderr, as {origin: reason}."""
    out = {}
    for line in result.stderr.splitlines():
        if line.startswith("failed: "):
            origin, _, reason = line.removeprefix("failed: ").partition(": ")
            out[origin] = reason
    return out


@pytest.fixture
def mixed_dir(tmp_path, demo_set) -> Path:
    """Four good adapter folders and one of each way to be bad."""
    root = tmp_path / "adapters"
    root.mkdir()
    for kind in ("qv-r4", "qkvo-r8", "all-r16", "mlp-r64"):
        _copy(demo_set, kind, root / kind)
    corrupt = _copy(demo_set, "qv-r16", root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (_copy(demo_set, "qv-r16", root / "no-config") / "adapter_config.json").unlink()
    write_demo_adapter(root / "rank-128", demo_set["model"], rank=128, target_modules=("q_proj",), alpha=16.0, seed=7)
    _copy(demo_set, "mlp-r4", root / "bad name!")
    pickled = _copy(demo_set, "qkvo-r64-rslora", root / "pickled")
    (pickled / "adapter_model.bin").write_bytes(b"not really a pickle")
    dir_weights = _copy(demo_set, "all-r8-rslora", root / "weights-is-a-folder")
    (dir_weights / "adapter_model.safetensors").unlink()
    (dir_weights / "adapter_model.safetensors").mkdir()
    (root / "notes.txt").write_text("a file among the folders\n")
    os.symlink("loop", root / "loop")  # a link to itself
    (root / ".cache").mkdir()  # hidden: skipped
    return root


def test_dir_registers_the_good_and_reports_each_bad_one(config, registry, mixed_dir, tmp_path):
    """Good folders are registered under their names; each bad one fails by its path with its reason; exit status 1;
    a failed folder leaves no row and nothing in the store."""
    result = run("adapters", "add", "--tenant", "acme", "--dir", str(mixed_dir), "--config", config, code=1)
    good = ["all-r16", "mlp-r64", "qkvo-r8", "qv-r4"]
    for name in good:
        assert f"adapter acme/{name}@1 registered: rank" in result.stdout
    failures = _failures(result)
    reasons = {Path(origin).name: reason for origin, reason in failures.items()}
    assert set(failures) == {str(mixed_dir / n) for n in reasons}, "each failure is named by its path"
    assert "corrupt or truncated" in reasons["corrupt"] and "re-save or re-download" in reasons["corrupt"]
    assert "adapter_config.json is missing" in reasons["no-config"]
    assert "r=128 is over engine.max_lora_rank=64" in reasons["rank-128"]
    assert "is invalid" in reasons["bad name!"] and "rename the folder" in reasons["bad name!"]
    assert "pickle-based weights are refused" in reasons["pickled"]
    assert "not a regular file" in reasons["weights-is-a-folder"]
    assert "is not a folder" in reasons["notes.txt"] and "is not a folder" in reasons["loop"]
    assert set(reasons) == {"corrupt", "no-config", "rank-128", "bad name!", "pickled", "weights-is-a-folder", "notes.txt", "loop"}
    assert SUMMARY.format(12, 4, 0, 8) in result.stdout
    views = registry.list_adapters("acme")
    assert sorted(v.name for v in views) == good
    assert _store_entries(tmp_path) == sorted(v.sha256 for v in views), "only the registered contents are stored"


def test_rerun_is_idempotent(config, registry, mixed_dir, tmp_path):
    """The same call again registers nothing: every good adapter is unchanged, the same ones fail."""
    run("adapters", "add", "--tenant", "acme", "--dir", str(mixed_dir), "--config", config, code=1)
    before = (registry.list_adapters(), _store_entries(tmp_path))
    again = run("adapters", "add", "--tenant", "acme", "--dir", str(mixed_dir), "--config", config, code=1)
    assert SUMMARY.format(12, 0, 4, 8) in again.stdout
    assert "adapter acme/qv-r4@1 unchanged (same content)" in again.stdout
    assert (registry.list_adapters(), _store_entries(tmp_path)) == before


def test_all_good_exits_0_and_new_content_is_the_next_version(config, registry, tmp_path, demo_set):
    root = tmp_path / "good"
    for kind in ("qv-r4", "qkvo-r8"):
        _copy(demo_set, kind, root / kind)
    first = run("adapters", "add", "--tenant", "acme", "--dir", str(root), "--quiet", "--config", config)
    assert first.stdout.strip() == SUMMARY.format(2, 2, 0, 0), "--quiet: the summary alone"
    shutil.rmtree(root / "qv-r4")
    _copy(demo_set, "qv-r16", root / "qv-r4")  # new content under the name
    second = run("adapters", "add", "--tenant", "acme", "--dir", str(root), "--config", config)
    assert "adapter acme/qv-r4@2 registered" in second.stdout and SUMMARY.format(2, 1, 1, 0) in second.stdout
    versions = registry.snapshot().versions("acme", "qv-r4")
    assert [(v.version, v.traffic_weight) for v in versions] == [(1, 0), (2, 100)]


def test_manifest(config, registry, tmp_path, demo_set):
    """Lines name, place and flag their adapters (relative paths from the manifest's folder, a tenant per line); each
    malformed line fails by its number and the rest are registered."""
    _copy(demo_set, "qv-r4", tmp_path / "m" / "a")
    _copy(demo_set, "qkvo-r8", tmp_path / "m" / "b")
    absolute = _copy(demo_set, "all-r16", tmp_path / "elsewhere")
    manifest = tmp_path / "m" / "adapters.jsonl"
    lines = [
        {"name": "support", "path": "a", "default": True},
        {"name": "shared", "path": "b", "public": True, "tenant": "globex"},
        {"name": "legal", "path": str(absolute)},
        "",
        "{broken",
        "[1, 2]",
        {"name": "x", "path": "a", "colour": "red"},
        {"name": "x", "path": ""},
        {"name": "x", "path": "a", "default": "yes"},
        {"name": "x", "path": "a", "canary": 150},
        {"name": "ghost-owned", "path": "a", "tenant": "ghost"},
        {"name": "nowhere", "path": "does-not-exist"},
        {"name": "bad/name", "path": "a"},
    ]
    manifest.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    result = run("adapters", "add", "--tenant", "acme", "--manifest", str(manifest), "--config", config, code=1)
    failures = _failures(result)
    by_line = {int(o.rsplit("line ", 1)[1].rstrip(")")): r for o, r in failures.items()}
    assert sorted(by_line) == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert "not JSON" in by_line[5] and "a JSON list, not an object" in by_line[6]
    assert "unknown key 'colour'" in by_line[7] and "'path' must be a non-empty string" in by_line[8]
    assert "'default' must be true or false" in by_line[9] and "canary=150" in by_line[10]
    assert "tenants add ghost" in by_line[11] and "does not exist" in by_line[12] and "fix the name" in by_line[13]
    assert str(tmp_path / "m" / "does-not-exist") in next(o for o in failures if o.endswith("line 12)"))
    assert SUMMARY.format(12, 3, 0, 9) in result.stdout
    snap = registry.snapshot()
    assert snap.defaults["acme"].name == "support"
    assert snap.versions("globex", "shared")[-1].is_public and snap.versions("acme", "shared")[-1].tenant_id == "globex"
    assert snap.versions("acme", "legal")[-1].rank == 16


def test_manifest_lines_nested_too_deep_or_with_a_key_twice_fail_alone(config, registry, tmp_path, demo_set):
    """A line nested 100,000 deep (RecursionError in json), a line with a key twice (json kept the last) and a number of
    5,000 digits (int()'s ValueError, which aborted the whole call with a traceback) each fail by
    their number as malformed lines do; the other lines are registered and the call ends with status 1, no traceback."""
    a = _copy(demo_set, "qv-r4", tmp_path / "a")
    manifest = tmp_path / "m.jsonl"
    deep = 100_000
    lines = [
        json.dumps({"name": "good", "path": str(a)}),
        '{"name": "m-deep", "path": ' + "[" * deep + "]" * deep + "}",
        '{"name": "first", "path": "a", "name": "second"}',
        '{"name": "x", "path": "a", "public": {"k": 1, "k": 2}}',
        '{"name": "x", "path": ' + "[" * 500 + "]" * 500 + "}",
        '{"name": "x", "path": "a", "canary": "10"}',
        '{"name": "x", "path": "a", "canary": ' + "1" * 5000 + "}",
    ]
    manifest.write_text("\n".join(lines) + "\n")
    result = run("adapters", "add", "--tenant", "acme", "--manifest", str(manifest), "--config", config, code=1)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    by_line = {int(o.rsplit("line ", 1)[1].rstrip(")")): r for o, r in _failures(result).items()}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7]
    assert "nested too deeply to read" in by_line[2] and "write one JSON object a line" in by_line[2]
    assert "key 'name' is given twice" in by_line[3] and "key 'k' is given twice" in by_line[4]
    assert len(by_line[5]) < 400, "a deep value is shown cut"
    assert "'canary' must be a whole percentage from 1 to 99, found '10'" in by_line[6]
    assert "a number of more than 4,300 digits" in by_line[7] and len(by_line[7]) < 400, by_line[7][:400]
    assert SUMMARY.format(7, 1, 0, 6) in result.stdout
    assert [v.name for v in registry.list_adapters()] == ["good"]


def test_a_lora_alpha_the_registry_cannot_hold_fails_before_the_store(config, registry, tmp_path, demo_set):
    """lora_alpha 10^6 overflowed the registry's NUMERIC(10, 4) after its content was stored, at every run; now it, and
    one not above 0 or 0 at 4 decimals, fails its check naming lora_alpha and the range, storing nothing (single form
    and manifest); the range's ends go in."""
    cfg = json.loads((demo_set["adapters"]["qv-r4"] / "adapter_config.json").read_text())
    alphas = {"huge": 1e6, "rounds-up": 999999.99995, "tiny": 0.00004, "zero": 0, "negative": -8, "top": 999999.9999, "least": 0.0001}
    for name, alpha in alphas.items():
        (_copy(demo_set, "qv-r4", tmp_path / "a" / name) / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
    single = run("adapters", "add", "--tenant", "acme", "huge", str(tmp_path / "a" / "huge"), "--config", config, code=2)
    assert "lora_alpha=1000000.0 is out of range; set lora_alpha from 0.0001 to 999999.9999" in single.stderr
    assert "ledger database" not in single.stderr and _store_entries(tmp_path) == []
    result = run("adapters", "add", "--tenant", "acme", "--dir", str(tmp_path / "a"), "--config", config, code=1)
    reasons = {Path(o).name: r for o, r in _failures(result).items()}
    assert sorted(reasons) == ["huge", "negative", "rounds-up", "tiny", "zero"]
    assert all("lora_alpha=" in r and "is out of range" in r for r in reasons.values()), reasons
    views = registry.list_adapters("acme")
    assert {v.name: v.alpha for v in views} == {"top": Decimal("999999.9999"), "least": Decimal("0.0001")}
    assert _store_entries(tmp_path) == sorted(v.sha256 for v in views), "a refused adapter stores nothing"


def test_a_name_public_for_another_tenant_cannot_be_made_public(config, registry, tmp_path, demo_set):
    """After acme's public `legal`, globex's `legal --public` is refused naming acme and the fix (single form and a
    manifest line), and stores nothing; two tenants making one new name public in one call both fail; a third tenant
    still reaches acme's `legal`."""
    run("tenants", "add", "initech", "--config", config)
    a, b = _copy(demo_set, "qv-r4", tmp_path / "a"), _copy(demo_set, "qv-r16", tmp_path / "b")
    run("adapters", "add", "--tenant", "acme", "legal", str(a), "--public", "--config", config)
    stored = _store_entries(tmp_path)
    single = run("adapters", "add", "--tenant", "globex", "legal", str(b), "--public", "--config", config, code=2)
    assert "adapter name 'legal' is already public as tenant acme's adapter" in single.stderr
    assert "choose another name, or keep globex's 'legal' private" in single.stderr
    assert _store_entries(tmp_path) == stored
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in [
        {"name": "legal", "path": str(b), "public": True},
        {"name": "shared", "path": str(a), "public": True},
        {"name": "shared", "path": str(b), "public": True, "tenant": "initech"},
        {"name": "mine", "path": str(b), "public": True},
    ]))  # fmt: skip
    result = run("adapters", "add", "--tenant", "globex", "--manifest", str(manifest), "--config", config, code=1)
    by_line = {int(o.rsplit("line ", 1)[1].rstrip(")")): r for o, r in _failures(result).items()}
    assert sorted(by_line) == [1, 2, 3] and "already public as tenant acme's adapter" in by_line[1]
    assert all("tenants globex, initech each make adapter name 'shared' public in this call" in by_line[n] for n in (2, 3))
    assert "adapter globex/mine@1 registered" in result.stdout
    snap = registry.snapshot()
    assert snap.versions("initech", "legal")[-1].tenant_id == "acme" and snap.versions("globex", "legal")[-1].tenant_id == "acme"


def test_manifest_canary_and_command_line_flags(config, registry, tmp_path, demo_set):
    """--public and --canary apply to the lines that do not set them; a new version takes its canary share."""
    a, b = _copy(demo_set, "qv-r4", tmp_path / "a"), _copy(demo_set, "qv-r16", tmp_path / "b")
    run("adapters", "add", "--tenant", "acme", "support", str(a), "--config", config)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"name": "support", "path": str(b)}) + "\n"
                        + json.dumps({"name": "chat", "path": str(a), "public": False}) + "\n")
    run("adapters", "add", "--tenant", "acme", "--manifest", str(manifest), "--canary", "10", "--public", "--config", config)
    versions = registry.snapshot().versions("acme", "support")
    assert [(v.version, v.traffic_weight) for v in versions] == [(1, 90), (2, 10)] and versions[-1].is_public
    assert not registry.snapshot().versions("acme", "chat")[-1].is_public


def test_glob_and_duplicates(config, registry, tmp_path, demo_set):
    """A glob names folders by their last part; one name twice in a call fails every time it is named, and the call's
    other adapters are registered."""
    _copy(demo_set, "qv-r4", tmp_path / "team-a" / "support")
    _copy(demo_set, "qv-r16", tmp_path / "team-b" / "support")
    _copy(demo_set, "mlp-r4", tmp_path / "team-b" / "legal")
    _copy(demo_set, "qkvo-r8", tmp_path / "team-b" / "ignored")
    result = run("adapters", "add", "--tenant", "acme", "--glob", str(tmp_path / "team-*" / "[ls]*"), "--config", config,
                 code=1)  # fmt: skip
    failures = _failures(result)
    assert set(failures) == {str(tmp_path / "team-a" / "support"), str(tmp_path / "team-b" / "support")}
    assert all("acme/support is named 2 times in this call" in r for r in failures.values())
    assert [v.name for v in registry.list_adapters()] == ["legal"]
    assert SUMMARY.format(3, 1, 0, 2) in result.stdout
    recursive = run("adapters", "add", "--tenant", "acme", "--glob", str(tmp_path / "**" / "ignored"), "--config", config)
    assert "adapter acme/ignored@1 registered" in recursive.stdout


def test_two_defaults_for_one_tenant_fail_both(config, registry, tmp_path, demo_set):
    a, b = _copy(demo_set, "qv-r4", tmp_path / "a"), _copy(demo_set, "qv-r16", tmp_path / "b")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"name": n, "path": str(p), "default": True}) + "\n" for n, p in (("x", a), ("y", b))))
    result = run("adapters", "add", "--tenant", "acme", "--manifest", str(manifest), "--config", config, code=1)
    assert all("marked default in this call" in r for r in _failures(result).values()) and len(_failures(result)) == 2
    assert registry.list_adapters() == []


def test_single_form_unchanged(config, registry, demo_set, tmp_path):
    """NAME DIR: today's one line; a failure is one error line and status 2, and stores nothing."""
    path = demo_set["adapters"]["qv-r4"]
    out = run("adapters", "add", "--tenant", "acme", "support", str(path), "--default", "--config", config).stdout
    assert out.startswith("adapter acme/support@1 registered: rank 4, q_proj, v_proj, sha256 ") and out.count("\n") == 1
    assert "unchanged (same content)" in run("adapters", "add", "--tenant", "acme", "support", str(path), "--config", config).stdout
    assert registry.snapshot().defaults["acme"].name == "support"
    stored = _store_entries(tmp_path)
    bad = tmp_path / "corrupt"
    _copy(demo_set, "qv-r16", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 3)
    failed = run("adapters", "add", "--tenant", "acme", "other", str(bad), "--config", config, code=2)
    assert "error: " in failed.stderr and "corrupt or truncated" in failed.stderr
    a_file = run("adapters", "add", "--tenant", "acme", "other", str(bad / "adapter_config.json"), "--config", config, code=2)
    assert "is not a folder" in a_file.stderr
    assert _store_entries(tmp_path) == stored


@pytest.mark.parametrize(("args", "said"), [
    (["--dir", "{tmp}/empty"], "holds no adapter folders"),
    (["--dir", "{tmp}/nope"], "does not exist"),
    (["--dir", "{tmp}/empty/../a-file"], "is not a folder"),
    (["--dir", "{demo}"], "is itself an adapter folder"),
    (["--glob", "{tmp}/nothing-*"], "matches nothing"),
    (["--manifest", "{tmp}/nope.jsonl"], "cannot be read"),
    (["--manifest", "{tmp}/blank.jsonl"], "holds no lines"),
    (["--manifest", "{tmp}/empty"], "is a directory, not a regular file; give a regular JSON lines file"),
    (["--dir", "{tmp}/empty", "--default"], "--default marks one adapter"),
    (["--dir", "{tmp}/empty", "--canary", "0"], "from 1 to 99"),
    (["--dir", "{tmp}/empty", "--threads", "0"], "give 1 or more"),
    ([], "name the adapters"),
    (["only-a-name"], "give the adapter's folder"),
])  # fmt: skip
def test_bad_calls_end_before_anything_is_written(config, registry, tmp_path, demo_set, args, said):
    """A source that is missing, unreadable or empty, or options that do not go together: one error line, status 2,
    nothing registered or stored."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    args = [a.format(tmp=tmp_path, demo=demo_set["adapters"]["qv-r4"]) for a in args]
    result = run("adapters", "add", "--tenant", "acme", *args, "--config", config, code=2)
    assert said in result.stderr and result.stderr.count("error: ") == 1, result.stderr
    assert registry.list_adapters() == []
    assert not (tmp_path / "store").exists() or _store_entries(tmp_path) == []


def test_the_tenant_of_a_call(config, registry, mixed_dir, tmp_path, demo_set):
    """An unknown --tenant, or none for folders, ends the call; without --tenant, manifest lines name their own."""
    result = run("adapters", "add", "--tenant", "ghost", "--dir", str(mixed_dir), "--config", config, code=2)
    assert "tenants add ghost" in result.stderr and "failed:" not in result.stderr
    assert "--tenant T" in run("adapters", "add", "--dir", str(mixed_dir), "--config", config, code=2).stderr
    manifest = tmp_path / "m.jsonl"
    path = str(demo_set["adapters"]["qv-r4"])
    manifest.write_text(json.dumps({"name": "a", "path": path, "tenant": "globex"}) + "\n" + json.dumps({"name": "b", "path": path}) + "\n")
    result = run("adapters", "add", "--manifest", str(manifest), "--config", config, code=1)
    assert [(v.tenant_id, v.name) for v in registry.list_adapters()] == [("globex", "a")]
    assert "no tenant: pass --tenant" in _failures(result)[f"{path} ({manifest} line 2)"]


def test_without_the_base_model_it_says_so_and_still_checks_the_rest(tmp_path, ledger_url, demo_set):
    """engine.model_dir without a model: a warning, and the checks that need no base (rank, files) still refuse."""
    path = tmp_path / "c.toml"
    path.write_text(f'[ledger]\nurl = "{ledger_url}"\n[store]\nadapter_dir = "{tmp_path / "store"}"\n'
                    f'[engine]\nmodel_dir = "{tmp_path / "no-model"}"\n')
    run("tenants", "add", "acme", "--config", str(path))
    root = tmp_path / "adapters"
    _copy(demo_set, "qv-r4", root / "good")
    write_demo_adapter(root / "rank-128", demo_set["model"], rank=128, target_modules=("q_proj",), alpha=16.0, seed=7)
    result = run("adapters", "add", "--tenant", "acme", "--dir", str(root), "--config", str(path), code=1)
    assert "warning: engine.model_dir" in result.stderr and "without the base model" in result.stderr
    assert "r=128 is over engine.max_lora_rank=64" in _failures(result)[str(root / "rank-128")]
    assert SUMMARY.format(2, 1, 0, 1) in result.stdout


def test_parse_without_the_base_checks_the_rank_dimension(demo_set):
    """parse_adapter with no model: the tensors' rank dimension is still checked against r."""
    from engine.adapters import parse_adapter
    from engine.api import AdapterError

    folder = demo_set["adapters"]["qv-r4"]
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = (folder / "adapter_model.safetensors").read_bytes()
    ok = parse_adapter(json.dumps(config).encode(), weights, None, max_lora_rank=64, sha256="x", source=folder)
    assert ok.rank == 4 and ok.target_modules == ("q_proj", "v_proj")
    config["r"] = 8
    with pytest.raises(AdapterError, match=r"expected \[r, in\] with r=8, found \[4, "):
        parse_adapter(json.dumps(config).encode(), weights, None, max_lora_rank=64, sha256="x", source=folder)


def test_bench_registry_runs(tmp_path):
    """`lorabatch bench registry` on a few adapters: the counts it checks hold (its times are not asserted)."""
    from consumer.bench.registry import bench_registry
    from migrations import SCRIPT_LOCATION

    figures = bench_registry(adapters=10, tenants=3, form="manifest", db_url=None, lists=1, script_location=SCRIPT_LOCATION,
                             json_only=True)  # fmt: skip
    assert figures["adapters"] == 10 and figures["tenants"] == 3 and figures["tenants_list_runs"] == 1


class _FlakyRegistry:
    """A registry whose second transaction fails as a lost database would: register_all's only calls are these."""

    def __init__(self, store: AdapterStore):
        self.store = store
        self.calls: list[list[str]] = []

    def register(self, regs):
        from sqlalchemy.exc import OperationalError

        from consumer.registry import AdapterView

        self.calls.append([r.name for r in regs])
        if len(self.calls) == 2:
            raise OperationalError("INSERT ...", {}, Exception("server closed the connection unexpectedly"))
        return [(AdapterView(r.tenant_id, r.name, 1, r.sha256, r.rank, r.alpha, r.target_modules, r.nbytes, r.public, r.default),
                 True) for r in regs]  # fmt: skip


def test_a_failed_batch_fails_its_items_and_the_rest_go_on(tmp_path, demo_set, monkeypatch):
    """Batches of 2: the second transaction fails, its two adapters are reported (their content stays stored, complete,
    for the next run), the batches before and after are registered; a file that cannot be read is reported by path."""
    import engine.adapter_import
    from consumer import bulk_adapters as bulk
    from engine.adapter_import import AdapterChecks
    from engine.checkpoint import read_model_config

    kinds = sorted(demo_set["adapters"])[:6]
    _copy(demo_set, kinds[0], tmp_path / "locked")
    folders = [("unreadable", tmp_path / "locked"), *((k, demo_set["adapters"][k]) for k in kinds)]
    entries = [e for name, path in folders for e in bulk.from_folder(name, path, bulk.Flags("acme"))]
    real_read = engine.adapter_import.read_file

    def read(path, max_bytes):
        if path.parent.name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path, max_bytes)

    monkeypatch.setattr(engine.adapter_import, "read_file", read)
    registry = _FlakyRegistry(AdapterStore(tmp_path / "store", max_bytes=10**9))
    checks = AdapterChecks(read_model_config(demo_set["model"]), None, 64)
    results = bulk.register_all(registry, entries, checks, threads=3, batch=2)
    assert registry.calls == [kinds[0:2], kinds[2:4], kinds[4:6]]
    failed = {r.origin: r.reason for r in results if isinstance(r, bulk.Failure)}
    assert "Permission denied" in failed.pop(str(tmp_path / "locked"))
    assert sorted(Path(o).name for o in failed) == kinds[2:4]
    assert all("the ledger database failed (server closed the connection" in r for r in failed.values())
    assert [r.item.name for r in results if isinstance(r, bulk.Done)] == kinds[0:2] + kinds[4:6]
    assert len(_store_entries(tmp_path)) == 6 and not any(n.startswith(".tmp") for n in _store_entries(tmp_path))


def test_prune_lists_then_removes_content_no_adapter_names(config, registry, tmp_path, demo_set):
    """`adapters prune`: content a failed registration left in the store goes (here with no grace), registered content
    stays; --dry-run lists the same and removes nothing."""
    names = sorted(demo_set["adapters"])
    run("adapters", "add", "--tenant", "acme", "kept", str(demo_set["adapters"][names[0]]), "--config", config)
    orphan = registry.store.put(demo_set["adapters"][names[1]])
    planned = run("adapters", "prune", "--grace", "0", "--dry-run", "--config", config).output
    assert f"would remove {orphan}" in planned and "1 store entries" in planned and orphan in registry.store
    done = run("adapters", "prune", "--grace", "0", "--config", config).output
    assert f"removed {orphan}" in done and orphan not in registry.store
    assert [a.adapter for a in registry.list_adapters("acme")] == ["kept@1"] and len(_store_entries(tmp_path)) == 1
    assert "0 store entries, 0 bytes removed" in run("adapters", "prune", "--config", config).output
