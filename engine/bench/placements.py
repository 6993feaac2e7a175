"""What one L1 placement's write costs the engine thread (issue 19): `python -m engine.bench.placements --shape llama-1b`.

`LoraState.write` (engine.lora) of N adapters' L2 copies (ranks cycled over `--ranks`, on `--targets`, random bytes in
an L2 host arena as the adapter pool makes it: plain pinned, or with `--shared` the shared segment that reader
processes write into), timed on the host per write: with the GPU idle, and with the compute stream busy (a queue of
matmuls ahead of the writes, as a pipelined round leaves it). Each write is also taken apart, the same torch calls
timed one by one: filling the tables' host rows, their three copies, the stopwatch's events, the pages' DMAs. Prints a
table, then one JSON line.

On an H100 (session 25): 88 µs a write at the median, of which the three table-row copies 37, the rows 20, the
stopwatch 13 and the DMAs 18 (two a load); the same idle or busy, plain or shared arena.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.adapter_pages import HostPages, copy_runs
from engine.backend import KernelBackend
from engine.bench.build import SHAPES, model_config
from engine.device import pick_device, pick_dtype
from engine.host_arena import HostArena
from engine.lora import LoraState
from engine.model import LORA_TARGETS
from engine.timing import Stopwatch


def _hosts(lora: LoraState, arena: HostArena, count: int, ranks: list[int], targets: tuple[str, ...]) -> list[HostPages]:
    modules = tuple(LORA_TARGETS.index(m) for m in targets)
    hosts = []
    for i in range(count):
        rank = ranks[i % len(ranks)]
        sizes = tuple(lora.page_elems[m] for m in modules)
        data = arena.alloc(rank * sum(sizes))
        assert data is not None, "the arena is too small for the adapters"
        data.normal_()
        hosts.append(HostPages(sha256=f"{i:064x}", rank=rank, scaling=1.0, alpha=float(rank), use_rslora=False,
                               target_modules=targets, modules=modules, data=data, page_elems=sizes))  # fmt: skip
    return hosts


def _busy(dev: torch.device, ms: float) -> None:
    """Queue about `ms` of matmuls on the compute stream (nothing waits for them)."""
    if dev.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    a @ a
    t1.record()
    t1.synchronize()
    for _ in range(max(1, int(ms / max(t0.elapsed_time(t1), 1e-3)))):
        a @ a


def _free_all(lora: LoraState, placed: list[tuple[HostPages, list[list[int]]]]) -> None:
    for host, pages in placed:
        for size, offsets in zip(host.page_elems, pages):
            lora.allocator.free(size, offsets)


def _pages(lora: LoraState, host: HostPages) -> list[list[int]]:
    pages = lora.allocator.alloc(lora.page_need(host))
    assert pages is not None, "the budget is too small for the adapters"
    return pages


def _whole(lora, hosts, dev, busy_ms) -> list[float]:
    """µs of host time per `write`."""
    _busy(dev, busy_ms)
    placed, us = [], []
    for slot, host in enumerate(hosts):
        pages = _pages(lora, host)
        t0 = time.perf_counter_ns()
        lora.write(slot, host, pages)
        us.append((time.perf_counter_ns() - t0) / 1e3)
        placed.append((host, pages))
    _sync(dev)
    _free_all(lora, placed)
    return us


def _parts(lora, hosts, dev, busy_ms) -> dict[str, list[float]]:
    """The torch calls of one write timed one by one (µs each): its parts' host time."""
    _busy(dev, busy_ms)
    parts: dict[str, list[float]] = {"rows": [], "table_copies": [], "stopwatch": [], "dmas": [], "dma_count": []}
    placed = []
    stream = lora.copy_stream
    for slot, host in enumerate(hosts):
        pages = _pages(lora, host)
        t = [time.perf_counter_ns()]
        table, ranks = lora._pages_np[slot], lora._rank_np[slot]
        table.fill(0)
        ranks.fill(0)
        for m, offsets in zip(host.modules, pages):
            table[m, : host.rank] = offsets
            ranks[m] = host.rank
        lora._scale_np[slot] = host.scaling
        runs = copy_runs(host, pages)
        t.append(time.perf_counter_ns())
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with ctx:
            lora.pages[slot].copy_(lora._pages_host[slot], non_blocking=True)
            lora.rank[slot].copy_(lora._rank_host[slot], non_blocking=True)
            lora.scale[slot : slot + 1].copy_(lora._scale_host[slot : slot + 1], non_blocking=True)
            t.append(time.perf_counter_ns())
            watch = Stopwatch(lora.device, stream)
            t.append(time.perf_counter_ns())
            for src, dest, n in runs:
                lora.pool[dest : dest + n].copy_(host.data[src : src + n], non_blocking=True)
            t.append(time.perf_counter_ns())
            watch.stop()
        t.append(time.perf_counter_ns())
        parts["rows"].append((t[1] - t[0]) / 1e3)
        parts["table_copies"].append((t[2] - t[1]) / 1e3)
        parts["stopwatch"].append((t[3] - t[2] + t[5] - t[4]) / 1e3)
        parts["dmas"].append((t[4] - t[3]) / 1e3)
        parts["dma_count"].append(len(runs))
        placed.append((host, pages))
    _sync(dev)
    _free_all(lora, placed)
    return parts


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stats(us: list[float]) -> dict:
    s = sorted(us)
    return {"p50": round(statistics.median(s), 1), "p90": round(s[int(0.9 * (len(s) - 1))], 1), "max": round(s[-1], 1),
            "mean": round(statistics.fmean(s), 1)}  # fmt: skip


