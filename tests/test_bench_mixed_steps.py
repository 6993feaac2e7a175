"""The mixed-steps probe (engine.bench.mixed_steps) on the CPU: the step that admits k requests beside 4 - k decode rows
is the one measured, with and without adapters, and its figures come out as a line each and one JSON line."""

from __future__ import annotations

import json

from engine.bench.mixed_steps import main, run


def test_each_row_measures_the_step_that_admits_its_prompts(capsys):
    rows = run("tiny", [4, 1], batch=4, prompt=8, ranks=(4, 8), device="cpu", repeats=2)
    assert [(r["source"], r["prompt_rows"], r["decode_rows"]) for r in rows] == [
        ("adapters", 4, 0), ("adapters", 1, 3), ("base", 4, 0), ("base", 1, 3)]  # fmt: skip
    for r in rows:
        assert r["step_device_us"] > 0 and r["step_wall_us"] > 0 and r["decode_step_device_us"] > 0, r
    assert capsys.readouterr().out.count("prompt rows beside") == 4


def test_main_prints_one_json_line(capsys):
    main(["--shape", "tiny", "--prompt-rows", "2", "--batch", "2", "--prompt", "6", "--device", "cpu"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["shape"] == "tiny" and [r["prompt_rows"] for r in last["rows"]] == [2, 2]


def test_the_cli_refuses_rows_past_the_batch_naming_the_option():
    from typer.testing import CliRunner

    from consumer.cli import build_app

    out = CliRunner().invoke(build_app(), ["bench", "mixed-steps", "--prompt-rows", "5", "--batch", "4"])
    assert out.exit_code != 0 and "--prompt-rows" in out.output
