"""engine.bench.prefill_ab: the other version of a LoRA kernel runs in the "other" runs only, on the same engine."""

from __future__ import annotations

import pytest

from engine.bench import prefill_ab


def test_the_swapped_kernel_serves_the_other_runs_and_only_them(tmp_path, monkeypatch):
    """The fake kernel records the run under way at each call: every call falls in a mixed run of the other version, and
    every such run (two untimed rounds, one timed) calls it."""
    other = tmp_path / "other_shrink.py"
    other.write_text(
        "from kernels.lora_segments import lora_shrink_ref\n"
        "from engine.bench import prefill_ab\n"
        "CALLS = []\n"
        "def lora_shrink(*args, **kwargs):\n"
        "    CALLS.append(prefill_ab.CURRENT)\n"
        "    return lora_shrink_ref(*args, **kwargs)\n"
    )
    loaded = {}
    real_load = prefill_ab.load_other

    def load(field, path):
        fn = real_load(field, path)
        loaded["calls"] = fn.__globals__["CALLS"]
        return fn

    monkeypatch.setattr(prefill_ab, "load_other", load)
    out = prefill_ab.run("tiny", 4, 1, ("lora_shrink", other), device="cpu", batch=2, adapters=2, rank=4)
    for key in ("base_this_ms", "mixed_this_ms", "base_other_ms", "mixed_other_ms", "lora_pct_this", "lora_pct_other",
                "mixed_this_host_ms", "base_other_host_ms"):
        assert key in out, key
    assert set(loaded["calls"]) == {"mixed-other-0", "mixed-other-1", "mixed-other-2"}, set(loaded["calls"])


@pytest.mark.parametrize("swap", ["lora_shrink", "nothing=x.py", "lora_expand=/no/such/file.py"])
def test_a_bad_swap_is_refused_naming_the_option(swap, capsys):
    with pytest.raises(SystemExit):
        prefill_ab.main(["--shape", "tiny", "--swap", swap, "--device", "cpu"])
    assert "--swap" in capsys.readouterr().err


def test_the_profile_lists_the_lora_launchers_of_the_profiled_prefills(capsys):
    prefill_ab.run("tiny", 4, 1, device="cpu", batch=2, adapters=2, rank=4, profile=2, top=400)
    out = capsys.readouterr().out
    assert "2 mixed prefill steps under cProfile, by tottime" in out and "by cumtime" in out
    assert "lora_shrink" in out and "engine.py" in out, out[-2000:]


def test_a_negative_profile_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        prefill_ab.main(["--shape", "tiny", "--profile", "-1", "--device", "cpu"])
    assert "--profile" in capsys.readouterr().err


def test_the_delta_swapped_off_runs_the_two_kernels_in_the_other_runs(monkeypatch):
    """--swap lora_delta=off: "this" runs take the one-launch delta (the triton backend's), "other" runs the shrink and the
    expand; here on the torch backend, whose lora_delta is None in both, the runs still complete and report both."""
    out = prefill_ab.run("tiny", 4, 1, ("lora_delta", prefill_ab.OFF), device="cpu", batch=2, adapters=2, rank=4)
    assert "lora_pct_this" in out and "lora_pct_other" in out and out["swap"] == ["lora_delta", "off"]


def test_the_versions_of_a_swap(tmp_path, capsys):
    """A shrink swapped: the one-launch delta off in both versions (the kernel under test then runs); a delta from a
    file: with that file's own `fits`; lora_delta=off: the two kernels in the other version only."""
    from engine.backend import KernelBackend

    mod = tmp_path / "other.py"
    mod.write_text("def lora_shrink(*a, **k): pass\ndef lora_delta(*a, **k): pass\ndef fits(w, s): return False\n")
    backend = KernelBackend("triton", lora_delta=lambda *a: None, lora_delta_fits=lambda w, s: True)
    v = prefill_ab.backend_versions(backend, ("lora_shrink", mod))
    assert v["this"].lora_delta is None and v["other"].lora_delta is None
    assert v["other"].lora_shrink.__name__ == "lora_shrink" and v["other"].lora_shrink is not backend.lora_shrink
    assert "one-launch delta is off in both" in capsys.readouterr().out
    v = prefill_ab.backend_versions(backend, ("lora_delta", mod))
    assert v["this"] is backend and v["other"].lora_delta_fits(None, None) is False
    v = prefill_ab.backend_versions(backend, ("lora_delta", prefill_ab.OFF))
    assert v["this"] is backend and v["other"].lora_delta is None
    assert prefill_ab.backend_versions(backend, None) == {"this": backend}
