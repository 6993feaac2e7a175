"""engine.bench.ab: one command over two source trees, runs alternated, each from its own tree, figures tabulated.

Real subprocesses over two small trees whose module prints what a bench prints (JSON lines among other output)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from engine.bench import ab

PROBE = textwrap.dedent("""
    import json, os, sys, time
    HERE = os.path.basename(os.getcwd())
    print("warming up")
    with open(os.path.join(os.environ["AB_LOG"]), "a") as f:
        f.write(HERE + "\\n")
    if os.environ.get("AB_HANG") == HERE:
        time.sleep(30)
    print('{"broken": ')
    for count in (5, 2000):
        print(json.dumps({"count": count, "step_ms": STEP * (1 if count == 5 else 2), "note": "x"}))
""")


def _tree(root: Path, name: str, step: float) -> Path:
    tree = root / name
    tree.mkdir()
    (tree / "probe.py").write_text(f"STEP = {step}\n" + PROBE)
    return tree


@pytest.fixture
def trees(tmp_path, monkeypatch):
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.txt"))
    monkeypatch.delenv("AB_HANG", raising=False)
    return _tree(tmp_path, "new", 1.0), _tree(tmp_path, "old", 1.25), tmp_path


def _main(new, old, out, *extra):
    return ab.main(["--trees", f"{new},{old}", "--out", str(out), "--keys", "step_ms,missing", "--label", "count", *extra, "--",
                    sys.executable, "-c", "import probe"])  # fmt: skip


def test_runs_alternate_from_their_own_trees_and_the_medians_compare(trees, capsys):
    new, old, root = trees
    result = _main(new, old, root / "out", "--runs", "2")
    assert (root / "order.txt").read_text().split() == ["new", "old", "new", "old"], "runs alternate, each in its own tree"
    assert [(r["tree"], r["run"], r["rc"]) for r in result["runs"]] == [("new", 1, 0), ("old", 1, 0), ("new", 2, 0), ("old", 2, 0)]
    assert sorted(p.name for p in (root / "out").iterdir()) == ["new_1.txt", "new_2.txt", "old_1.txt", "old_2.txt"]
    five, big = result["summary"]["5/step_ms"], result["summary"]["2000/step_ms"]
    assert five["medians"] == {"new": 1.0, "old": 1.25} and five["ratio"] == 0.8
    assert big["medians"] == {"new": 2.0, "old": 2.5} and big["ratio"] == 0.8
    assert "5/missing" not in result["summary"], "a key no row has gives no line"
    out = capsys.readouterr().out
    assert "5/step_ms | 1.0 | 1.25 | 0.8" in out and out.strip().splitlines()[-1].startswith('{"trees": ["new", "old"]')


def test_a_run_past_its_time_is_cut_and_the_others_still_run(trees, monkeypatch, capsys):
    new, old, root = trees
    monkeypatch.setenv("AB_HANG", "old")
    result = _main(new, old, root / "out", "--runs", "2", "--timeout", "3")
    assert [(r["tree"], r["rc"]) for r in result["runs"]] == [("new", 0), ("old", None), ("new", 0), ("old", None)]
    out = capsys.readouterr().out
    assert any(line.startswith("old | 1 | None |") and line.endswith("no JSON rows (timed out)") for line in out.splitlines()), out
    assert result["summary"]["5/step_ms"]["medians"] == {"new": 1.0, "old": None} and result["summary"]["5/step_ms"]["ratio"] is None


def test_no_run_starts_past_the_budget(trees, monkeypatch):
    new, old, root = trees
    monkeypatch.setenv("AB_HANG", "new")
    result = _main(new, old, root / "out", "--runs", "3", "--timeout", "600", "--budget", "12")
    assert [(r["tree"], r["rc"]) for r in result["runs"]] == [("new", None)], "the first run takes the budget; none starts after"
    assert result["runs"][0]["seconds"] < 20


def test_json_rows_skip_what_is_not_a_whole_object():
    text = 'text\n{"a": 1}\n{"b": \n[1, 2]\n  {"c": {"d": 2}}  \n{"e": nan}\n{"f": 1} trailing'
    assert ab.json_rows(text) == [{"a": 1}, {"c": {"d": 2}}]


@pytest.mark.parametrize(("argv", "message"), [
    (["--trees", "a,b"], "after `--`"),
    (["--trees", "{tmp}/x,{tmp}/y", "--", "true"], "not folders"),
    (["--trees", "{tmp}/new", "--", "true"], "two or more"),
    (["--trees", "{tmp}/new,{tmp}/other/new", "--", "true"], "names must differ"),
    (["--trees", "{tmp}/new,{tmp}/old", "--"], "empty"),
    (["--trees", "{tmp}/new,{tmp}/old", "--runs", "0", "--", "true"], "at least 1"),
])  # fmt: skip
def test_bad_arguments_name_the_fix(trees, capsys, argv, message):
    new, old, root = trees
    (root / "other" / "new").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        ab.parse_args([a.replace("{tmp}", str(root)) for a in argv])
    assert message in capsys.readouterr().err + str(exit_.value.code)
