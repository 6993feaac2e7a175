"""The many-adapters bench (engine.bench.adapters) runs end to end on the CPU at the tiny shape: one row per count, the
ratios to the first count, loads that add up (every adapter of a pass read from disk at most once, host-warm passes read
nothing from disk), and every distinct adapter content. Figures are printed, never asserted (tests never time things)."""

from __future__ import annotations

import gc
import hashlib

import pytest

from engine.bench.adapters import run, write_adapters
from engine.bench.build import model_config
import engine.collector as collector


def test_adapters_written_are_distinct(tmp_path):
    """Adapters of the same rank differ in content (their sha256), so none is served as another's duplicate."""
    paths = write_adapters(tmp_path, model_config("tiny"), 40, [4], ("q_proj", "v_proj"))
    digests = {hashlib.sha256((p / "adapter_model.safetensors").read_bytes()).hexdigest() for p in paths}
    assert len(digests) == 40


@pytest.mark.parametrize("synced", [True, False])
def test_bench_runs_on_cpu_and_its_loads_add_up(tmp_path, capsys, synced):
    """Synchronised after each step() call or not (`--pipelined`: steps popped as the engine process pops them); the
    collector's window on in one, off in the other, as its rows and the last table say."""
    thresholds = gc.get_threshold()
    rows = run("tiny", [2, 6], [4, 8], requests=8, batch=4, prompt=6, new=2, device="cpu", root=tmp_path, synced=synced,
               gc_in_rounds="held" if synced else "off", load_ahead_share=0.5 if synced else None)  # fmt: skip
    assert [r["count"] for r in rows] == [2, 6] and rows[0]["cold_ratio"] == rows[0]["warm_ratio"] == 1.0
    assert all(r["load_ahead_share"] == (0.5 if synced else None) and r["cold_load_ahead_cuts"] >= 0 for r in rows)
    for r in rows:  # every decode call counted once by its steps (the CPU steps eagerly: one each)
        assert set(r["cold_decode_calls_by_steps"]) == {1} and sum(r["cold_decode_calls_by_steps"].values()) > 0, r
    assert all(r["synced_calls"] == synced for r in rows)
    assert all(r["gc_in_rounds"] == ("held" if synced else "off") and (r["collector_passes"] is not None) == synced for r in rows)
    assert gc.get_threshold() == thresholds and collector._held is None  # full passes not held on the CPU (no rounds)
    last = capsys.readouterr().out.splitlines()[-3:]
    assert last[0].startswith("count | slowest decode call with a load"), last
    assert all(line.endswith("(0.0)" if synced else "| off") for line in last[1:]), last  # the CPU runs no decode rounds
    for r in rows:
        assert r["loads_warm"]["disk"] == 0, r  # L2 holds every adapter after the cold pass
        assert 0 < r["loads_cold"]["disk"] <= r["count"], r
        assert r["cold_tok_s"] > 0 and r["warm_tok_s"] > 0 and r["gpu_budget_bytes"] > 0


