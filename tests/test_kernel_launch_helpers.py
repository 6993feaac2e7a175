"""The launchers' host arithmetic (kernels.utils.cdiv, next_power_of_2) gives what Triton's does, and the launcher
overhead bench (kernels.bench.launch_overhead) runs on the CPU and leaves the kernels as it found them."""

from __future__ import annotations

import triton

from kernels.utils import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    values = list(range(0, 4200)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3, 14336, 128256]
    for a in values:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 7, 16, 64, 128, 1000, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_the_launch_overhead_bench_times_every_launcher_and_restores_the_kernels():
    from kernels.bench import launch_overhead as bench

    def kernels():  # the modules the bench stubs, whichever import of them is current
        return (bench.shrink_module._shrink_kernel, bench.expand_module._expand_kernel, bench.silu_module._silu_mul_lora_kernel,
                bench.delta_module._delta_kernel)

    before = kernels()
    out = bench.run(reps=3)
    assert sorted(out) == sorted(["qkv_shrink_us", "qkv_delta_us", "qkv_one_launch_delta_us", "gate_up_shrink_us",
                                  "gate_up_silu_delta_us", "down_shrink_us", "down_delta_us", "down_one_launch_delta_us"]) \
        and all(v > 0 for v in out.values()), out  # fmt: skip
    assert kernels() == before
