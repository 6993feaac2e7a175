"""The host-time probe (engine.bench.host_profile) on the CPU: both runs, in rounds and one step at a time, each with its
step times and the one-step runs' profile, then one JSON line; the CLI refuses a decode phase of no steps by name."""

from __future__ import annotations

import json

from engine.bench.host_profile import main


def test_probe_profiles_both_runs_and_prints_one_json_line(capsys):
    main(["--shape", "tiny", "--device", "cpu", "--adapters", "2", "--rank", "4", "--batch", "2", "--prompt", "6", "--new", "4",
          "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert [(r["run"], r["decode_steps"]) for r in last["rows"]] == [("base", 8), ("base", 1), ("mixed", 8), ("mixed", 1)]
    assert all(r["step_ms"] > 0 and r["device_step_ms"] > 0 and r["calls"] >= 1 for r in last["rows"])
    assert out.count("Ordered by: internal time") == 2  # the one-step runs' profiles


def test_the_cli_refuses_fewer_than_two_new_tokens_naming_the_option():
    from typer.testing import CliRunner

    from consumer.cli import build_app

    result = CliRunner().invoke(build_app(), ["bench", "host-profile", "--new", "1"])
    assert result.exit_code != 0 and "--new" in result.output
