"""One bench command over two source trees, their runs alternated: `python -m engine.bench.ab --trees NEW,OLD [--runs 2]
[--timeout 600] [--budget 570] [--keys base_step_ms,mixed_step_ms] [--label count] [--out DIR] -- COMMAND ...`.

A change is measured against the code before it on the same machine in the same call, the two runs interleaved so that
a machine that warms up or slows down weighs on both. Each tree is a folder holding the project's files at one commit,
unpacked where the command will run (`git archive REV | tar -x -C DIR`; a device machine's copy of the checkout has
no git history). Runs go NEW, OLD, NEW, OLD, ...: COMMAND runs with the tree as its working directory and first on
PYTHONPATH, its output in OUT/<tree>_<run>.txt. No run starts once less than 10 s of `--budget` is left, and each gets at
most what is left (a run cut short keeps what it printed), so the figures come back inside a call's time limit.

Then each run's JSON object lines (what the benches print: one a run, or one per row, e.g. per adapter count) give
the `--keys` values, rows told apart by their `--label` key: a table of every run, then per row and key the median over
each tree's runs and NEW / OLD, then one JSON line. A run that printed no such line, or timed out, is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIN_RUN_S = 10.0  # no run starts with less of the budget left


def run_alternated(trees: list[Path], command: list[str], runs: int, timeout: float, budget: float, out: Path) -> list[dict]:
    """Run `command` from each tree in turn, `runs` rounds, within `budget` seconds; one record per run started:
    {"tree", "run", "rc" (None: cut at its time), "seconds", "rows" (the JSON objects it printed)}."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    records = []
    for i in range(1, runs + 1):
        for tree in trees:
            left = budget - (time.monotonic() - start)
            if left < MIN_RUN_S:
                return records
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
            log = out / f"{tree.name}_{i}.txt"
            t0 = time.monotonic()
            with log.open("w") as f:
                try:
                    rc = subprocess.run(command, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=min(timeout, left)).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            seconds = time.monotonic() - t0
            records.append({"tree": tree.name, "run": i, "rc": rc, "seconds": round(seconds, 1), "rows": json_rows(log.read_text(errors="replace"))})
            print(f"{tree.name} run {i}: rc {rc if rc is not None else 'timed out'}, {seconds:.1f} s, {len(records[-1]['rows'])} rows", flush=True)
    return records


def json_rows(text: str) -> list[dict]:
    """The JSON objects a run printed, one a line (other lines, and lines that are not whole objects, skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                rows.append(value)
    return rows


def summarise(records: list[dict], trees: list[str], keys: list[str], label: str | None) -> dict:
    """Per row label and key: each tree's values over its runs, their medians, and the first tree's median over the
    second's (None where either has none)."""
    values: dict[str, dict[str, dict[str, list[float]]]] = {}
    for rec in records:
        for row in rec["rows"]:
            name = str(row.get(label, "")) if label else ""
            for key in keys:
                v = row.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    values.setdefault(name, {}).setdefault(key, {}).setdefault(rec["tree"], []).append(float(v))
    summary = {}
    for name, by_key in values.items():
        for key, by_tree in by_key.items():
            medians = {t: statistics.median(by_tree[t]) if t in by_tree else None for t in trees}
            a, b = medians[trees[0]], medians[trees[1]]
            summary[f"{name}/{key}" if name else key] = {"values": by_tree, "medians": medians,
                                                       "ratio": round(a / b, 4) if a is not None and b else None}  # fmt: skip
    return summary


def print_tables(records: list[dict], keys: list[str], label: str | None, summary: dict, trees: list[str]) -> None:
    print(" | ".join(["tree", "run", "rc", "s", label or "row", *keys]))
    for rec in records:
        if not rec["rows"]:
            print(f"{rec['tree']} | {rec['run']} | {rec['rc']} | {rec['seconds']} | no JSON rows" + (" (timed out)" if rec["rc"] is None else ""))
        for row in rec["rows"]:
            print(" | ".join(str(v) for v in (rec["tree"], rec["run"], rec["rc"], rec["seconds"], row.get(label, "-") if label else "-",
                                               *(row.get(k, "-") for k in keys))))  # fmt: skip
    print(f"row/key | median {trees[0]} | median {trees[1]} | {trees[0]} / {trees[1]}")  # (parse_args: two trees or more)
    for name, s in summary.items():
        m = s["medians"]
        print(f"{name} | {m[trees[0]]} | {m[trees[1]]} | {s['ratio']}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("python -m engine.bench.ab: give the command after `--`, e.g. `-- python3 -m engine.bench.adapters ...`")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m engine.bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="two (or more) folders, comma-separated: the new code's first")
    p.add_argument("--runs", type=int, default=2, help="rounds: each tree runs the command this many times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all the runs (no run starts past it)")
    p.add_argument("--keys", default="", help="JSON keys to tabulate, comma-separated")
    p.add_argument("--label", default=None, help="the JSON key telling a run's rows apart (e.g. count)")
    p.add_argument("--out", type=Path, default=Path("ab-out"), help="folder for each run's output")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        p.error("the command after `--` is empty")
    trees = [Path(t) for t in args.trees.split(",") if t]
    missing = [str(t) for t in trees if not t.is_dir()]
    if len(trees) < 2 or missing:
        p.error(f"--trees: give two or more folders, comma-separated (not folders: {missing})" if missing else "--trees: give two or more folders")
    if len({t.name for t in trees}) != len(trees):
        p.error("--trees: the folders' names must differ (they name the runs' output files and rows)")
    if args.runs < 1 or args.timeout <= 0 or args.budget <= 0:
        p.error("--runs must be at least 1, --timeout and --budget above 0")
    args.trees = [t.resolve() for t in trees]
    return args, command


def main(argv: list[str] | None = None) -> dict:
    args, command = parse_args(argv)
    keys = [k for k in args.keys.split(",") if k]
    records = run_alternated(args.trees, command, args.runs, args.timeout, args.budget, args.out)
    names = [t.name for t in args.trees]
    summary = summarise(records, names, keys, args.label)
    print_tables(records, keys, args.label, summary, names)
    result = {"trees": names, "command": command, "runs": [{k: v for k, v in r.items() if k != "rows"} for r in records], "summary": summary}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
