"""The batch-size sweep (engine.bench.batch_sweep, `lorabatch bench batch-sweep`): the derived default plus every given
size, one row each, ratios against the best row, a verdict computed from them, and a clear error for a bad
--batch-sizes. Figures are printed, never asserted (tests never time things)."""

from __future__ import annotations

import gc
import inspect
import json
import weakref

import pytest
from typer.testing import CliRunner

import engine.bench.batch_sweep as sweep
from consumer.cli import build_app
from consumer.cli.bench import bench_batch_sweep
from engine.config import EngineConfig
from engine.engine import Engine


@pytest.mark.parametrize(
    "text, sizes",
    [("16,32,64", [16, 32, 64]), ("64, 16,16", [16, 64]), ("1", [1]), ("4096", [4096])],
)
def test_batch_sizes_parse_ascending_once_each(text, sizes):
    """Sizes run ascending, each once, whatever order and spacing they came in."""
    assert sweep.parse_batch_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0", "-4", "16,-1", "1.5", "abc", "16,x", "", " ", "16,,32", "16,", "5000"])
def test_invalid_batch_sizes_name_the_option(text):
    """Zero, negative, non-integer, empty entries and sizes over the engine's bound are refused, the message naming
    --batch-sizes and the value given."""
    with pytest.raises(ValueError, match="--batch-sizes") as err:
        sweep.parse_batch_sizes(text)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize("text", ["0", "-4", "abc", ""])
def test_invalid_batch_sizes_on_both_command_lines(text, capsys):
    """`python -m engine.bench.batch_sweep` and `lorabatch bench batch-sweep` exit 2 with the option named, before any
    model is written."""
    with pytest.raises(SystemExit) as exit_:
        sweep.parse_args(["--batch-sizes", text])
    assert exit_.value.code == 2 and "--batch-sizes" in capsys.readouterr().err
    out = CliRunner().invoke(build_app(), ["bench", "batch-sweep", "--batch-sizes", text])
    assert out.exit_code == 2 and "--batch-sizes" in out.output, out.output


def test_command_lines_share_their_defaults():
    """The CLI command's defaults are the module's (each is written in both: the CLI module must not import torch)."""
    args = vars(sweep.parse_args([]))
    defaults = {name: p.default for name, p in inspect.signature(bench_batch_sweep).parameters.items()}
    for name in ("shape", "adapters", "jobs", "prompt_tokens", "new_tokens", "device", "batch_sizes"):
        assert defaults[name] == args[name], name
    help_text = inspect.signature(bench_batch_sweep).parameters["batch_sizes"].annotation
    assert all(s in str(help_text) for s in sweep.DEFAULT_BATCH_SIZES.values())


def test_cli_passes_its_options_through(monkeypatch):
    """`lorabatch bench batch-sweep` hands each option to run_sweep, --batch-sizes parsed."""
    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda **kw: seen.update(kw))
    out = CliRunner().invoke(build_app(), ["bench", "batch-sweep", "--shape", "tiny", "--adapters", "3", "--jobs", "5",
                                           "--prompt-tokens", "6", "--new-tokens", "7", "--batch-sizes", "8,2", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert seen == {"shape": "tiny", "adapters": 3, "jobs": 5, "prompt_tokens": 6, "new_tokens": 7, "batch_sizes": [2, 8],
                    "device": "cpu", "json_only": True}  # fmt: skip


def _row(batch, source, tok_s):
    return {"batch": batch, "source": source, "tok_s": tok_s}


@pytest.mark.parametrize(
    "rows, best, default_ratio, meets",
    [
        ([_row(32, "derived", 100.0), _row(16, "explicit", 50.0)], (32, "derived"), 1.0, True),
        ([_row(256, "derived", 90.0), _row(128, "explicit", 100.0)], (128, "explicit"), 0.9, True),
        ([_row(256, "derived", 89.9), _row(128, "explicit", 100.0)], (128, "explicit"), 0.899, False),
        ([_row(64, "derived", 10.0), _row(16, "explicit", 40.0), _row(64, "explicit", 11.0)], (16, "explicit"), 0.25, False),
        ([_row(8, "derived", 5.0)], (8, "derived"), 1.0, True),  # no explicit size: the default is its own best
    ],
)
def test_ratios_and_verdict_are_against_the_best_row(rows, best, default_ratio, meets):
    """Each row's ratio is its tokens/s over the best row's; the verdict is the derived row's ratio against TARGET."""
    v = sweep.rank_rows(rows)
    top = max(r["tok_s"] for r in rows)
    assert [r["ratio"] for r in rows] == [round(r["tok_s"] / top, 4) for r in rows]
    assert (v["best_batch"], v["best_source"]) == best and v["default_ratio"] == pytest.approx(default_ratio, abs=1e-3)
    assert v["meets_target"] is meets and v["target"] == sweep.TARGET
    assert ("reaches" if meets else "misses") in sweep.verdict_line(v)


def test_sweep_runs_the_default_and_every_size_on_the_same_jobs(tmp_path, monkeypatch, capsys):
    """One run on the CPU: a derived row (the CPU's default batch) then an explicit row per size, every job finished
    with all its tokens, ratios against the best, the verdict from the rows, one JSON line that is the figures, and
    no engine left alive after its row (each engine of a GPU sweep must find the device's memory)."""
    engines = []

    class Tracked(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(weakref.ref(self))

    monkeypatch.setattr(sweep, "Engine", Tracked)
    jobs, new = 3, 2
    figures = sweep.run_sweep(shape="tiny", adapters=2, jobs=jobs, prompt_tokens=2, new_tokens=new, batch_sizes=[1, 3],
                              device="cpu", json_only=True, root=tmp_path)  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and json.loads(out[0]) == figures
    rows = figures["rows"]
    assert [(r["source"], r["batch"]) for r in rows] == [("derived", EngineConfig().max_batch_size), ("explicit", 1), ("explicit", 3)]
    assert all(r["tokens"] == jobs * new and r["preemptions"] == 0 and r["compiles_measured"] in (0, None) for r in rows), rows
    top = max(r["tok_s"] for r in rows)
    assert [r["ratio"] for r in rows] == [round(r["tok_s"] / top, 4) for r in rows] and max(r["ratio"] for r in rows) == 1.0
    assert figures["default_ratio"] == round(rows[0]["tok_s"] / top, 4)
    assert figures["meets_target"] == (rows[0]["tok_s"] / top >= sweep.TARGET)
    gc.collect()
    assert len(engines) == 3 and all(ref() is None for ref in engines)

    sweep._print_table(figures)  # the table the run prints without --json
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(rows) + 1 and table[-1] == sweep.verdict_line(figures)
    assert [line.split()[:2] for line in table[2:-1]] == [[str(r["batch"]), r["source"]] for r in rows]
