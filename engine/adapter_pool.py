"""Which adapters are loaded, under which keys, and which of them sit in the device slots.

Two tiers in v0: every loaded adapter keeps a validated host copy (L2, unbounded here; byte-bounded
LRU is a later issue), and up to `max_loras` of them are resident in the device slots (L1). Identity is
the content sha256: two keys with the same files share one host copy and one slot. Adapters of
running requests are pinned; when every slot is taken, the least recently used unpinned adapter is
evicted (it stays on the host and pages back in when a request needs it).

Cold start: the measured disk load of an adapter is charged once, to the first request that uses it
afterwards, together with any host-to-slot copy that request waited for.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.adapters import LoraAdapter, parse_adapter
from engine.api import AdapterError, AdapterInfo
from engine.lora import LoraState
from engine.model import ModelConfig
from engine.store import adapter_files, content_sha256


@dataclass
class _Entry:
    adapter: LoraAdapter  # host copy
    keys: set[str] = field(default_factory=set)
    slot: int | None = None
    pins: int = 0
    uncharged_load_us: int = 0  # disk load time not yet charged to a request


class AdapterPool:
    def __init__(self, lora: LoraState, model: ModelConfig, *, max_lora_rank: int, max_adapter_bytes: int):
        self._lora = lora
        self._model = model
        self._max_lora_rank = max_lora_rank
        self._max_bytes = max_adapter_bytes
        self._by_sha: dict[str, _Entry] = {}
        self._key_sha: dict[str, str] = {}
        self._slots: list[str | None] = [None] * lora.max_loras
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident shas, least recently used first
        self._infos: dict[str, AdapterInfo] = {}

    def load(self, key: str, path: Path) -> AdapterInfo:
        """Load (or alias) the adapter folder `path` under `key`; place it in a slot if one can be had."""
        if key in self._key_sha:
            raise AdapterError(
                f"adapter key {key!r} is already loaded; unload it first or use a new key (e.g. name@version)",
                code="adapter_key_in_use",
            )
        t0 = time.perf_counter_ns()
        config_path, weights_path = adapter_files(path, self._max_bytes)
        config_bytes, weight_bytes = config_path.read_bytes(), weights_path.read_bytes()
        sha = content_sha256(config_bytes, weight_bytes)
        entry = self._by_sha.get(sha)
        if entry is not None:
            # Same content under a new key: nothing more to read, validate or copy.
            tier = "gpu" if entry.slot is not None else "host"
        else:
            adapter = parse_adapter(
                config_bytes, weight_bytes, self._model, max_lora_rank=self._max_lora_rank, sha256=sha, source=Path(path)
            )
            entry = _Entry(adapter)
            self._by_sha[sha] = entry
            self._place(sha)
            _sync(self._lora.device)
            tier = "disk"
        load_us = (time.perf_counter_ns() - t0) // 1000
        if tier == "disk":
            entry.uncharged_load_us = load_us
        entry.keys.add(key)
        self._key_sha[key] = sha
        a = entry.adapter
        info = AdapterInfo(
            key=key, sha256=sha, rank=a.rank, alpha=a.alpha, use_rslora=a.use_rslora, target_modules=a.target_modules,
            nbytes=a.nbytes, load_us=load_us, tier=tier,
        )  # fmt: skip
        self._infos[key] = info
        return info

    def unload(self, key: str) -> None:
        """Forget `key`; the content goes when its last key goes. The caller checks no request uses the key."""
        sha = self._key_sha.pop(key, None)
        if sha is None:
            raise AdapterError(f"adapter key {key!r} is not loaded", code="unknown_adapter")
        del self._infos[key]
        entry = self._by_sha[sha]
        entry.keys.discard(key)
        if entry.keys:
            return
        assert entry.pins == 0, f"unloading {key!r} while {entry.pins} requests pin it"
        if entry.slot is not None:
            self._slots[entry.slot] = None
            self._lru.pop(sha, None)
        del self._by_sha[sha]

    def has(self, key: str) -> bool:
        return key in self._key_sha

    def info(self, key: str) -> AdapterInfo:
        return self._infos[key]

    def sha_of(self, key: str) -> str:
        return self._key_sha[key]

    def acquire(self, sha: str) -> tuple[int, int] | None:
        """Pin an adapter in a slot for a request: (slot, load_us to charge it), or None if every slot is pinned."""
        entry = self._by_sha[sha]
        page_in_us = 0
        if entry.slot is None:
            t0 = time.perf_counter_ns()
            if not self._place(sha):
                return None
            _sync(self._lora.device)
            page_in_us = (time.perf_counter_ns() - t0) // 1000
        entry.pins += 1
        self._lru.move_to_end(sha)
        charge, entry.uncharged_load_us = entry.uncharged_load_us + page_in_us, 0
        assert entry.slot is not None
        return entry.slot, charge

    def release(self, sha: str) -> None:
        entry = self._by_sha[sha]
        assert entry.pins > 0, sha
        entry.pins -= 1

    def resident(self) -> dict[int, str]:
        """slot -> sha256 of the adapters now in device slots."""
        return {i: sha for i, sha in enumerate(self._slots) if sha is not None}

    def _place(self, sha: str) -> bool:
        """Copy an adapter into a free slot, evicting the least recently used unpinned one if needed."""
        entry = self._by_sha[sha]
        assert entry.slot is None, sha
        slot = next((i for i, s in enumerate(self._slots) if s is None), None)
        if slot is None:
            victim = next((s for s in self._lru if self._by_sha[s].pins == 0), None)
            if victim is None:
                return False
            slot = self._by_sha[victim].slot
            assert slot is not None
            self._by_sha[victim].slot = None
            del self._lru[victim]
        self._lora.write(slot, entry.adapter)
        self._slots[slot] = sha
        entry.slot = slot
        self._lru[sha] = None
        return True


def _sync(device: torch.device) -> None:
    # Copies to a GPU are asynchronous; wait so the measured load time includes them.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
