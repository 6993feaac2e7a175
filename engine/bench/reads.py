"""What one store read costs on this host's CPU: `python -m engine.bench.reads [--shape llama-1b] [--ranks 8,16,32,64]`.

Writes `--per-rank` PEFT adapters of each rank (q_proj and v_proj, as the adapters bench's) at SHAPE, then reads each
registered one `--reps` times the way a reader process does (engine.adapter_records.read_validated: the files, their
sha256, validation) with the sha256 computed first and beside the validation, and lays its pages out
(engine.adapter_pages.write_pages); prints the median ms of each by rank, then one JSON line. One thread reads; the
figures are one core's, as one reader process's are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import engine.adapter_records as records
from engine.adapter_pages import page_elems_of, write_pages
from engine.bench.adapters import write_adapters
from engine.bench.build import SHAPES, model_config
from engine.store import content_sha256, read_file


def run(shape: str, ranks: list[int], per_rank: int, reps: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reader process's setting (engine.adapter_reader)
    try:
        return _run(shape, ranks, per_rank, reps)
    finally:
        torch.set_num_threads(threads)


def _run(shape: str, ranks: list[int], per_rank: int, reps: int) -> dict:
    cfg = model_config(shape)
    shapes = cfg.projection_shapes()
    threshold = records.OVERLAP_HASH_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), cfg, per_rank * len(ranks), ranks, ("q_proj", "v_proj"))
        shas = [content_sha256((p / "adapter_config.json").read_bytes(), read_file(p / "adapter_model.safetensors", sys.maxsize)) for p in paths]
        times: dict[str, dict[int, list[float]]] = {"hash_first": {}, "hash_beside": {}, "pages": {}}
        # One buffer for every layout, touched once first: the pages go to the L2 arena's memory, long mapped, not to fresh
        # pages of the OS (whose first touch cost a rank-64 layout 15 ms here against 2.5 at rank 32)
        arena = torch.zeros(page_elems_of(("q_proj", "v_proj"), max(ranks), shapes, cfg.num_layers), dtype=torch.bfloat16)
        try:
            _time_reads(paths, shas, cfg, shapes, ranks, reps, arena, times)
        finally:
            records.OVERLAP_HASH_BYTES = threshold
    out = {"shape": shape, "reps": reps, "per_rank": per_rank}
    for name, by_rank in times.items():
        out[f"{name}_ms"] = {r: round(statistics.median(v), 2) for r, v in sorted(by_rank.items())}
    return out


def _time_reads(paths, shas, cfg, shapes, ranks, reps, arena, times) -> None:
    """Fill `times` (order -> rank -> ms): every read both ways, the layout after the second, the first round uncounted."""
    orders = (("hash_first", 1 << 62), ("hash_beside", 0))
    for rep in range(reps + 1):  # the first round warms the page cache and the hashing threads, and is not counted
        for order, limit in orders if rep % 2 else orders[::-1]:  # each first in turn
            records.OVERLAP_HASH_BYTES = limit
            for path, sha in zip(paths, shas):
                t0 = time.perf_counter()
                got, adapter = records.read_validated(path, sha, cfg, 1 << 31, max(ranks), None)
                t1 = time.perf_counter()
                assert got == sha and adapter is not None, path
                if order == "hash_beside":
                    data = arena[: page_elems_of(adapter.target_modules, adapter.rank, shapes, cfg.num_layers)]
                    write_pages(data, adapter.weights, adapter.target_modules, adapter.rank, shapes, cfg.num_layers)
                    if rep:
                        times["pages"].setdefault(adapter.rank, []).append((time.perf_counter() - t1) * 1e3)
                if rep:
                    times[order].setdefault(adapter.rank, []).append((t1 - t0) * 1e3)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m engine.bench.reads", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--per-rank", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    try:
        ranks = [int(r) for r in a.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks {a.ranks!r}: use whole numbers separated by commas, e.g. 8,16,32,64")
    if a.per_rank < 1 or a.reps < 1 or min(ranks) < 1:
        p.error("--per-rank, --reps and every rank of --ranks must be at least 1")
    out = run(a.shape, ranks, a.per_rank, a.reps)
    print("rank | read, sha256 first ms | read, sha256 beside ms | page layout ms")
    for r in sorted(out["hash_first_ms"]):
        print(f"{r} | {out['hash_first_ms'][r]} | {out['hash_beside_ms'][r]} | {out['pages_ms'][r]}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
