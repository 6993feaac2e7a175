"""LoRA as a transform of the built model: preallocated adapter slots (L1) and the wrapped projections.

`apply_lora(model, max_loras, max_lora_rank, backend)` wraps the model's four projections of every
layer (qkv, o, gate_up, down: engine.model's fused ones) so that each computes `base(x) + lora(x)` for
all the adapter projections it holds (q, k and v; o; gate and up; down), reading the current batch's
adapter rows from the shared `LoraState`. The model's own code is unchanged (STYLE item 3).

Slot layout, what the kernels read (kernels/lora_shrink.py, kernels/lora_expand.py), allocated once at
apply time per layer and fused projection with S slices of output widths w_s:

    a_stack [max_loras, S, max_lora_rank, in]   slice s of slot i holds PEFT's lora_A of that projection
    b_stack [max_loras, max_lora_rank, out]     rank-major, slices side by side: lora_B.T of slice s at
                                                columns off_s .. off_s + w_s
    rank [max_loras] int32, scale [max_loras] fp32

Loading an adapter copies into a slot and zero-fills the rest of it (ranks below max_lora_rank,
projections the adapter does not target), so a slot never holds a previous tenant's weights and no
allocation happens on the hot path. The Triton kernels compute each row at its slot's own rank and
skip rows without an adapter; the torch backend (the same ops' references, kernels/lora_segments.py, gathered, CPU
default) computes every row over all max_lora_rank columns, masked from its slot's rank on. Memory cost, for a Llama-3-8B
shape (32 layers, hidden 4096, KV 1024, MLP 14336) at max_loras 8, rank 64, bf16:
8 * 64 * 32 * (4096+4096 + 4096+1024 + 4096+1024 + 4096+4096 + 2 * (4096+14336) + 14336+4096) * 2 B
= 2.7 GB (2.5 GiB).

Copies into a slot (L2 -> L1) run on a side CUDA stream from pinned host memory, so they overlap the
compute stream's forward; each write records an event that the compute stream waits on before the
first forward that reads the slot (`wait_ready`). A slot is only ever overwritten when no running
request uses it (the adapter pool pins those), so no forward in flight reads a slot being written. On
CPU there is no stream: the same calls copy at once. The host copy (`host_copy`) holds B already
transposed to [r, out], so each copy is one contiguous DMA.

Prefill (and any batch whose rows come grouped in segments): the expand writes each projection's delta z
(zeros on rows without an adapter) before the base GEMM, which then adds its product into z with beta = 1
(`z.addmm_(x, W^T)`) instead of the expand reading and writing y after it. A long prefill's expand is bound by
its bytes and its GEMM by its FLOPs, so this moves the read of the projection's output from a pass of its own
into the GEMM's epilogue, where the tensor cores' time covers it (kernels/lora_expand.py). z is rounded to
the activations' dtype before the GEMM adds into it, as y was before the delta was added to it.

Where the projection's output goes straight into a fused op that can take the delta (gate_up into SiLU x up,
kernels/silu_mul.py), the delta is not written at all: the GEMM runs plain (beta = 0), the shrink's t waits beside its
output (`pending`), and the op adds scale * t B^T to each tile it reads before its own maths, rounded once as the
expand would round y. At llama-8b, 32 x 512 prefill tokens, this saves the delta's 940 MB of stores a layer and the
GEMM's read of them in its epilogue: the engine's prefill LoRA share is +8.3-8.5% with it against +9.9-10.5% without, on
one engine in one process (engine.bench.serving.ab_prefill_consumers; engine/PERF.md, session 5). qkv into RoPE + the KV write was tried the same way and lost to the delta-first order, so qkv keeps it.
The model still knows nothing of LoRA: `wrap_ops` gives the runner the model's ops with the pending delta handed to
them, and an op handed a tensor that is not the pending one is an assertion, not a delta silently dropped.

Attribution: a step's LoRA time is what the LoRA sections measure (the cost model bills it to the adapter rows), so
a fused op that adds the delta counts as LoRA only its extra time over the plain op on as many rows. The plain op's
time is measured once per point of a row-count grid (`ConsumerCalibration`, before the step's timer starts: the
runner's `prepare`) and interpolated between the two around the step's rows; the section counts its measured time
less that, never below zero.

Decode (one row per group, as CUDA-graph steps run): at 32 rows the GEMM is bound by its bytes too, so
writing the delta first saves nothing. Where kernels/decode_linear.py was measured faster than cuBLAS
(llama-8b's o and down projections on an H200), the GEMM and the rows' deltas are one launch after the
shrink (`one_launch`); elsewhere y = base(x), then the expand adds into y.

When no row of a batch has an adapter the LoRA ops are skipped altogether, so base-only steps carry no
LoRA time; otherwise their time is measured (engine.timing.DeviceTimer) for the cost split, except in a
CUDA-graph replay, whose LoRA share engine.cuda_graphs calibrates once per batch size.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn

from engine.adapters import LoraAdapter
from engine.backend import KernelBackend
from engine.model import FUSED_PARENT, FUSED_PROJECTIONS, LlamaForCausalLM, ModelConfig, ModelOps
from engine.timing import DeviceTimer, Stopwatch
from kernels.lora_segments import DecodeLora, LoraDelta, LoraSegments, segments_per_row

# Fused projection -> the model op its output goes straight into, which adds the projection's delta itself when the
# triton backend runs that op fused (module docstring, "Prefill").
CONSUMERS = {"gate_up_proj": "silu_mul"}


class LoraState:
    """The slot weights of every wrapped projection and the current batch's adapter rows."""

    def __init__(self, *, max_loras: int, max_lora_rank: int, device: torch.device, dtype: torch.dtype, backend: KernelBackend):
        assert max_loras >= 1 and max_lora_rank >= 1, (max_loras, max_lora_rank)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        self.backend = backend
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)  # [slots]
        self.rank = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [slots] 0: empty
        # (layer, fused projection) -> (a_stack [slots, S, R, in], b_stack [slots, R, out]); filled by apply_lora
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.widths: dict[str, tuple[int, ...]] = {}  # fused projection -> output width of each slice
        # The current forward's adapter rows: both None for a base-only batch.
        self.slot_idx: torch.Tensor | None = None  # [N] int64, -1: no adapter (torch backend)
        self.segments: LoraSegments | None = None  # row groups (triton backend)
        # Decode (one-row groups): the shrink outputs of every projection of the forward in one buffer, zeroed by one
        # memset rather than one per launch (the decode shrink splits K and adds into its output): 64 fewer kernels
        # in a llama-1b graph. [total slices x N x R] fp32; a projection's view starts at its slice offset x N x R.
        self.decode_t: torch.Tensor | None = None
        self.total_slices = 0  # slices of all wrapped projections, set by apply_lora
        self.timed = True  # False while a CUDA graph is captured: no timing events inside a graph
        self.consumers: frozenset[str] = frozenset()  # fused projections whose delta their consumer op adds (wrap_ops)
        # (projection output, its delta, the open timing section or None) awaiting that op
        self.pending: tuple[torch.Tensor, LoraDelta, object] | None = None
        self.calibration: ConsumerCalibration | None = None  # the plain consumer ops' time, for the attribution
        self.timer = DeviceTimer(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}  # slot -> end of its last write, not yet waited on

    @property
    def active(self) -> bool:
        return self.slot_idx is not None or self.segments is not None

    @property
    def delta_first(self) -> bool:
        """Whether this forward writes each projection's LoRA delta first and lets the base GEMM add into it: the
        triton backend, rows grouped into segments (prefill and mixed steps; CUDA-graph decode adds after)."""
        return self.segments is not None and self.segments.start is not None

    def delta_then_base(self, base: nn.Linear, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                        widths: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
        """base(x) + each row's adapter delta [N, out], as z = delta; z += x W^T (module docstring, "Prefill")."""
        with self._section():
            t = self.backend.lora_shrink(x, a_stack, self.rank, self.segments)  # [S, N, R] fp32
            z = torch.empty(x.shape[0], base.out_features, dtype=x.dtype, device=x.device)  # [N, out]
            self.backend.lora_expand(z, t, b_stack, self.rank, self.scale, self.segments, slices=widths, accumulate=False)
        z.addmm_(x, base.weight.t())
        if base.bias is not None:
            z.add_(base.bias)
        return z

    def base_then_pending(self, base: nn.Linear, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                          widths: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
        """base(x) [N, out], its rows' deltas left `pending` for the op that consumes it (module docstring, "Prefill")."""
        assert self.pending is None, "a LoRA delta is still pending: its consumer op did not run"
        y = base(x)
        # One timed section from the shrink to the consumer op's end (nothing runs between them), credited with the plain
        # op's time there: two CUDA events a layer rather than four, host time a short prefill's GPU waits for.
        start = self.timer.begin() if self.timed else None
        t = self.backend.lora_shrink(x, a_stack, self.rank, self.segments)  # [S, N, R] fp32
        self.pending = (y, LoraDelta(t=t, b_stack=b_stack, rank=self.rank, scale=self.scale, segments=self.segments, slices=widths),
                        start)  # fmt: skip
        return y

    def wrap_ops(self, ops: ModelOps, cfg: ModelConfig) -> ModelOps:
        """The model's fused ops, those that consume a projection's output taking its pending delta (module docstring,
        "Prefill"); the projections whose consumer is fused defer their delta to it from now on."""
        wrapped, consumers = {}, set()
        for projection, name in CONSUMERS.items():
            op = getattr(ops, name)
            if op is not None:
                wrapped[name] = self._consumer(name, op)
                consumers.add(projection)
        self.consumers = frozenset(consumers)
        self.calibration = ConsumerCalibration(ops, cfg, self.dtype, self.device)
        return replace(ops, **wrapped)

    def _consumer(self, name: str, op: Callable) -> Callable:
        def consume(y: torch.Tensor, *args):  # y: the projection's output, as the model passes it
            if self.pending is None:
                return op(y, *args)
            pending_y, lora, start = self.pending
            assert pending_y is y, f"{name} was given another tensor than the projection output whose LoRA delta is pending"
            self.pending = None
            out = op(y, *args, lora)
            if start is not None:
                self.timer.end(start, credit_us=self.calibration.plain_us(name, y.shape[0]))
            return out

        return consume

    def set_batch(self, slot_idx: torch.Tensor | None = None, segments: LoraSegments | None = None) -> None:
        """The next forward's adapter rows: the per-token slot [N] int64 (-1: none) for the torch backend, the row
        groups for the triton one; neither for a base-only batch."""
        self.pending = None  # (a forward that raised may leave one behind: nothing of it may reach the next batch)
        assert slot_idx is None or (slot_idx.dim() == 1 and slot_idx.dtype == torch.int64), slot_idx
        assert slot_idx is None or not self.backend.triton, "the triton backend takes segments"
        assert segments is None or self.backend.triton, "the torch backend takes slot_idx"
        self.slot_idx, self.segments = slot_idx, segments
        self.decode_t = None
        if segments is not None and segments.start is None:
            self.decode_t = torch.zeros(self.total_slices * segments.num_rows * self.max_lora_rank, dtype=torch.float32, device=self.device)

    def one_launch(self, rows: int, widths: tuple[int, ...], in_features: int) -> bool:
        """Whether this projection runs as one decode-linear launch (base GEMM + the rows' deltas): the triton backend, a
        few rows, a shape the kernel takes, and either no adapter rows or per-row groups, as CUDA-graph decode steps
        have. The fused launch cannot time its delta apart from the GEMM: a graph's LoRA share is calibrated (engine.
        cuda_graphs); outside a graph (the CPU tests' uncaptured buckets) the timer holds the shrink alone."""
        if self.backend.decode_linear is None or not self.backend.decode_linear_fits(rows, widths, in_features, self.active):
            return False
        return not self.active or (self.segments is not None and self.segments.start is None)

    def decode_linear(self, base: nn.Linear, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                      widths: tuple[int, ...], slice_offset: int) -> torch.Tensor:  # fmt: skip
        """base(x) + each row's adapter delta [N, out] in one launch after the shrink (kernels/decode_linear.py)."""
        lora = None
        if self.active:
            t = self._decode_t(slice_offset, len(widths), x.shape[0])
            with self._section():
                self.backend.lora_shrink(x, a_stack, self.rank, self.segments, out=t, out_zeroed=True)
            lora = DecodeLora(t=t, b_stack=b_stack, rank=self.rank, scale=self.scale, slot=self.segments.slot, slices=widths)
        return self.backend.decode_linear(x, base.weight, base.bias, lora)

    def apply(self, y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, widths: tuple[int, ...],
              slice_offset: int) -> None:  # fmt: skip
        """y [N, out] += each row's adapter delta of x [N, in], for every slice of the projection (whose first slice is
        `slice_offset` among all wrapped projections' slices)."""
        with self._section():
            if self.segments is not None:
                segments = self.segments
                out = self._decode_t(slice_offset, len(widths), x.shape[0]) if self.decode_t is not None else None
                t = self.backend.lora_shrink(x, a_stack, self.rank, segments, out=out, out_zeroed=out is not None)  # [S, N, R] fp32
            else:
                segments = segments_per_row(self.slot_idx)  # the torch backend's rows, each its own group: no host work
                t = self.backend.lora_shrink(x, a_stack, self.rank, segments)  # [S, N, R] fp32
            self.backend.lora_expand(y, t, b_stack, self.rank, self.scale, segments, slices=widths)

    def _section(self) -> contextlib.AbstractContextManager:
        """A timed section around LoRA ops (engine.timing), or nothing while a CUDA graph is captured."""
        return self.timer.section() if self.timed else contextlib.nullcontext()

    def _decode_t(self, slice_offset: int, num_slices: int, rows: int) -> torch.Tensor:  # [S, N, R] fp32
        """A projection's view of the forward's one zeroed shrink buffer (`decode_t`), from its first slice's offset."""
        r = self.max_lora_rank
        return self.decode_t[slice_offset * rows * r : (slice_offset + num_slices) * rows * r].view(num_slices, rows, r)

    def host_copy(self, adapter: LoraAdapter) -> LoraAdapter:
        """The L2 copy `write` takes: the slots' dtype, B transposed to [r, out], contiguous, pinned on CUDA."""
        pin = self.device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.dtype).contiguous()
            return t.pin_memory() if pin else t

        return replace(adapter, weights={k: (host(a), host(b.t())) for k, (a, b) in adapter.weights.items()}, b_rank_major=True)

    def write(self, slot: int, adapter: LoraAdapter) -> Stopwatch:
        """Copy an adapter (a `host_copy`) into `slot` (on the side stream on CUDA), zeroing whatever of the slot it
        does not fill; returns the copy's stopwatch. The host tensors must stay alive until it is done (L2 holds them)."""
        assert 0 <= slot < self.max_loras, slot
        assert adapter.rank <= self.max_lora_rank, (adapter.rank, self.max_lora_rank)
        assert adapter.b_rank_major, "write takes LoraState.host_copy(adapter)"
        r = adapter.rank
        watch = Stopwatch(self.device, self.copy_stream)
        with self._on_copy_stream():
            for (layer, fused), (a_stack, b_stack) in self.stacks.items():
                b_stack[slot, r:].zero_()
                off = 0
                for s, (module, w) in enumerate(zip(FUSED_PROJECTIONS[fused], self.widths[fused])):
                    weights = adapter.weights.get((layer, module))
                    if weights is None:
                        a_stack[slot, s].zero_()
                        b_stack[slot, :r, off : off + w].zero_()
                    else:
                        a, b_t = weights  # [r, in], [r, out] in the slot dtype (pinned on CUDA)
                        a_stack[slot, s, :r].copy_(a, non_blocking=True)
                        a_stack[slot, s, r:].zero_()
                        b_stack[slot, :r, off : off + w].copy_(b_t, non_blocking=True)
                    off += w
            self.scale[slot].fill_(adapter.scaling)
            self.rank[slot].fill_(r)
        watch.stop()
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            self._ready[slot] = event
        return watch

    def wait_ready(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the pending writes of `slots` (no-op on CPU)."""
        if self.copy_stream is None or not self._ready:
            return
        stream = torch.cuda.current_stream(self.device)
        for slot in set(slots):
            event = self._ready.pop(slot, None)
            if event is not None:
                stream.wait_event(event)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot across every layer and module."""
        return sum(a[0].numel() * a.element_size() + b[0].numel() * b.element_size() for a, b in self.stacks.values())

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.stacks.values())

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self.copy_stream is None:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            yield


class LoraLinear(nn.Module):
    """A (fused) projection computing `base(x)` plus each row's adapter from the slots, for all its slices."""

    def __init__(self, name: str, base: nn.Linear, a_stack: torch.Tensor, b_stack: torch.Tensor, widths: tuple[int, ...],
                 state: LoraState, slice_offset: int):  # fmt: skip
        super().__init__()
        self.name = name  # the fused projection: qkv_proj, o_proj, gate_up_proj or down_proj
        self.base = base
        self.a_stack = a_stack  # [slots, S, R, in]
        self.b_stack = b_stack  # [slots, R, out]
        self.widths = widths  # [S] output width of each slice, summing to out
        self.state = state
        self.slice_offset = slice_offset  # slices of the projections wrapped before this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in]
        if self.state.delta_first:
            if self.name in self.state.consumers:
                return self.state.base_then_pending(self.base, x, self.a_stack, self.b_stack, self.widths)
            return self.state.delta_then_base(self.base, x, self.a_stack, self.b_stack, self.widths)
        if self.state.one_launch(x.shape[0], self.widths, self.base.in_features):
            return self.state.decode_linear(self.base, x, self.a_stack, self.b_stack, self.widths, self.slice_offset)
        y = self.base(x)  # [N, out]
        if self.state.active:
            self.state.apply(y, x, self.a_stack, self.b_stack, self.widths, self.slice_offset)
        return y


def slice_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Fused projection -> the output width of each adapter projection it holds, in row order."""
    shapes = cfg.projection_shapes()
    return {fused: tuple(shapes[m][1] for m in parts) for fused, parts in FUSED_PROJECTIONS.items()}


def apply_lora(model: LlamaForCausalLM, max_loras: int, max_lora_rank: int, backend: KernelBackend) -> LoraState:
    """Wrap the model's projections with LoRA slots (allocated here, zeroed) and return their state."""
    param = model.lm_head.weight
    state = LoraState(max_loras=max_loras, max_lora_rank=max_lora_rank, device=param.device, dtype=param.dtype, backend=backend)
    state.widths = slice_widths(model.config)
    for i, layer in enumerate(model.model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            parent = getattr(layer, FUSED_PARENT[fused])
            base = getattr(parent, fused)
            assert isinstance(base, nn.Linear), f"layers.{i}.{fused} is {type(base).__name__}: apply_lora twice?"
            a_stack = torch.zeros(max_loras, len(parts), max_lora_rank, base.in_features, dtype=state.dtype, device=state.device)
            b_stack = torch.zeros(max_loras, max_lora_rank, base.out_features, dtype=state.dtype, device=state.device)
            state.stacks[(i, fused)] = (a_stack, b_stack)
            setattr(parent, fused, LoraLinear(fused, base, a_stack, b_stack, state.widths[fused], state, state.total_slices))
            state.total_slices += len(parts)
    return state


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
