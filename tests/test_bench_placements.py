"""The placement-write bench (engine.bench.placements) runs on the CPU at the tiny shape: every write's parts timed, as
many DMAs as `copy_runs` merges, and each timed write, whole or in parts, leaves the pool holding the adapter's bytes and
gives its pages back. Figures are printed, never asserted (tests never time things)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.adapter_pages import copy_runs
from engine.bench import placements
from engine.bench.placements import main, run


def test_bench_runs_on_cpu_and_its_writes_land(capsys, monkeypatch):
    """Each write's pages hold its host copy's bytes when the write returns (on the CPU a write copies at once); both
    ways of writing leave the allocator empty for the next repeat."""
    seen = []
    real = placements._free_all

    def check(lora, placed):
        for host, pages in placed:
            for src, dest, n in copy_runs(host, pages):
                assert torch.equal(lora.pool[dest : dest + n], host.data[src : src + n])
        real(lora, placed)
        assert lora.allocator.used_elems() == 0
        seen.append(len(placed))

    monkeypatch.setattr(placements, "_free_all", check)
    row = run("tiny", 6, [4, 8], ("q_proj", "v_proj"), busy_ms=0.0, repeats=2, device="cpu", shared=False)
    assert seen == [6] * (1 + 2 * 2 * 2)  # warm-up, then per condition and repeat: whole writes, writes in parts
    for cond in ("idle", "busy"):
        assert set(row[f"{cond}_parts_us"]) == {"rows", "table_copies", "stopwatch", "dmas", "dma_count"}
        assert row[f"{cond}_parts_us"]["dma_count"]["max"] >= 1 and row[f"{cond}_write_us"]["p50"] > 0
    assert row["adapters"] == 6 and row["device"] == "cpu" and row["shared_arena"] is False


def test_cli_prints_a_table_and_one_json_line(capsys):
    main(["--shape", "tiny", "--adapters", "3", "--repeats", "1", "--busy-ms", "0", "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tiny on cpu: 3 adapters") and json.loads(out[-1])["adapters"] == 3


@pytest.mark.parametrize("args", [["--adapters", "0"], ["--repeats", "0"], ["--busy-ms", "-1"]])
def test_cli_refuses_counts_below_one(args, capsys):
    with pytest.raises(SystemExit):
        main(["--shape", "tiny", *args])
    assert "take a count of 1 or more" in capsys.readouterr().err
