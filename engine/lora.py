"""LoRA as a transform of the built model: preallocated adapter slots (L1) and the wrapped projections.

`apply_lora(model, max_loras, max_lora_rank)` wraps the seven projections of every layer (q, k, v, o,
gate, up, down) so that each computes `base(x) + lora(x)`, where the LoRA part reads the per-token
slot index `[N]` of the current batch from the shared `LoraState`. The model's own code is unchanged
(STYLE item 3).

Slots are allocated once, at apply time: per layer and module, `A [max_loras, max_lora_rank, in]` and
`B [max_loras, out, max_lora_rank]`, plus `scale [max_loras]`. Loading an adapter copies into a slot
and zero-fills the rest of it (ranks below max_lora_rank, modules the adapter does not target), so a
slot never holds a previous tenant's weights and no allocation happens on the hot path. Memory cost,
for a Llama-3-8B shape (32 layers, hidden 4096, KV 1024, MLP 14336) at max_loras 8, rank 64, bf16:
8 * 64 * 32 * (4096+4096 + 4096+1024 + 4096+1024 + 4096+4096 + 2 * (4096+14336) + 14336+4096) * 2 B
= 2.7 GB (2.5 GiB).

Copies into a slot (L2 -> L1) run on a side CUDA stream from pinned host memory, so they overlap the
compute stream's forward; each write records an event that the compute stream waits on before the
first forward that reads the slot (`wait_ready`). A slot is only ever overwritten when no running
request uses it (the adapter pool pins those), so no forward in flight reads a slot being written. On
CPU there is no stream: the same calls copy at once.

When no row of a batch has an adapter the LoRA ops are skipped altogether, so base-only steps carry no
LoRA time; otherwise their time is measured (engine.timing.DeviceTimer) for the cost split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.adapters import LoraAdapter
from engine.model import LORA_TARGETS, PROJECTION_PARENT, LlamaForCausalLM
from engine.timing import DeviceTimer, Stopwatch
from kernels.lora_ref import lora_ref


class LoraState:
    """The slot weights of every wrapped projection and the current batch's slot index."""

    def __init__(self, *, max_loras: int, max_lora_rank: int, device: torch.device, dtype: torch.dtype):
        assert max_loras >= 1 and max_lora_rank >= 1, (max_loras, max_lora_rank)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)  # [slots]
        # (layer, module) -> (A [slots, R, in], B [slots, out, R]); filled by apply_lora
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_idx: torch.Tensor | None = None  # [N] int64 for the current forward; None: no adapter rows
        self.timer = DeviceTimer(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}  # slot -> end of its last write, not yet waited on

    def set_batch(self, slot_idx: torch.Tensor | None) -> None:
        """Set the per-token slot index [N] (-1: no adapter) for the next forward, or None for a base-only batch."""
        assert slot_idx is None or (slot_idx.dim() == 1 and slot_idx.dtype == torch.int64), slot_idx
        self.slot_idx = slot_idx

    def write(self, slot: int, adapter: LoraAdapter) -> Stopwatch:
        """Copy an adapter into `slot` (on the side stream on CUDA), zeroing whatever of the slot it does not
        fill; returns the copy's stopwatch. The host tensors must stay alive until it is done (L2 holds them)."""
        assert 0 <= slot < self.max_loras, slot
        assert adapter.rank <= self.max_lora_rank, (adapter.rank, self.max_lora_rank)
        r = adapter.rank
        watch = Stopwatch(self.device, self.copy_stream)
        with self._on_copy_stream():
            for key, (a_stack, b_stack) in self.stacks.items():
                weights = adapter.weights.get(key)
                if weights is None:
                    a_stack[slot].zero_()
                    b_stack[slot].zero_()
                    continue
                a, b = weights  # [r, in], [out, r], in the slot dtype (pinned on CUDA)
                a_stack[slot, :r].copy_(a, non_blocking=True)
                a_stack[slot, r:].zero_()
                b_stack[slot, :, :r].copy_(b, non_blocking=True)
                b_stack[slot, :, r:].zero_()
            self.scale[slot].fill_(adapter.scaling)
        watch.stop()
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            self._ready[slot] = event
        return watch

    def wait_ready(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the pending writes of `slots` (no-op on CPU)."""
        if self.copy_stream is None:
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
    """A projection computing `base(x)` plus each row's adapter from the slots."""

    def __init__(self, base: nn.Linear, a_stack: torch.Tensor, b_stack: torch.Tensor, state: LoraState):
        super().__init__()
        self.base = base
        self.a_stack = a_stack  # [slots, R, in]
        self.b_stack = b_stack  # [slots, out, R]
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in]
        y = self.base(x)  # [N, out]
        idx = self.state.slot_idx
        if idx is None:
            return y
        with self.state.timer.section():
            lora_ref(y, x, self.a_stack, self.b_stack, idx, self.state.scale)
        return y


def apply_lora(model: LlamaForCausalLM, max_loras: int, max_lora_rank: int) -> LoraState:
    """Wrap the model's projections with LoRA slots (allocated here, zeroed) and return their state."""
    param = model.lm_head.weight
    state = LoraState(max_loras=max_loras, max_lora_rank=max_lora_rank, device=param.device, dtype=param.dtype)
    for i, layer in enumerate(model.model.layers):
        for module in LORA_TARGETS:
            parent = getattr(layer, PROJECTION_PARENT[module])
            base = getattr(parent, module)
            assert isinstance(base, nn.Linear), f"layers.{i}.{module} is {type(base).__name__}: apply_lora twice?"
            a_stack = torch.zeros(max_loras, max_lora_rank, base.in_features, dtype=state.dtype, device=state.device)
            b_stack = torch.zeros(max_loras, base.out_features, max_lora_rank, dtype=state.dtype, device=state.device)
            state.stacks[(i, module)] = (a_stack, b_stack)
            setattr(parent, module, LoraLinear(base, a_stack, b_stack, state))
    return state
