"""engine.bench.prefill_ab: the other version of a LoRA kernel runs in the "other" runs only, on the same engine."""

from __future__ import annotations

import pytest

from engine.bench import prefill_ab


def test_the_swapped_kernel_serves_the_other_runs_and_only_them(tmp_path):
    calls = tmp_path / "calls.txt"
    other = tmp_path / "other_shrink.py"
    other.write_text(
        "from kernels.lora_segments import lora_shrink_ref\n"
        f"CALLS = {str(calls)!r}\n"
        "def lora_shrink(*args, **kwargs):\n"
        "    with open(CALLS, 'a') as f:\n"
        "        f.write('x')\n"
        "    return lora_shrink_ref(*args, **kwargs)\n"
    )
    out = prefill_ab.run("tiny", 4, 1, ("lora_shrink", other), device="cpu", batch=2, adapters=2, rank=4)
    for key in ("base_this_ms", "mixed_this_ms", "base_other_ms", "mixed_other_ms", "lora_pct_this", "lora_pct_other"):
        assert key in out, key
    # rounds: 2 untimed + 1 timed, each with one mixed prefill on the other version (its decode steps too): the shrink
    # runs there once a projection of every layer a step, and in no base-only step
    n = len(calls.read_text())
    assert n > 0 and n % 3 == 0, n


@pytest.mark.parametrize("swap", ["lora_shrink", "nothing=x.py", "lora_expand=/no/such/file.py"])
def test_a_bad_swap_is_refused_naming_the_option(swap, capsys):
    with pytest.raises(SystemExit):
        prefill_ab.main(["--shape", "tiny", "--swap", swap, "--device", "cpu"])
    assert "--swap" in capsys.readouterr().err
