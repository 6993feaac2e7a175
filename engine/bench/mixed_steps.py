"""What a step with prompt tokens costs beside decode rows: `python -m engine.bench.mixed_steps --shape llama-1b`.

One engine (engine.bench.build's random model, `batch` places, adapters of `ranks` on `targets` as the adapters bench
writes them, every place a different adapter), warmed up on each step shape it measures, its decode graphs captured.
For each k in `--prompt-rows`, with and without adapters: 64 - k requests are brought into decode, then k new ones
join, and the step that admits them is timed: its device µs as the engine books it (StepRecord.total_us, the span the
step's work took on the device, gaps between launches included), its wall µs, and the device µs of a whole-batch decode
step after it. The prompt step's cost beyond a decode step, against how many rows it prefills, is what the admission
hold weighs (engine.admission).

Prints one line per (adapters or base, k), then a JSON line. A probe of where time goes, not a target's bench.

`--profile OUT` also runs each first measured step (adapters, k) under torch.profiler with the host's activities: it
prints the host ops by their own CPU time and the launches the step made, and writes the chrome trace to OUT. An eager
step's device span is mostly the GPU waiting for the host's launches (PERF.md, session 16), and this shows for which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.api import GenerationRequest, SamplingParams
from engine.bench.adapters import write_adapters
from engine.bench.build import SHAPES, _kv_blocks, _word_tokenizer, model_config, random_model, sync
from engine.config import EngineConfig
from engine.engine import Engine


class _Requests:
    def __init__(self, vocab: int, prompt: int, new: int):
        self.vocab, self.prompt, self.new, self.n = vocab, prompt, new, 0

    def add(self, engine: Engine, k: int, keys: list[str] | None) -> None:
        sp = SamplingParams(max_new_tokens=self.new, ignore_eos=True)
        gen = torch.Generator().manual_seed(self.n)
        for _ in range(k):
            ids = torch.randint(4, self.vocab, (self.prompt,), generator=gen).tolist()
            key = keys[self.n % len(keys)] if keys else None
            engine.add_request(GenerationRequest(request_id=f"m{self.n}", input_ids=tuple(ids), adapter_key=key, sampling=sp))
            self.n += 1


def _drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
    engine.pop_step_records()
    engine.pop_load_events()


def run(shape: str, rows: list[int], *, batch: int = 64, prompt: int = 128, ranks: tuple[int, ...] = (8, 16, 32, 64),
        targets: tuple[str, ...] = ("q_proj", "v_proj"), device: str | None = None, repeats: int = 3,
        profile_dir: Path | None = None, prompt_graph_tokens: int = 2048) -> list[dict]:  # fmt: skip
    """One dict per (adapters or base, prompt rows k): the admitting step's device and wall µs (medians of `repeats`)
    and a whole-batch decode step's device µs."""
    assert all(0 < k <= batch for k in rows), rows
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = model_config(shape)
    new = 16  # the admitted step, then decode steps; the rest drains
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp) / "a", cfg, batch, list(ranks), targets)
        config = EngineConfig(
            model_dir=tmp, device=dev.type, max_batch_size=batch, max_prompt_tokens=prompt, max_new_tokens=new,
            max_num_batched_tokens=batch * prompt, kv_num_blocks=_kv_blocks(batch, prompt + new), max_loras=batch,
            max_lora_rank=max(ranks), enable_prefix_caching=False, adapter_loads_per_s=1e9, adapter_load_burst=10**6,
            warm_pool_slots=0, warm_pool_host_bytes=0, adapter_read_threads=0, adapter_read_processes=0,
            admission_hold_ms=0,  # every k joins at the step after it arrives
            cuda_graph_prompt_tokens=prompt_graph_tokens,
        )  # fmt: skip
        engine = Engine.from_model(config, random_model(cfg, dev, dtype, seed=0), _word_tokenizer(cfg.vocab_size), fingerprint=f"mixed-{shape}")
        keys = []
        for p in paths:
            engine.register_adapter(f"m/{p.name}", p)
            keys.append(f"m/{p.name}")
        reqs = _Requests(cfg.vocab_size, prompt, new)
        for k in rows:  # warm-up: each step shape measured below compiles and captures here
            for kk in (keys, None):
                reqs.add(engine, batch - k, kk)
                engine.step()
                reqs.add(engine, k, kk)
                _drain(engine)
        t0 = time.perf_counter()
        made = engine.capture_decode_graphs()
        print(f"captured {made} graphs (prompt and decode buckets not captured in the warm-up) in {time.perf_counter() - t0:.2f} s", flush=True)
        for label, kk in (("adapters", keys), ("base", None)):
            for k in rows:
                device_us, wall_us, decode_us = [], [], []
                for _ in range(repeats):
                    if k < batch:
                        reqs.add(engine, batch - k, kk)
                        for _ in range(3):
                            engine.step()
                    sync(dev)
                    engine.pop_step_records()
                    reqs.add(engine, k, kk)
                    t0 = time.perf_counter()
                    if profile_dir is not None and not device_us and label == "adapters":
                        _profiled(engine, dev, profile_dir / f"mixed-{shape}-{k}.json", k)
                    else:
                        engine.step()
                    sync(dev)
                    wall_us.append((time.perf_counter() - t0) * 1e6)
                    admitted = [r for r in engine.pop_step_records() if any(s.tokens > 1 for s in r.shares)]
                    assert len(admitted) == 1, f"k={k}: {len(admitted)} steps with prompt tokens"
                    device_us.append(admitted[0].total_us)
                    engine.step()
                    sync(dev)
                    decode_us += [r.total_us for r in engine.pop_step_records() if all(s.tokens == 1 for s in r.shares)]
                    _drain(engine)
                row = {"source": label, "prompt_rows": k, "decode_rows": batch - k, "step_device_us": statistics.median(device_us),
                       "step_wall_us": round(statistics.median(wall_us)), "decode_step_device_us": statistics.median(decode_us) if decode_us else None}  # fmt: skip
                print(f"{label:8} {k:4} prompt rows beside {batch - k:4} decode rows: step {row['step_device_us']:>10,.0f} µs on "
                      f"the device, {row['step_wall_us']:>10,} µs wall; a decode step {row['decode_step_device_us'] or 0:>8,.0f} µs", flush=True)  # fmt: skip
                out.append(row)
    return out