def test_timeline_has_a_row_per_step_and_counts_every_read(tmp_path, capsys):
    """--timeline writes each pass step by step: every request's prompt rows once, reads taken that add up to the cold
    pass's disk loads, and the cold pass's steps with prompt tokens are printed."""
    import json

    from engine.bench.adapters import TIMELINE_COLUMNS

    rows = run("tiny", [6], [4], requests=8, batch=4, prompt=6, new=2, device="cpu", root=tmp_path, read_threads=2,
               read_processes=0, timeline=tmp_path / "tl")  # fmt: skip
    data = json.loads((tmp_path / "tl" / "timeline_6.json").read_text())
    col = {c: i for i, c in enumerate(TIMELINE_COLUMNS)}
    for name in ("cold", "warm"):
        steps = data[name]
        assert sum(s[col["prompt_rows"]] for s in steps) == 8, steps  # prompts of 6 in one chunk each
        assert [s[col["ms"]] for s in steps] == sorted(s[col["ms"]] for s in steps)
        assert steps[-1][col["running"]] == steps[-1][col["waiting"]] == 0
    assert data["cold"][-1][col["reads_taken"]] == rows[0]["loads_cold"]["disk"] > 0
    assert data["warm"][-1][col["reads_taken"]] == 0
    assert data["cold"][-1][col["reads_landed"]] == 0  # every read landed was taken
    # each call's steps and L1 placements: all of the pass's placements, each call's with its host µs
    assert sum(s[col["placed"]] for s in data["warm"]) == rows[0]["warm_placements"] > 0
    assert all(s[col["placing_us"]] > 0 for s in data["warm"] if s[col["placed"]])
    assert sum(s[col["steps"]] for s in data["warm"]) >= 2 * 2  # prefill and decode steps of both batches
    reads = data["cold_reads"]
    assert len(reads["started_landed_ms"]) == len(reads["load_us"]) == rows[0]["loads_cold"]["disk"]
    assert all(0 <= a <= b for a, b in reads["started_landed_ms"])
    assert "cold pass at 6 adapters" in capsys.readouterr().out
    assert "timeline" not in rows[0]
    assert rows[0]["decode_step_device_p50_without_us"] > 0  # the decode steps' device µs beside their wall µs
    assert rows[0]["cold_gc_ms"] >= 0 and rows[0]["warm_gc_ms"] >= 0
    # every adapter of the host-warm pass was placed from L2 for its requests, each placement's host time counted
    assert rows[0]["warm_placements"] == rows[0]["loads_warm"]["host"] > 0 and rows[0]["warm_placement_host_ms"] > 0
    assert gc.get_freeze_count() == 0  # the bench froze its engine for the passes only


