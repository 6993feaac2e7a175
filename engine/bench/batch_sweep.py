"""The default config against a sweep of batch sizes (issue 20, target 2): `python -m engine.bench.batch_sweep --shape
llama-1b --adapters 32 --jobs 2048 --prompt-tokens 128 --new-tokens 64 --device cuda` (also `lorabatch bench
batch-sweep ...`).

One process, the engine alone (no broker, no worker). A random-weight model of the shape is written as a Hugging Face
folder (engine.bench.random_model), with `adapters` rank-16 PEFT adapters on all seven projections; then one fresh engine
per configuration, in turn:
- derived: `EngineConfig(model_dir, device)` and nothing else, what a user gets by default (on CUDA the batch, KV
  pool, adapter pool and readers come from the device, engine.sizing; the CPU keeps the demo's batch of 32);
- explicit: the same with `max_batch_size` set to each of `batch_sizes` (the rest still derived around it).
Each engine loads the adapters, is warmed up as the pipeline bench warms up (consumer.bench.pipeline: twice its batch of
jobs of 1 to `new_tokens` new tokens, so the batch shrinks through every graph bucket and the Triton variants of every
row count compile before the clock starts), then runs the measured jobs, all handed over at once (`Engine.generate`):
the same jobs (one seed) for every engine, each naming an adapter in turn, `prompt_tokens` random token ids, EOS
ignored. Between engines every reference is dropped and the CUDA cache emptied, so each finds the device's memory.

It prints a row per engine (batch size, source, seconds, tokens/s, jobs/s, ratio to the best tokens/s, steps, Triton
compiles in the warm-up and in the measured run: the latter should be 0), then whether the derived default reaches
TARGET of the best; then one JSON line. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from pydantic import ValidationError

from engine.api import GenerationRequest, SamplingParams
from engine.bench.instruments import Compiles
from engine.bench.build import SHAPES, sync
from engine.bench.random_model import write_random_adapters, write_random_model
from engine.config import EngineConfig
from engine.device import pick_device
from engine.engine import Engine

# --batch-sizes unless given, by device: the sweep on a GPU; on the CPU a few small ones, so that the default
# run takes seconds: there the torch reference kernels took 0.03 s a tiny-shape step on an idle 2-core machine and up
# to 0.7 s on a busy one, and a batch of 256 warms up on 512 jobs
DEFAULT_BATCH_SIZES = {"cuda": "16,32,64,128,256", "cpu": "2,4,8"}
TARGET = 0.90  # issue 20: the default config reaches 90% of the best throughput of the sweep
ADAPTER_RANK = 16
JOBS_SEED, WARM_SEED = 3, 9  # the measured jobs' prompts (one set for every engine) and the warm-up's


def parse_batch_sizes(text: str) -> list[int]:
    """The --batch-sizes option: comma-separated engine.max_batch_size values, ascending, each once. ValueError naming
    the option and the fix for an empty list, an entry that is not an integer, or one the engine refuses."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ValueError(f"--batch-sizes {text!r}: give comma-separated batch sizes, e.g. {DEFAULT_BATCH_SIZES['cuda']} (no empty entry)")
    sizes = set()
    for part in parts:
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"--batch-sizes {text!r}: {part!r} is not an integer; give e.g. {DEFAULT_BATCH_SIZES['cuda']}") from None
        if size < 1:
            raise ValueError(f"--batch-sizes {text!r}: {size} is not a batch size; each must be 1 or more")
        try:
            EngineConfig(max_batch_size=size)  # the engine's own bounds, not written twice
        except ValidationError as e:
            raise ValueError(f"--batch-sizes {text!r}: {size} is not a valid engine.max_batch_size ({e.errors()[0]['msg']})") from None
        sizes.add(size)
    return sorted(sizes)


def rank_rows(rows: list[dict], target: float = TARGET) -> dict:
    """Set each row's `ratio` (its tokens/s over the best row's) and return the verdict: the best row, the derived
    default's ratio, and whether it reaches `target`. Exactly one row is the derived default."""
    assert rows and all(r["tok_s"] > 0 for r in rows), rows
    derived = [r for r in rows if r["source"] == "derived"]
    assert len(derived) == 1, [r["source"] for r in rows]
    best = max(rows, key=lambda r: r["tok_s"])
    for r in rows:
        r["ratio"] = round(r["tok_s"] / best["tok_s"], 4)
    ratio = derived[0]["tok_s"] / best["tok_s"]
    return {"best_batch": best["batch"], "best_source": best["source"], "best_tok_s": best["tok_s"], "default_batch": derived[0]["batch"],
            "default_ratio": round(ratio, 4), "target": target, "meets_target": ratio >= target}  # fmt: skip