def run(shape: str, count: int, ranks: list[int], targets: tuple[str, ...], busy_ms: float, repeats: int,
        device: str | None, shared: bool) -> dict:  # fmt: skip
    dev = pick_device(device or "auto")
    dtype = pick_dtype("auto", dev)
    cfg = model_config(shape)
    lora = LoraState(max_loras=count, max_lora_rank=max(ranks), device=dev, dtype=dtype, backend=KernelBackend("torch"),
                     cfg=cfg, gpu_bytes=None)  # fmt: skip
    elem = torch.empty(0, dtype=dtype).element_size()
    need = sum(r * sum(lora.page_elems[LORA_TARGETS.index(m)] for m in targets) for r in (ranks[i % len(ranks)] for i in range(count)))
    arena = HostArena(need * elem * 5 // 4, dtype, lora.copy_stream, shared=shared)
    lora.arena = arena
    hosts = _hosts(lora, arena, count, ranks, targets)
    row: dict = {"shape": shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "adapters": count,
                 "ranks": ranks, "targets": list(targets), "busy_ms": busy_ms, "shared_arena": arena.name is not None,
                 "mean_bytes": round(statistics.fmean(h.nbytes for h in hosts))}  # fmt: skip
    _whole(lora, hosts, dev, 0)  # warm-up: first calls, events, the allocator's chunks
    for cond, ms in (("idle", 0.0), ("busy", busy_ms)):
        whole, parts = [], {}
        for _ in range(repeats):
            whole += _whole(lora, hosts, dev, ms)
            for k, v in _parts(lora, hosts, dev, ms).items():
                parts.setdefault(k, []).extend(v)
        row[f"{cond}_write_us"] = _stats(whole)
        row[f"{cond}_parts_us"] = {k: _stats(v) for k, v in parts.items()}
    return row


def _print(row: dict) -> None:
    print(f"{row['shape']} on {row['device']}: {row['adapters']} adapters of ranks {row['ranks']} on {row['targets']}, "
          f"{row['mean_bytes'] / 1e6:.2f} MB mean; arena shared: {row['shared_arena']}")  # fmt: skip
    print("GPU | write p50/p90/max us | rows | table copies | stopwatch | DMAs (count p50)")
    for cond in ("idle", "busy"):
        w, p = row[f"{cond}_write_us"], row[f"{cond}_parts_us"]
        print(f"{cond} | {w['p50']}/{w['p90']}/{w['max']} | {p['rows']['p50']} | {p['table_copies']['p50']} | "
              f"{p['stopwatch']['p50']} | {p['dmas']['p50']} ({p['dma_count']['p50']})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench.placements", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--adapters", type=int, default=256)
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--busy-ms", type=float, default=30.0, help="work queued on the compute stream before the busy writes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shared", action="store_true", help="the L2 arena as a shared segment (reader processes' layout)")
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    if a.adapters < 1 or a.repeats < 1 or a.busy_ms < 0:
        p.error("--adapters and --repeats take a count of 1 or more, --busy-ms a time of 0 or more")
    row = run(a.shape, a.adapters, [int(r) for r in a.ranks.split(",")], tuple(a.targets.split(",")), a.busy_ms,
              a.repeats, a.device, a.shared)  # fmt: skip
    _print(row)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