def test_warm_up_adapters_are_not_the_measured_ones(tmp_path):
    """The warm-up's adapters (marked from another index on) share no content with the measured ones, so none of the
    measured adapters is resident before its cold pass."""
    cfg = model_config("tiny")
    measured = write_adapters(tmp_path / "m", cfg, 8, [4, 8], ("q_proj",))
    warm = write_adapters(tmp_path / "w", cfg, 8, [4, 8], ("q_proj",), first=4096 - 128)
    digest = lambda p: hashlib.sha256((p / "adapter_model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert not {digest(p) for p in measured} & {digest(p) for p in warm}


def test_bench_rows_count_prompt_steps_and_holds(tmp_path):
    """Each row counts its passes' steps with prompt tokens (at least one a pass) and their held admissions."""
    rows = run("tiny", [2], [4], requests=6, batch=3, prompt=6, new=2, device="cpu", root=tmp_path)
    for r in rows:
        assert r["cold_prompt_steps"] >= 1 and r["warm_prompt_steps"] >= 1, r
        assert r["cold_admission_holds"] >= 0 and r["warm_admission_holds"] >= 0, r


def test_partial_admissions_warm_up_makes_the_held_admission_shapes(tmp_path):
    """The fourth warm-up pass makes the steps a held admission makes (engine.admission): `wave` prompts admitted beside
    `running` decoding requests, the wave 3/4 of the free places or all of them."""
    import torch

    from engine.admission import AdmissionHold
    from engine.bench.adapters import _partial_admissions
    from engine.bench.build import _kv_blocks, _word_tokenizer, random_model
    from engine.config import EngineConfig
    from engine.engine import Engine

    cfg, batch, prompt = model_config("tiny"), 8, 6
    config = EngineConfig(model_dir=str(tmp_path), device="cpu", max_batch_size=batch, max_prompt_tokens=prompt, max_new_tokens=4,
                          max_num_batched_tokens=batch * prompt, kv_num_blocks=_kv_blocks(batch, prompt + 4), warm_pool_slots=0)  # fmt: skip
    engine = Engine.from_model(config, random_model(cfg, torch.device("cpu"), torch.float32, seed=0), _word_tokenizer(cfg.vocab_size), fingerprint="t")
    records = []
    pop = engine.pop_step_records
    engine.pop_step_records = lambda: records.extend(pop()) or []
    prompts = [[1 + i, 2, 3, 4, 5, 6] for i in range(batch)]
    _partial_admissions(engine, prompts, [None] * batch, 4, "p", batch)
    made = {(sum(s.tokens > 1 for s in r.shares), sum(s.tokens == 1 for s in r.shares)) for r in records}
    want = {(wave, running) for running in (1, 3, 5) for wave in (AdmissionHold.enough(batch - running), batch - running)}
    assert want <= made, sorted(made)


def test_read_spans_begin_when_the_thread_takes_the_read_not_when_it_queues():
    """One read-ahead thread, three reads queued at once, each holding the thread until the test lets it go: each span
    begins when its read began (after the one before it landed), and `landed` counts the reads done and not taken."""
    import threading
    from pathlib import Path

    from engine.adapter_records import ReadAhead, Record

    gates = [threading.Event() for _ in range(3)]
    order = iter(range(3))

    class Reader:
        def read(self, path, sha):
            gates[next(order)].wait(timeout=30)
            return "sha", None, 0

    ahead = ReadAhead(1, reader=Reader())
    for i in range(3):
        ahead.start(Record(f"k{i}", Path("/nowhere"), None, "", "standard"))
    for g in gates:
        g.set()
        while len(ahead.spans) < gates.index(g) + 1:
            threading.Event().wait(0.001)
    while ahead.in_flight:  # counted down just after the span is kept
        threading.Event().wait(0.001)
    spans = list(ahead.spans)
    assert all(spans[i][0] >= spans[i - 1][1] for i in (1, 2)), spans  # not queued time
    assert ahead.landed == 3 and ahead.in_flight == 0


def test_the_switch_interval_option_refuses_what_python_cannot_take():
    """--gil-switch-ms 0 or below (sys.setswitchinterval refuses it) and past 1 s are refused naming the option, in both
    the module's parser and the CLI; the run restores the interval it found."""
    import sys

    from typer.testing import CliRunner

    from consumer.cli import build_app
    from engine.bench.adapters import parse_args

    for bad in ("0", "-5", "5000"):
        with pytest.raises(SystemExit):
            parse_args(["--gil-switch-ms", bad])
        out = CliRunner().invoke(build_app(), ["bench", "adapters", "--gil-switch-ms", bad])
        assert out.exit_code != 0 and "--gil-switch-ms" in out.output, out.output
    assert parse_args(["--gil-switch-ms", "5"]).gil_switch_ms == 5.0
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_pipelined_option_reaches_the_run(monkeypatch):
    """--pipelined (no sync after each step() call) in both the module's parser and the CLI: the run gets synced=False;
    without it, synced=True."""
    from typer.testing import CliRunner

    import engine.bench.adapters as bench
    from consumer.cli import build_app

    got = []
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw["synced"]))
    bench.main(["--pipelined"])
    bench.main([])
    for args in (["--pipelined"], []):
        out = CliRunner().invoke(build_app(), ["bench", "adapters", *args])
        assert out.exit_code == 0, out.output
    assert got == [False, True, False, True]