def verdict_line(v: dict) -> str:
    return (f"default ({v['default_batch']}, derived): {v['default_ratio']:.3f} of the best ({v['best_batch']}, {v['best_source']}, "
            f"{v['best_tok_s']:,.1f} tokens/s): {'reaches' if v['meets_target'] else 'misses'} the {v['target']:.2f} target")  # fmt: skip


def run_sweep(*, shape: str, adapters: int, jobs: int, prompt_tokens: int, new_tokens: int, batch_sizes: list[int] | None,
              device: str, json_only: bool = False, root: Path | None = None) -> dict:  # fmt: skip
    """The bench of the module docstring; prints its table (unless json_only), then one JSON line; returns the figures.
    `batch_sizes` None: DEFAULT_BATCH_SIZES of the device. The other defaults are the command line's (`parse_args`)."""
    assert shape in SHAPES, f"shape {shape!r}: use one of {sorted(SHAPES)}"
    assert adapters >= 1 and jobs >= 1 and prompt_tokens >= 1 and new_tokens >= 1, (adapters, jobs, prompt_tokens, new_tokens)
    dev = pick_device(device)
    sizes = batch_sizes if batch_sizes is not None else parse_batch_sizes(DEFAULT_BATCH_SIZES[dev.type])
    started = time.perf_counter()

    def say(what: str) -> None:  # at llama-1b an engine loads, warms up and runs for a while before its row
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="lorabatch-sweep-", dir=root) as tmp:
        home = Path(tmp)
        model_dir = write_random_model(home / "model", shape=shape, seed=0)
        paths = write_random_adapters(home / "adapters", shape=shape, count=adapters, rank=ADAPTER_RANK, seed=1)
        say(f"{shape} model and {adapters} adapters written under {home}")
        vocab = SHAPES[shape][5]
        keys = [f"a{i}" for i in range(adapters)]
        prompts = _prompts(jobs, prompt_tokens, vocab, JOBS_SEED)
        configs = [("derived", EngineConfig(model_dir=str(model_dir), device=dev.type))]
        configs += [("explicit", EngineConfig(model_dir=str(model_dir), device=dev.type, max_batch_size=b)) for b in sizes]
        rows = []
        for source, config in configs:
            row = _measure(config, source, dict(zip(keys, paths)), prompts, new_tokens, vocab, say)
            rows.append(row)
            _release(dev)
            say(f"{row['batch']} ({source}): {row['tok_s']:,.1f} tokens/s, {row['jobs_s']:,.2f} jobs/s"
                + (f"; {torch.cuda.memory_allocated(dev) / 2**20:.0f} MiB still allocated" if dev.type == "cuda" else ""))
    verdict = rank_rows(rows)
    figures = {"shape": shape, "device": dev.type, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "adapters": adapters, "jobs": jobs, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "batch_sizes": sizes,
               "rows": rows, **verdict}  # fmt: skip
    if not json_only:
        _print_table(figures)
    print(json.dumps(figures), flush=True)
    return figures


def _prompts(n: int, tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(row) for row in torch.randint(10, vocab, (n, tokens), generator=gen).tolist()]


def _requests(prompts: list[tuple[int, ...]], keys: list[str], new: Callable[[int], int], tag: str) -> list[GenerationRequest]:
    """A request per prompt, the adapters taking turns, `new(i)` new tokens for the i-th (EOS ignored)."""
    return [GenerationRequest(request_id=f"{tag}-{i}", input_ids=p, adapter_key=keys[i % len(keys)],
                              sampling=SamplingParams(max_new_tokens=new(i), ignore_eos=True))
            for i, p in enumerate(prompts)]  # fmt: skip


