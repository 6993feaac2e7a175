"""Where a decode step's host time goes (issue 21's one-step rounds): `python -m engine.bench.host_profile --shape
llama-1b`.

The serving bench's batch (engine.bench.serving: B requests of prompt P on N adapters of rank R, or none), its decode
phase run twice, with engine.config decode_steps as configured (rounds of several steps, the next launched before the
last is read back) and with 1 (rounds of one step, the same way), each under cProfile after a warm-up. Prints each run's wall and device ms per step, the one-step runs' functions by their own time (a host wait in
`tolist` is the GPU's time; the rest is host work the GPU waits for), a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
from pathlib import Path

import torch

from engine.bench.build import SHAPES, build_bench_engine, model_config
from engine.bench.serving import _run
from engine.device import pick_device, pick_dtype


def profile(shape: str, adapters: int, rank: int, batch: int, prompt: int, new: int, device: str | None, top: int) -> list[dict]:
    dev = pick_device(device or "auto")
    dtype = pick_dtype("auto", dev)
    cfg = model_config(shape)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_bench_engine(cfg, shape, [rank] * adapters, None, batch, prompt, new, dev, dtype, Path(tmp))
        chained = engine.config.decode_steps
        for name, keys in (("base", [None] * batch), ("mixed", [f"a{i % adapters}" for i in range(batch)])):
            for steps in sorted({chained, 1}, reverse=True):
                engine.config = engine.config.model_copy(update={"decode_steps": steps})
                _run(engine, prompts, keys, min(8, new), f"w-{name}-{steps}")  # first-call costs at these shapes
                prof = cProfile.Profile()
                prof.enable()
                got = _run(engine, prompts, keys, new, f"{name}-{steps}")
                prof.disable()
                rows.append({"run": name, "decode_steps": steps, "step_ms": round(got["step_ms"], 3),
                             "device_step_ms": round(got["device_step_ms"], 3), "calls": got["decode_rounds"]})  # fmt: skip
                print(rows[-1], flush=True)
                if steps == 1:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
                    print(out.getvalue(), flush=True)
        engine.config = engine.config.model_copy(update={"decode_steps": chained})
    print("run | decode_steps | step ms | device step ms | step() calls")
    for r in rows:
        print(f"{r['run']} | {r['decode_steps']} | {r['step_ms']} | {r['device_step_ms']} | {r['calls']}")
    print(json.dumps({"shape": shape, "device": str(dev), "rows": rows}), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench.host_profile", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--top", type=int, default=28, help="functions listed per one-step run")
    a = p.parse_args(argv)
    for name in ("adapters", "rank", "batch", "prompt", "top"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.new < 2:
        p.error("--new must be at least 2 (a prefill and a decode step)")
    profile(a.shape, a.adapters, a.rank, a.batch, a.prompt, a.new, a.device, a.top)


if __name__ == "__main__":
    main()
