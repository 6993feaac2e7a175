"""LoRA as a transform of the built model: paged adapter memory (L1) and the wrapped projections.

`apply_lora(model, max_loras, max_lora_rank, backend, gpu_bytes)` wraps the model's four projections of every
layer (qkv, o, gate_up, down: engine.model's fused ones) so that each computes `base(x) + lora(x)` for
all the adapter projections it holds (q, k and v; o; gate and up; down), reading the current batch's
adapter rows from the shared `LoraState`. The model's own code is unchanged (STYLE item 3).

Memory (engine/adapter_pages.py, S-LoRA's unified paging): one pool of `gpu_bytes`, allocated at apply time, in
pages of one rank row of one module for every layer; an adapter takes exactly its rank over the modules it targets.
What the kernels read (kernels.lora_segments.LoraPages), per adapter slot (a row of the tables, `max_loras` of them):

    pages [max_loras, 7, max_lora_rank] int64   first element of the page of each rank row of each module
    rank [max_loras, 7] int32                   the adapter's rank on each module, 0 where it does not target it
    scale [max_loras] fp32

Each wrapped projection holds its view: the pool, its modules' columns of the tables, its layer. A slot is a table
row, not memory: capacity is the pool's bytes. Llama-3-8B with a 10 GB budget holds 733 rank-16 q,v adapters
(13.6 MB each); max-rank-64 slots over all seven projections were 335 MB each, 29 of them.

Loads (L2 -> L1, `write`) copy an adapter's pages from pinned host memory, already in page layout (`host_copy`), on
a side CUDA stream, consecutive pages merged into one DMA, then its table rows; nothing is zero-filled (rows past a
rank and untargeted modules have rank 0 and are never read). Each write records an event the compute stream waits
on before the first forward that reads the slot (`wait_ready`). Pages and slots are only reused when no running
request uses them (the adapter pool pins those), so no forward in flight reads a page being written. On CPU there
is no stream: the same calls copy at once. The Triton kernels compute each row at its adapter's own rank per module
and skip rows without an adapter; the torch backend (the same ops' references, kernels/lora_segments.py, gathered
through the tables, CPU default) computes every row over all max_lora_rank columns, masked from its rank on.

Prefill (and any batch whose rows come grouped in segments): the expand writes each projection's delta z
(zeros on rows without an adapter) before the base GEMM, which then adds its product into z with beta = 1
(`z.addmm_(x, W^T)`) instead of the expand reading and writing y after it. A long prefill's expand is bound by
its bytes and its GEMM by its FLOPs, so this moves the read of the projection's output from a pass of its own
into the GEMM's epilogue, where the tensor cores' time covers it (kernels/lora_expand.py). z is rounded to
the activations' dtype before the GEMM adds into it, as y was before the delta was added to it. On the triton backend
the delta is one launch (kernels/lora_delta.py: the shrink's t stays in registers), not a shrink and an expand: a
llama-1b prefill's GPU waits for the host's launches.

Where the projection's output goes straight into a fused op that can take the delta (gate_up into SiLU x up,
kernels/silu_mul.py), the delta is not written at all: the GEMM runs plain (beta = 0), the shrink's t waits beside its
output (`pending`), and the op adds scale * t B^T to each tile it reads before its own maths, rounded once as the
expand would round y. At llama-8b, 32 x 512 prefill tokens, this saves the delta's 940 MB of stores a layer and the
GEMM's read of them in its epilogue: the engine's prefill LoRA share is +8.3-8.5% with it against +9.9-10.5% without, on
one engine in one process (engine.bench.serving.ab_prefill_consumers). qkv keeps the delta-first order: added by RoPE + the KV write the same way, its delta costs more (engine/PERF.md, "Tried and set aside").
The model still knows nothing of LoRA: `wrap_ops` gives the runner the model's ops with the pending delta handed to
them, and an op handed a tensor that is not the pending one is an assertion, not a delta silently dropped.

Attribution: a step's LoRA time is what the LoRA sections measure (the cost model bills it to the adapter rows), so
a fused op that adds the delta counts as LoRA only its extra time over the plain op on as many rows. The plain op's
time is measured once per point of a row-count grid (`ConsumerCalibration`, before the step's timer starts: the
runner's `prepare`) and interpolated between the two around the step's rows; the section counts its measured time
less that, never below zero.

Decode (one row per group, as CUDA-graph steps run): at 32 rows the GEMM is bound by its bytes too, so
writing the delta first saves nothing, and each LoRA launch costs its latency more than its bytes. So the
projections whose output goes straight into a fused op that reads those columns anyway leave their delta to it,
as gate_up does in prefill: qkv's to RoPE + the KV write + attention (kernels/paged_attention.py
`decode_rope_attention`, its "LoRA"), gate_up's to SiLU x up, each after the projection's own shrink
(`base_then_decode_pending`), where `engine.decode_lora_in_ops` asks for it: two launches a layer fewer than an
expand each, but on an H100 the two together made the step 6% slower (engine/PERF.md, session 24), so none by default. Where kernels/decode_linear.py is faster than cuBLAS (llama-8b's o and down projections on an H200), the
GEMM and the rows' deltas are one launch after the shrink (`one_launch`); elsewhere y = base(x), then the expand
adds into y. Outside a graph the timed section of a deferred delta holds its shrink alone, as decode_linear's does.
With `engine.decode_lora_overlap` (the default), a graph's plain projections fork their shrink onto a side stream
before the GEMM and join before the expand: the shrink (a few µs of latency for a few KB) runs beside the GEMM instead
of before it. On an H100 a llama-1b decode step with 32 adapters of rank 16 took 2.35 ms with it against 2.42 without
(engine/PERF.md, session 27); the base step is unchanged (no LoRA, no fork).

When no row of a batch has an adapter the LoRA ops are skipped altogether, so base-only steps carry no
LoRA time; otherwise their time is measured (engine.timing.DeviceTimer) for the cost split, except in a
CUDA-graph replay, whose LoRA share engine.cuda_graphs calibrates once per batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from engine.adapters import LoraAdapter
from engine.backend import KernelBackend
from engine.host_arena import HostArena
from engine.adapter_pages import HostPages, PageAllocator, copy_runs, page_elems_of, write_pages
from engine.model import FUSED_PARENT, FUSED_PROJECTIONS, LORA_TARGETS, LlamaForCausalLM, ModelConfig, ModelOps
from engine.lora_calibration import CONSUMERS, ConsumerCalibration

# Consumer ops whose output the model passes straight to a projection that writes its delta first (SiLU x up into
# down_proj): their timed section stays open into that projection's (`LoraState._begin`).
CARRIED = frozenset({"silu_mul"})
# Decode rows (one group each): fused projection -> the model op its output goes straight into, which adds the
# projection's delta itself (module docstring, "Decode"), where the engine asks for it (engine.decode_lora_in_ops).
DECODE_CONSUMERS = {"qkv_proj": "decode_rope_attention", "gate_up_proj": "silu_mul"}
from engine.quant import Fp8Linear
from engine.timing import DeviceTimer, Stopwatch
from kernels.lora_segments import DecodeLora, LoraDelta, LoraPages, LoraSegments, segments_per_row


class LoraState:
    """The paged adapter weights of every wrapped projection (L1), their page tables, and the current batch's rows."""

    def __init__(self, *, max_loras: int, max_lora_rank: int, device: torch.device, dtype: torch.dtype, backend: KernelBackend,
                 cfg: ModelConfig, gpu_bytes: int | None = None):  # fmt: skip
        assert max_loras >= 1 and max_lora_rank >= 1, (max_loras, max_lora_rank)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        self.backend = backend
        self.num_layers = cfg.num_layers
        self.shapes = shapes = cfg.projection_shapes()
        # Page of each module (engine.adapter_pages): one rank row of A and of B.T for every layer.
        self.page_elems = tuple(cfg.num_layers * (shapes[m][0] + shapes[m][1]) for m in LORA_TARGETS)
        elem = torch.empty(0, dtype=dtype).element_size()
        # The default budget holds max_loras adapters of max rank on all seven projections at once: what the slots held.
        self.full_nbytes = max_lora_rank * sum(self.page_elems) * elem
        if gpu_bytes is None:
            full = {}
            for size in self.page_elems:
                full[size] = full.get(size, 0) + max_loras * max_lora_rank
            self.allocator = PageAllocator.holding(full)
        else:
            self.allocator = PageAllocator(gpu_bytes // elem, self.page_elems)
        self.pool = torch.zeros(self.allocator.capacity, dtype=dtype, device=device)  # [E] every page
        self.pages = torch.zeros(max_loras, len(LORA_TARGETS), max_lora_rank, dtype=torch.int64, device=device)  # [slots, 7, R]
        self.rank = torch.zeros(max_loras, len(LORA_TARGETS), dtype=torch.int32, device=device)  # [slots, 7] 0: none
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)  # [slots]
        self.weights: dict[tuple[int, str], LoraPages] = {}  # (layer, fused projection) -> its view; filled by apply_lora
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
        self.decode_consumers: frozenset[str] = frozenset()  # the same for decode rows (wrap_ops)
        # (projection output, its delta, the open timing section or None) awaiting that op
        self.pending: tuple[torch.Tensor, LoraDelta, object] | None = None
        self._carry: tuple[object, float] | None = None  # a consumer op's open section and its credit (`_begin`)
        self.calibration: ConsumerCalibration | None = None  # the plain consumer ops' time, for the attribution
        self.timer = DeviceTimer(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.side_stream: torch.cuda.Stream | None = None  # graphed decode shrinks beside their GEMMs (`overlap_decode`)
        self.arena: HostArena | None = None  # L2's host memory, set by the adapter pool (engine.host_arena)
        # The tables' rows as last written, in host memory (pinned on CUDA): a write fills its slot's rows here and copies
        # them over, with no staging tensor pinned per write (three of those took host time at each of a round's
        # dozens of loads). A row is only rewritten for a later write of its slot, whose copies follow the earlier ones.
        pin = device.type == "cuda"
        self._pages_host = torch.zeros(self.pages.shape, dtype=torch.int64, pin_memory=pin)
        self._rank_host = torch.zeros(self.rank.shape, dtype=torch.int32, pin_memory=pin)
        self._scale_host = torch.zeros(self.scale.shape, dtype=torch.float32, pin_memory=pin)
        # numpy views of the same memory: a write fills its rows through them, without a torch op per module
        self._pages_np, self._rank_np, self._scale_np = self._pages_host.numpy(), self._rank_host.numpy(), self._scale_host.numpy()
        self._ready: dict[int, torch.cuda.Event] = {}  # slot -> the end of its last write, not yet waited on

    def projection(self, layer: int, fused: str) -> LoraPages:
        """The kernels' view of one projection: the pool, and the slices' columns of the page and rank tables."""
        m0 = LORA_TARGETS.index(FUSED_PROJECTIONS[fused][0])  # a fused projection's modules are consecutive targets
        s = len(FUSED_PROJECTIONS[fused])
        in_f = self.page_elems[m0] // self.num_layers - self.widths[fused][0]
        return LoraPages(pool=self.pool, pages=self.pages[:, m0 : m0 + s], rank=self.rank[:, m0 : m0 + s], scale=self.scale,
                         num_layers=self.num_layers, layer=layer, in_features=in_f, slices=self.widths[fused])  # fmt: skip

    @property
    def active(self) -> bool:
        return self.slot_idx is not None or self.segments is not None

    @property
    def delta_first(self) -> bool:
        """Whether this forward writes each projection's LoRA delta first and lets the base GEMM add into it: the
        triton backend, rows grouped into segments (prefill and mixed steps; CUDA-graph decode adds after)."""
        return self.segments is not None and self.segments.start is not None

    def delta_then_base(self, base: nn.Linear, x: torch.Tensor, w: LoraPages) -> torch.Tensor:
        """base(x) + each row's adapter delta [N, out], as z = delta; z += x W^T (module docstring, "Prefill")."""
        start, credit = self._begin()
        try:
            delta = self.backend.lora_delta
            if delta is not None and self.backend.lora_delta_fits(w, self.segments):
                z = delta(x, w, self.segments, base.out_features)  # [N, out]: one launch, t in registers (kernels/lora_delta.py)
            else:
                t = self.backend.lora_shrink(x, w, self.segments)  # [S, N, R] fp32
                z = torch.empty(x.shape[0], base.out_features, dtype=x.dtype, device=x.device)  # [N, out]
                self.backend.lora_expand(z, t, w, self.segments, accumulate=False)
        finally:  # closed on a raise too, as a carried section's shrink and SiLU x up ran
            if start is not None:
                self.timer.end(start, credit)
        if isinstance(base, Fp8Linear):  # its own GEMM (engine.quant: FP8 tensor cores, or the dequantized weight)
            return z.add_(base(x))
        z.addmm_(x, base.weight.t())
        if base.bias is not None:
            z.add_(base.bias)
        return z

    def base_then_pending(self, base: nn.Linear, x: torch.Tensor, w: LoraPages) -> torch.Tensor:
        """base(x) [N, out], its rows' deltas left `pending` for the op that consumes it (module docstring, "Prefill")."""
        assert self.pending is None, "a LoRA delta is still pending: its consumer op did not run"
        y = base(x)
        # One timed section from the shrink to the consumer op's end (nothing runs between them), credited with the plain
        # op's time there: two CUDA events a layer rather than four, host time a short prefill's GPU waits for.
        self._flush_carry()
        start = self.timer.begin() if self.timed else None
        t = self.backend.lora_shrink(x, w, self.segments)  # [S, N, R] fp32
        self.pending = (y, LoraDelta(t=t, weights=w, segments=self.segments), start)
        return y

    def wrap_ops(self, ops: ModelOps, cfg: ModelConfig, decode_in_ops: Iterable[str] = ()) -> ModelOps:
        """The model's fused ops, those that consume a projection's output taking its pending delta (module docstring,
        "Prefill" and "Decode"); the projections whose consumer is fused defer their delta to it from now on, in decode
        steps those of `decode_in_ops` (keys of DECODE_CONSUMERS)."""
        wrapped, consumers, decode = {}, set(), set()
        for table, chosen, into in ((CONSUMERS, CONSUMERS, consumers), (DECODE_CONSUMERS, set(decode_in_ops), decode)):
            for projection, name in table.items():
                op = getattr(ops, name)
                if op is not None and projection in chosen:
                    wrapped.setdefault(name, self._consumer(name, op))
                    into.add(projection)
        unknown = set(decode_in_ops) - set(DECODE_CONSUMERS)
        assert not unknown, f"decode_lora_in_ops: {sorted(unknown)} are not among {tuple(DECODE_CONSUMERS)}"
        self.consumers, self.decode_consumers = frozenset(consumers), frozenset(decode)
        self.calibration = ConsumerCalibration(ops, cfg, self.dtype, self.device)
        return replace(ops, **wrapped)

    def _consumer(self, name: str, op: Callable) -> Callable:
        def consume(y: torch.Tensor, *args):  # y: the projection's output, as the model passes it
            if self.pending is None:
                return op(y, *args)
            pending_y, lora, start = self.pending
            assert pending_y is y, f"{name} was given another tensor than the projection output whose LoRA delta is pending"
            self.pending = None
            out = op(y, *args, lora=lora)
            if start is not None:
                credit = self.calibration.plain_us(name, y.shape[0])
                if name in CARRIED:  # its output goes straight into the down projection's LoRA: one section for both
                    self._carry = (start, credit)
                else:
                    self.timer.end(start, credit_us=credit)
            return out

        return consume

    def defers_decode(self, name: str) -> bool:
        """Whether projection `name` of this forward leaves its delta to its consumer op: decode rows (module
        docstring, "Decode"), adapters among them, and an op that takes it."""
        return self.segments is not None and self.segments.start is None and name in self.decode_consumers

    def base_then_decode_pending(self, base: nn.Module, x: torch.Tensor, w: LoraPages, slice_offset: int) -> torch.Tensor:
        """base(x) [N, out] of decode rows, the shrink's t (the forward's zeroed buffer) pending beside it for the op that
        consumes it. The timed section holds the shrink alone: a graph's LoRA share is calibrated (engine.cuda_graphs)."""
        assert self.pending is None, "a LoRA delta is still pending: its consumer op did not run"
        y = base(x)
        t = self._decode_t(slice_offset, len(w.slices), x.shape[0])
        with self._section():
            self.backend.lora_shrink(x, w, self.segments, out=t, out_zeroed=True)
        self.pending = (y, LoraDelta(t=t, weights=w, segments=self.segments), None)
        return y

    def set_batch(self, slot_idx: torch.Tensor | None = None, segments: LoraSegments | None = None) -> None:
        """The next forward's adapter rows: the per-token slot [N] int64 (-1: none) for the torch backend, the row
        groups for the triton one; neither for a base-only batch."""
        self.pending = None  # (a forward that raised may leave one behind: nothing of it may reach the next batch)
        self._flush_carry()
        assert slot_idx is None or (slot_idx.dim() == 1 and slot_idx.dtype == torch.int64), slot_idx
        assert slot_idx is None or not self.backend.triton, "the triton backend takes segments"
        assert segments is None or self.backend.triton, "the torch backend takes slot_idx"
        self.slot_idx, self.segments = slot_idx, segments
        self.decode_t = None
        if segments is not None and segments.start is None:
            self.decode_t = torch.zeros(self.total_slices * segments.num_rows * self.max_lora_rank, dtype=torch.float32, device=self.device)

    def overlap_decode(self, on: bool) -> None:
        """engine.decode_lora_overlap: in graphed decode steps, each projection's shrink on a stream of its own beside the
        projection's GEMM (on CUDA with the triton backend; elsewhere nothing changes)."""
        self.side_stream = torch.cuda.Stream(self.device) if on and self.device.type == "cuda" and self.backend.triton else None

    def overlaps(self) -> bool:
        """Whether this forward's plain projections fork their shrink (`shrink_beside`): decode rows (per-row groups and
        the shared shrink buffer) in a CUDA graph's capture, where no timing section needs the shrink on the compute
        stream (a graph's LoRA share is calibrated, engine.cuda_graphs)."""
        return self.side_stream is not None and not self.timed and self.decode_t is not None and self.segments is not None

    def shrink_beside(self, x: torch.Tensor, w: LoraPages, slice_offset: int) -> torch.Tensor:
        """Fork: the shrink of x on the side stream, after everything the compute stream has issued (x, the zeroed
        buffer); returns its t [S, N, R], which `expand_joined` reads once the compute stream has waited for it. x and
        the buffer stay alive on the compute stream past the join, so no stream-ordered reuse can reach them early."""
        t = self._decode_t(slice_offset, len(w.slices), x.shape[0])
        main = torch.cuda.current_stream(self.device)
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):
            self.backend.lora_shrink(x, w, self.segments, out=t, out_zeroed=True)
        return t

    def expand_joined(self, y: torch.Tensor, t: torch.Tensor, w: LoraPages) -> None:
        """Join: the compute stream waits for the side stream's shrink, then y += each row's t B^T."""
        torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        self.backend.lora_expand(y, t, w, self.segments)

    def one_launch(self, rows: int, widths: tuple[int, ...], in_features: int) -> bool:
        """Whether this projection runs as one decode-linear launch (base GEMM + the rows' deltas): the triton backend, a
        few rows, a shape the kernel takes, and either no adapter rows or per-row groups, as CUDA-graph decode steps
        have. The fused launch cannot time its delta apart from the GEMM: a graph's LoRA share is calibrated (engine.
        cuda_graphs); outside a graph (the CPU tests' uncaptured buckets) the timer holds the shrink alone."""
        if self.backend.decode_linear is None or not self.backend.decode_linear_fits(rows, widths, in_features, self.active):
            return False
        return not self.active or (self.segments is not None and self.segments.start is None)

    def decode_linear(self, base: nn.Linear, x: torch.Tensor, w: LoraPages, slice_offset: int) -> torch.Tensor:
        """base(x) + each row's adapter delta [N, out] in one launch after the shrink (kernels/decode_linear.py)."""
        lora = None
        if self.active:
            t = self._decode_t(slice_offset, len(w.slices), x.shape[0])
            with self._section():
                self.backend.lora_shrink(x, w, self.segments, out=t, out_zeroed=True)
            lora = DecodeLora(t=t, weights=w, slot=self.segments.slot)
        return self.backend.decode_linear(x, base.weight, base.bias, lora)

    def apply(self, y: torch.Tensor, x: torch.Tensor, w: LoraPages, slice_offset: int) -> None:
        """y [N, out] += each row's adapter delta of x [N, in], for every slice of the projection (whose first slice is
        `slice_offset` among all wrapped projections' slices)."""
        with self._section():
            if self.segments is not None:
                segments = self.segments
                out = self._decode_t(slice_offset, len(w.slices), x.shape[0]) if self.decode_t is not None else None
                t = self.backend.lora_shrink(x, w, segments, out=out, out_zeroed=out is not None)  # [S, N, R] fp32
            else:
                segments = segments_per_row(self.slot_idx)  # the torch backend's rows, each its own group: no host work
                t = self.backend.lora_shrink(x, w, segments)  # [S, N, R] fp32
            self.backend.lora_expand(y, t, w, segments)

    def _begin(self) -> tuple[object | None, float]:
        """Open a delta-first projection's timed section: (its start, the credit it carries), (None, 0) while a CUDA graph
        is captured. A consumer op's section left open (`CARRIED`) goes on into this one, whose launches follow it with
        nothing between them: at llama-1b a prefill's GPU waits for the host, and each event is host time. The credit
        (the plain op's calibrated time) is then taken from both together, floored at zero once: where the fused op
        measures below the plain op's calibration, the difference comes off the down projection's delta, where two
        sections floored it at zero in the first."""
        if self._carry is not None:
            carried, self._carry = self._carry, None
            return carried
        return (self.timer.begin() if self.timed else None), 0.0

    def _flush_carry(self) -> None:
        """Close a carried section here, where no LoRA launch followed it (a forward that raised, a model that does
        something else after the op): it then spans whatever ran since, as the section would have without the carry."""
        if self._carry is not None:
            start, credit = self._carry
            self._carry = None
            self.timer.end(start, credit_us=credit)

    def _section(self) -> contextlib.AbstractContextManager:
        """A timed section around LoRA ops (engine.timing), or nothing while a CUDA graph is captured."""
        self._flush_carry()
        return self.timer.section() if self.timed else contextlib.nullcontext()

    def _decode_t(self, slice_offset: int, num_slices: int, rows: int) -> torch.Tensor:  # [S, N, R] fp32
        """A projection's view of the forward's one zeroed shrink buffer (`decode_t`), from its first slice's offset."""
        r = self.max_lora_rank
        return self.decode_t[slice_offset * rows * r : (slice_offset + num_slices) * rows * r].view(num_slices, rows, r)

    def host_copy(self, adapter: LoraAdapter) -> HostPages:
        """The L2 copy `write` takes: the adapter's pages in page layout and the pool's dtype, contiguous, pinned on CUDA
        (a DMA needs page-locked memory)."""
        data = self.host_tensor(page_elems_of(adapter.target_modules, adapter.rank, self.shapes, self.num_layers))
        write_pages(data, adapter.weights, adapter.target_modules, adapter.rank, self.shapes, self.num_layers)
        modules = tuple(LORA_TARGETS.index(m) for m in adapter.target_modules)
        return HostPages(sha256=adapter.sha256, rank=adapter.rank, scaling=adapter.scaling, alpha=adapter.alpha,
                         use_rslora=adapter.use_rslora, target_modules=adapter.target_modules, modules=modules, data=data,
                         page_elems=tuple(self.page_elems[m] for m in modules))  # fmt: skip

    def host_tensor(self, numel: int) -> torch.Tensor:
        """Host memory for one adapter's L2 copy: an extent of the L2 arena (engine.host_arena), or, when it has none free
        (or there is none), a tensor of its own, pinned on CUDA (a DMA needs page-locked memory)."""
        data = self.arena.alloc(numel) if self.arena is not None else None
        return data if data is not None else torch.empty(numel, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def page_need(self, host: HostPages) -> list[tuple[int, int]]:
        """(page size, count) per module of `host`, as PageAllocator.alloc takes them."""
        return [(size, host.rank) for size in host.page_elems]

    def write(self, slot: int, host: HostPages, pages: list[list[int]]) -> Stopwatch:
        """Copy an adapter's pages (a `host_copy`) into the pool at `pages` (PageAllocator.alloc of `page_need`) and point
        `slot`'s table rows at them, on the side stream on CUDA; returns the copy's stopwatch. Nothing is zeroed: rows
        past the rank and modules it does not target have rank 0 in the table. The host tensor must stay alive until the
        copy is done (L2 holds it)."""
        assert 0 <= slot < self.max_loras, slot
        assert host.rank <= self.max_lora_rank, (host.rank, self.max_lora_rank)
        assert [len(p) for p in pages] == [host.rank] * len(host.modules), ([len(p) for p in pages], host.rank)
        table, ranks = self._pages_np[slot], self._rank_np[slot]  # [7, R], [7], views of the pinned mirrors
        table.fill(0)
        ranks.fill(0)
        for m, offsets in zip(host.modules, pages):
            table[m, : host.rank] = offsets
            ranks[m] = host.rank
        self._scale_np[slot] = host.scaling
        rows = self._pages_host[slot], self._rank_host[slot], self._scale_host[slot : slot + 1]
        if self.copy_stream is None:
            watch = Stopwatch(self.device)
            for src, dest, n in copy_runs(host, pages):
                self.pool[dest : dest + n].copy_(host.data[src : src + n])
            self.pages[slot], self.rank[slot], self.scale[slot : slot + 1] = rows
            return watch.stop()
        # Plain DMAs from pinned memory, no kernel: a row scatter on this stream waited behind the compute stream's kernels
        # for SMs (H200, issue 19 call 2: L2 loads 363 µs for 6.8 MB against 221 with DMAs alone, a 136 µs floor).
        # The stopwatch spans the pages' DMAs alone (the load, against the floor of one copy of its bytes): the table rows
        # go first, on the same stream, so that their small copies' launches are not counted in it. Its end event, after
        # both, is also the slot's readiness (`wait_ready`).
        runs = copy_runs(host, pages)
        pool, data = self.pool, host.data
        with torch.cuda.stream(self.copy_stream):
            self.pages[slot].copy_(rows[0], non_blocking=True)
            self.rank[slot].copy_(rows[1], non_blocking=True)
            self.scale[slot : slot + 1].copy_(rows[2], non_blocking=True)
            watch = Stopwatch(self.device, self.copy_stream)
            for src, dest, n in runs:
                pool[dest : dest + n].copy_(data[src : src + n], non_blocking=True)
        self._ready[slot] = watch.stop().end_event
        return watch

    def wait_ready(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the pending writes of `slots` (no-op on CPU)."""
        if self.copy_stream is None or not self._ready:
            return
        stream = torch.cuda.current_stream(self.device)
        for slot in set(slots):
            pending = self._ready.pop(slot, None)
            if pending is not None:
                stream.wait_event(pending)

    @property
    def nbytes(self) -> int:
        """Bytes of the page pool (the adapter budget, in whole chunks)."""
        return self.pool.numel() * self.pool.element_size()


class LoraLinear(nn.Module):
    """A (fused) projection computing `base(x)` plus each row's adapter from the pages, for all its slices."""

    def __init__(self, name: str, base: nn.Linear, weights: LoraPages, state: LoraState, slice_offset: int):
        super().__init__()
        self.name = name  # the fused projection: qkv_proj, o_proj, gate_up_proj or down_proj
        self.base = base
        self.weights = weights  # this layer's view of the pages (kernels.lora_segments.LoraPages)
        self.state = state
        self.slice_offset = slice_offset  # slices of the projections wrapped before this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in]
        w = self.weights
        if self.state.delta_first:
            if self.name in self.state.consumers:
                return self.state.base_then_pending(self.base, x, w)
            return self.state.delta_then_base(self.base, x, w)
        if self.state.defers_decode(self.name):
            return self.state.base_then_decode_pending(self.base, x, w, self.slice_offset)
        if not isinstance(self.base, Fp8Linear) and self.state.one_launch(x.shape[0], w.slices, self.base.in_features):
            return self.state.decode_linear(self.base, x, w, self.slice_offset)
        if self.state.active and self.state.overlaps():
            t = self.state.shrink_beside(x, w, self.slice_offset)
            y = self.base(x)
            self.state.expand_joined(y, t, w)
            return y
        y = self.base(x)  # [N, out]
        if self.state.active:
            self.state.apply(y, x, w, self.slice_offset)
        return y


def slice_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Fused projection -> the output width of each adapter projection it holds, in row order."""
    shapes = cfg.projection_shapes()
    return {fused: tuple(shapes[m][1] for m in parts) for fused, parts in FUSED_PROJECTIONS.items()}


def apply_lora(model: LlamaForCausalLM, max_loras: int, max_lora_rank: int, backend: KernelBackend,
               gpu_bytes: int | None = None) -> LoraState:  # fmt: skip
    """Wrap the model's projections with LoRA over one page pool of `gpu_bytes` (allocated here, zeroed; None: as many
    bytes as max_loras adapters of max rank on every projection) and `max_loras` page-table rows; return their state."""
    param = model.lm_head.weight
    state = LoraState(max_loras=max_loras, max_lora_rank=max_lora_rank, device=param.device, dtype=param.dtype, backend=backend,
                      cfg=model.config, gpu_bytes=gpu_bytes)  # fmt: skip
    state.widths = slice_widths(model.config)
    for i, layer in enumerate(model.model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            parent = getattr(layer, FUSED_PARENT[fused])
            base = getattr(parent, fused)
            assert isinstance(base, (nn.Linear, Fp8Linear)), f"layers.{i}.{fused} is {type(base).__name__}: apply_lora twice?"
            w = state.weights[(i, fused)] = state.projection(i, fused)
            assert w.in_features == base.in_features, (fused, w.in_features, base.in_features)
            setattr(parent, fused, LoraLinear(fused, base, w, state, state.total_slices))
            state.total_slices += len(parts)
    return state