def _profiled(engine: Engine, dev: torch.device, trace: Path, k: int) -> None:
    """One engine step under torch.profiler: the host ops by their own CPU time, and the kernel launches."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
        sync(dev)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    total = sum(e.self_cpu_time_total for e in events)
    print(f"profile, {k} prompt rows: {launches} kernel launches, {total / 1e3:,.1f} ms of host ops' own time", flush=True)
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:30]:
        print(f"  {e.key[:60]:60} {e.count:6} calls {e.self_cpu_time_total / 1e3:9.2f} ms own {e.cpu_time_total / 1e3:9.2f} ms", flush=True)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench.mixed_steps", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--prompt-rows", default="64,54,9,1", help="prompt rows of the measured steps, comma-separated")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--device", default=None)
    p.add_argument("--prompt-graph-tokens", type=int, default=2048, help="engine.cuda_graph_prompt_tokens (0: prompt steps eager)")
    p.add_argument("--profile", type=Path, default=None, metavar="OUT", help="profile each k's first step; chrome traces to OUT")
    a = p.parse_args(argv)
    rows = run(a.shape, [int(k) for k in a.prompt_rows.split(",")], batch=a.batch, prompt=a.prompt, device=a.device,
               profile_dir=a.profile, prompt_graph_tokens=a.prompt_graph_tokens)
    print(json.dumps({"shape": a.shape, "batch": a.batch, "prompt": a.prompt, "rows": rows}))


if __name__ == "__main__":
    main()