def _measure(config: EngineConfig, source: str, adapters: dict[str, Path], prompts: list[tuple[int, ...]], new_tokens: int,
             vocab: int, say: Callable[[str], None]) -> dict:  # fmt: skip
    """One engine of `config`: load the adapters, warm up, run `prompts` at once; its row. No reference to the engine
    outlives the call (the caller frees the device after it)."""
    free = torch.cuda.mem_get_info(pick_device(config.device))[0] if config.device == "cuda" else None
    engine = Engine(config)
    try:
        batch = engine.config.max_batch_size
        say(f"engine {source}: max_batch_size {batch}, {engine.config.kv_pool_blocks} KV blocks"
            + (f" ({free / 2**30:.1f} GiB free at start)" if free is not None else ""))
        for key, path in adapters.items():
            engine.load_adapter(key, path)
        keys = list(adapters)
        with Compiles() as compiles:
            # Twice the batch, new tokens 1 .. new_tokens: the batch shrinks through every size, so every decode graph
            # bucket is captured and every row count's kernel variants compiled before the clock starts.
            warm = _requests(_prompts(2 * batch, len(prompts[0]), vocab, WARM_SEED), keys, lambda i: 1 + i % new_tokens, "warm")
            _check(engine.generate(warm), "warm-up")
            engine.pop_step_records()
            engine.pop_load_events()
            warm_compiles = compiles.take()
            say(f"engine {source}: warmed up on {len(warm)} jobs ({warm_compiles} Triton compiles)")
            reqs = _requests(prompts, keys, lambda i: new_tokens, "job")
            sync(engine.device)
            t0 = time.perf_counter()
            results = engine.generate(reqs)
            sync(engine.device)
            seconds = time.perf_counter() - t0
            measured_compiles = compiles.take()
        _check(results, "measured run")
        tokens = sum(len(r.output_ids) for r in results)
        return {"batch": batch, "source": source, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
                "jobs_s": round(len(reqs) / seconds, 2), "tokens": tokens, "steps": len(engine.pop_step_records()),
                "preemptions": engine.stats()["preemptions"], "kv_blocks": engine.config.kv_pool_blocks,
                "compiles_warmup": warm_compiles, "compiles_measured": measured_compiles,
                "free_gib_at_start": round(free / 2**30, 1) if free is not None else None}  # fmt: skip
    finally:
        engine.adapters.close()  # the reader processes (derived on CUDA)


def _check(results: list, what: str) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} jobs failed in the {what}, e.g. {failed[0].error}"


def _release(device: torch.device) -> None:
    """Give the last engine's device memory back (its weights, KV pool, adapter pages, graph pools), so the next engine's
    sizes derive from the whole device."""
    gc.collect()  # the engine's reference cycles (runner, pool, planner) hold its tensors until collected
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _print_table(f: dict) -> None:
    print(f"{f['shape']} on {f['device_name']}: {f['jobs']} jobs over {f['adapters']} adapters (rank {ADAPTER_RANK}), prompt "
          f"{f['prompt_tokens']}, {f['new_tokens']} new tokens; the engine alone, one engine a row")  # fmt: skip
    print(f"{'batch':>6} {'source':<9} {'seconds':>8} {'tokens/s':>11} {'jobs/s':>9} {'ratio':>6} {'steps':>6} {'compiles w/m':>13}")
    for r in f["rows"]:
        print(f"{r['batch']:>6} {r['source']:<9} {r['seconds']:>8.2f} {r['tok_s']:>11,.1f} {r['jobs_s']:>9,.2f} {r['ratio']:>6.3f} "
              f"{r['steps']:>6} {str(r['compiles_warmup']) + '/' + str(r['compiles_measured']):>13}")  # fmt: skip
    print(verdict_line(f))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench.batch_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="random weights of this shape")
    p.add_argument("--adapters", type=int, default=2, help=f"rank-{ADAPTER_RANK} adapters on all seven projections; the jobs take turns")
    p.add_argument("--jobs", type=int, default=8, help="measured jobs, the same for every engine")
    p.add_argument("--prompt-tokens", type=int, default=8, help="random prompt token ids per job")
    p.add_argument("--new-tokens", type=int, default=4, help="new tokens per job (EOS ignored)")
    p.add_argument("--batch-sizes", default=None,
                   help="explicit max_batch_size values swept beside the derived default, comma-separated (default "
                   f"{DEFAULT_BATCH_SIZES['cuda']} on cuda, {DEFAULT_BATCH_SIZES['cpu']} on cpu)")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", dest="json_only", action="store_true", help="only the JSON line")
    a = p.parse_args(argv)
    for name in ("adapters", "jobs", "prompt_tokens", "new_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be 1 or more")
    if a.batch_sizes is not None:
        try:
            a.batch_sizes = parse_batch_sizes(a.batch_sizes)
        except ValueError as e:
            p.error(str(e))
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    run_sweep(shape=a.shape, adapters=a.adapters, jobs=a.jobs, prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens,
              batch_sizes=a.batch_sizes, device=a.device, json_only=a.json_only)  # fmt: skip


if __name__ == "__main__":
    main()
