"""The many-adapters bench (engine.bench.adapters) runs end to end on the CPU at the tiny shape: one row per count, the
ratios to the first count, loads that add up (every adapter of a pass read from disk at most once, host-warm passes read
nothing from disk), and every distinct adapter content. Figures are printed, never asserted (tests never time things)."""

from __future__ import annotations

import hashlib

from engine.bench.adapters import run, write_adapters
from engine.bench.build import model_config


def test_adapters_written_are_distinct(tmp_path):
    """Adapters of the same rank differ in content (their sha256), so none is served as another's duplicate."""
    paths = write_adapters(tmp_path, model_config("tiny"), 40, [4], ("q_proj", "v_proj"))
    digests = {hashlib.sha256((p / "adapter_model.safetensors").read_bytes()).hexdigest() for p in paths}
    assert len(digests) == 40


def test_bench_runs_on_cpu_and_its_loads_add_up(tmp_path):
    rows = run("tiny", [2, 6], [4, 8], requests=8, batch=4, prompt=6, new=2, device="cpu", root=tmp_path)
    assert [r["count"] for r in rows] == [2, 6] and rows[0]["cold_ratio"] == rows[0]["warm_ratio"] == 1.0
    for r in rows:
        assert r["loads_warm"]["disk"] == 0, r  # L2 holds every adapter after the cold pass
        assert 0 < r["loads_cold"]["disk"] <= r["count"], r
        assert r["cold_tok_s"] > 0 and r["warm_tok_s"] > 0 and r["gpu_budget_bytes"] > 0


def test_warm_up_adapters_are_not_the_measured_ones(tmp_path):
    """The warm-up's adapters (marked from another index on) share no content with the measured ones, so none of the
    measured adapters is resident before its cold pass."""
    cfg = model_config("tiny")
    measured = write_adapters(tmp_path / "m", cfg, 8, [4, 8], ("q_proj",))
    warm = write_adapters(tmp_path / "w", cfg, 8, [4, 8], ("q_proj",), first=4096 - 128)
    digest = lambda p: hashlib.sha256((p / "adapter_model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert not {digest(p) for p in measured} & {digest(p) for p in warm}
