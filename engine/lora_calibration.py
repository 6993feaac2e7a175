"""The plain consumer ops' device time, for the attribution of a fused op that adds a projection's LoRA delta itself.

engine.lora, "Attribution": a step's LoRA time is what the LoRA sections measure, so a fused op that adds the delta
(SiLU x up after gate_up, kernels/silu_mul.py) counts as LoRA only its extra time over the plain op on as many rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine.model import ModelConfig, ModelOps

# Fused projection -> the model op its output goes straight into, which adds the projection's delta itself when the
# triton backend runs that op fused (engine.lora, "Prefill").
CONSUMERS = {"gate_up_proj": "silu_mul"}


class ConsumerCalibration:
    """The device time of the plain consumer op (SiLU x up) on N rows, for the attribution of the fused one (module
    docstring, "Attribution"): measured once per point of a grid of row counts (8 a power of two) on scratch inputs of
    the model's width, and interpolated linearly between the two points around N.

    Measuring syncs the device, so the runner asks for a step's row count before it times the step (`prepare`); a
    count first seen inside a forward is measured there, which the step's own time then includes once."""

    REPEATS = 3  # timed runs per count on CUDA, after a warm-up; the median is kept
    # Measured row counts: 2**GRID_BITS = 8 evenly spaced per power of two (every count below 16), so the scratch input
    # is at most 1/8 larger than the step's own (8b prefill of 16,385 rows: 1.06 GB, not the next power of two's 1.9 GB).
    GRID_BITS = 3

    def __init__(self, ops: ModelOps, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self._ops, self._cfg, self._dtype, self._device = ops, cfg, dtype, device
        self._us: dict[tuple[str, int], float] = {}  # (op, rows) -> µs

    def plain_us(self, op: str, rows: int) -> float:
        """µs of the plain `op` on `rows` rows."""
        if rows <= 0:
            return 0.0
        step = 1 << max(0, rows.bit_length() - 1 - self.GRID_BITS)  # the grid's spacing at this size
        lo = rows // step * step
        hi = lo if lo == rows else lo + step
        a, b = self._measured(op, lo), self._measured(op, hi)
        return a if hi == lo else a + (b - a) * (rows - lo) / (hi - lo)

    def prepare(self, rows: int) -> None:
        """Measure, now, what plain_us needs for `rows` rows of every fused consumer op."""
        for op in CONSUMERS.values():
            if getattr(self._ops, op) is not None:
                self.plain_us(op, rows)

    def _measured(self, op: str, rows: int) -> float:
        key = (op, rows)
        if key not in self._us:
            run = self._scratch_run(op, rows)
            if self._device.type == "cuda":
                run()  # compiles, allocates
                times = []
                for _ in range(self.REPEATS):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1000)
                self._us[key] = statistics.median(times)
            else:  # the interpreter (tests): synchronous, and slow enough that one run is the measurement
                t0 = time.perf_counter_ns()
                run()
                self._us[key] = (time.perf_counter_ns() - t0) / 1000
        return self._us[key]

    def _scratch_run(self, op: str, rows: int) -> Callable[[], object]:
        """The plain op on `rows` rows of scratch inputs (the values do not change its time), writing nothing the model reads."""
        assert op == "silu_mul", op
        gate_up = torch.randn(rows, 2 * self._cfg.intermediate_size, dtype=self._dtype, device=self._device)
        return lambda: self._ops.silu_mul(gate_up)