def test_the_gc_in_rounds_option_reaches_the_run(monkeypatch):
    """--gc-in-rounds off (the module) and --no-gc-in-rounds (the CLI) turn engine.gc_in_rounds off; by default on, with
    full passes held for the window (held); the module's `on` leaves them to CPython."""
    from typer.testing import CliRunner

    import engine.bench.adapters as bench
    from consumer.cli import build_app

    got = []
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw["gc_in_rounds"]))
    bench.main(["--gc-in-rounds", "off"])
    bench.main([])
    bench.main(["--gc-in-rounds", "on"])
    for args in (["--no-gc-in-rounds"], []):
        out = CliRunner().invoke(build_app(), ["bench", "adapters", *args])
        assert out.exit_code == 0, out.output
    assert got == ["off", "held", "on", "off", "held"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--gc-in-rounds", "maybe"])


def test_the_load_ahead_share_option_reaches_the_run(monkeypatch):
    """--load-ahead-share (the module and the CLI) sets engine.load_ahead_share, none unbounds it, and a share out of
    range or not a number is refused naming the option."""
    from typer.testing import CliRunner

    import engine.bench.adapters as bench
    from consumer.cli import build_app

    got = []
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw["load_ahead_share"]))
    for args in (["--load-ahead-share", "0.25"], ["--load-ahead-share", "none"], []):
        bench.main(args)
        out = CliRunner().invoke(build_app(), ["bench", "adapters", *args])
        assert out.exit_code == 0, out.output
    assert got == [0.25, 0.25, None, None, 0.5, 0.5]
    for bad in ("0", "-1", "101", "half"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--load-ahead-share", bad])
        out = CliRunner().invoke(build_app(), ["bench", "adapters", "--load-ahead-share", bad])
        assert out.exit_code != 0 and "--load-ahead-share" in out.output, out.output


def test_read_defaults_are_what_the_engine_derives_for_the_host(monkeypatch):
    """Without --read-threads/--read-processes the bench reads as a service on this host would: half its cores, at least
    one, at most AUTO_READERS (engine.sizing), so the issue's command line measures the derived defaults."""
    from engine.bench.adapters import READ_PROCESSES, READ_THREADS, parse_args
    from engine.sizing import AUTO_READERS, auto_readers

    assert [auto_readers(c) for c in (1, 2, 3, 8, 16, 17, 128)] == [1, 1, 1, 4, 8, 8, AUTO_READERS]
    a = parse_args([])
    assert a.read_threads == a.read_processes == READ_THREADS == READ_PROCESSES == auto_readers()
    assert parse_args(["--read-processes", "0", "--read-threads", "3"]).read_processes == 0
    from typer.testing import CliRunner

    from consumer.cli import build_app

    for flag in ("--read-threads", "--read-processes"):
        out = CliRunner().invoke(build_app(), ["bench", "adapters", "--shape", "tiny", flag, "-1"])
        assert out.exit_code != 0 and flag in out.output, out.output


def test_pass_shape_finds_the_first_full_batch_and_the_prompt_calls_device_time():
    """From a timeline: the first call whose running requests fill the batch, all device ms, and those of the calls with
    prompt rows (and how many); a pass that never fills the batch says None."""
    from engine.bench.adapters import TIMELINE_COLUMNS, pass_shape

    def row(ms, step_us, prompt_rows, running):
        r = dict.fromkeys(TIMELINE_COLUMNS, 0)
        r.update(ms=ms, step_us=step_us, prompt_rows=prompt_rows, running=running)
        return [r[c] for c in TIMELINE_COLUMNS]

    timeline = [row(0.4, 0, 0, 0), row(13.0, 37_500, 1, 1), row(60.7, 2_200, 0, 1), row(92.3, 40_400, 49, 50),
                row(144.2, 49_800, 14, 64), row(198.3, 20_400, 0, 64)]
    assert pass_shape(timeline, 64) == {"full_batch_at_ms": 144.2, "device_ms": 150.3, "prompt_calls_device_ms": 127.7, "prompt_calls": 3}
    assert pass_shape(timeline, 65)["full_batch_at_ms"] is None
    assert pass_shape([], 4) == {"full_batch_at_ms": None, "device_ms": 0.0, "prompt_calls_device_ms": 0.0, "prompt_calls": 0}


def test_phases_give_each_pass_its_slowest_calls_and_put_the_engine_back(tmp_path):
    """--phases: each pass's slowest step() calls by phase (wall and CPU ms, the collector's pauses), the engine's methods
    wrapped for the measured passes only."""
    from engine.engine import Engine

    step = Engine.step
    rows = run("tiny", [3], [4], requests=6, batch=3, prompt=5, new=2, device="cpu", root=tmp_path, phases=True)
    slow = rows[0]["slowest_calls_phases"]
    for name in ("cold", "warm"):
        assert 0 < len(slow[name]) <= 5, slow
        walls = [c["wall_ms"] for c in slow[name]]
        assert walls == sorted(walls, reverse=True)
        first = slow[name][0]
        assert "_run" in first["phases"] and first["gc_ms"] >= 0, first  # a prompt step: the CPU runs no rounds
        assert all(w <= first["wall_ms"] + 0.01 for w, _ in first["phases"].values()), first
    assert Engine.step is step  # put back
    assert run("tiny", [3], [4], requests=3, batch=3, prompt=5, new=1, device="cpu", root=tmp_path)[0]["slowest_calls_phases"] == {"cold": None, "warm": None}
