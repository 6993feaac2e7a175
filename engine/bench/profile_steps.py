"""Where a step's device time goes: the kernels of engine steps, grouped and timed with torch.profiler.

`python -m engine.bench.profile_steps SHAPE OUT_DIR [--prompt P]` builds the bench's engine (engine.bench.build) at
SHAPE, batch 32, 32 adapters of rank 16, and profiles, for a base-only and a mixed batch: the prefill step
(eager) and a few decode steps (CUDA-graph replays). For each it prints the kernels by group (GEMM,
LoRA shrink/expand, attention, elementwise, ...) with launches and µs per step, the sum of kernel times
against the step's span on the device (the rest is gaps between kernels) and the host time per step
(wall time of engine.step() with the device synchronised around it). It then runs cProfile over decode
steps and prints the host functions that take the most time. Figures go to OUT_DIR/profile_<shape>.json.

A tool for finding what to speed up (engine/PERF.md records what it found), not a bench: the profiler
itself slows the host side.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.api import GenerationRequest, SamplingParams
from engine.bench.build import build_bench_engine, model_config

GROUPS = (  # (group, substrings of kernel names), first match wins
    ("lora_shrink", ("_shrink_kernel",)),
    ("lora_expand", ("_expand_kernel",)),
    ("attention", ("_paged_attention_kernel", "attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "splitKreduce")),
    ("fused", ("_fused_", "_rope_kv", "_silu_mul", "_add_rms")),
    ("norm", ("rms_norm", "RowwiseMoments", "norm")),
    ("copy/index", ("index", "copy", "Memcpy", "memcpy", "gather", "scatter", "embedding")),
    ("reduce/sample", ("reduce", "argmax", "max", "softmax", "topk", "sort")),
    ("memset", ("memset", "Memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def kernel_table(prof, steps: int) -> dict:
    """Per-step kernel time and launches by group and by name, and the device span covered by kernels."""
    by_name: dict[str, list[float]] = defaultdict(list)
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_name[e.name].append(e.time_range.elapsed_us())
        spans.append((e.time_range.start, e.time_range.end))
    busy = sum(sum(v) for v in by_name.values())
    span = (max(s[1] for s in spans) - min(s[0] for s in spans)) if spans else 0.0
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, ts in by_name.items():
        g = groups[group_of(name)]
        g[0] += sum(ts) / steps
        g[1] += len(ts) / steps
    names = sorted(((sum(ts) / steps, len(ts) / steps, name) for name, ts in by_name.items()), reverse=True)
    return {
        "kernel_us_per_step": busy / steps,
        "span_us_per_step": span / steps,
        "groups": {k: {"us": round(v[0], 1), "launches": round(v[1], 1)} for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
        "top": [{"us": round(us, 1), "launches": round(n, 1), "name": name[:90]} for us, n, name in names[:14]],
    }


def _add(engine, prompts, adapters, new, tag):
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}-{a}", input_ids=tuple(p), adapter_key=a, sampling=sp))


def _drain(engine):
    while engine.has_unfinished():
        engine.step()
    engine.pop_step_records()
    engine.pop_load_events()


def profile_shape(shape: str, out_dir: Path, prompt: int = 128, batch: int = 32, adapters: int = 32, rank: int = 16,
                  decode_steps: int = 8) -> dict:  # fmt: skip
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = model_config(shape)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    new = decode_steps + 40
    result: dict = {"shape": shape, "batch": batch, "prompt": prompt, "adapters": adapters, "rank": rank}
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_bench_engine(cfg, shape, [rank] * adapters, None, batch, prompt, new, dev, dtype, Path(tmp))
        runs = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
        for name, keys in runs.items():
            _add(engine, prompts, keys, 4, "warm")
            _drain(engine)
        for name, keys in runs.items():
            _add(engine, prompts, keys, new, name)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()  # the prefill of every prompt
                torch.cuda.synchronize()
            result[f"{name}_prefill"] = kernel_table(prof, 1)
            result[f"{name}_prefill"]["host_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
            engine.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(decode_steps):
                    engine.step()
                torch.cuda.synchronize()
            result[f"{name}_decode"] = kernel_table(prof, decode_steps)
            walls = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e6)
            result[f"{name}_decode"]["wall_us_per_step"] = statistics.median(walls)
            _drain(engine)
        # host side: cProfile over decode steps of the base batch
        _add(engine, prompts, runs["base"], new, "cprof")
        engine.step()
        engine.step()
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        for _ in range(30):
            engine.step()
        pr.disable()
        _drain(engine)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        result["host_profile"] = s.getvalue()
    (out_dir / f"profile_{shape}.json").write_text(json.dumps(result, indent=1))
    return result


def print_result(r: dict) -> None:
    print(r["host_profile"][-4000:])
    for case in ("base_prefill", "mixed_prefill", "base_decode", "mixed_decode"):
        t = r[case]
        if "host_ops" in t:
            print(t["host_ops"])
        extra = f", wall {t['wall_us_per_step']:.0f}" if "wall_us_per_step" in t else ""
        print(f"\n== {r['shape']} {case}: kernels {t['kernel_us_per_step']:.0f} µs/step, device span {t['span_us_per_step']:.0f}{extra}")
        for g, v in t["groups"].items():
            print(f"   {g:<14}{v['us']:>10.1f} µs {v['launches']:>7.1f} launches")
        for row in t["top"][:8]:
            print(f"     {row['us']:>9.1f} µs {row['launches']:>6.1f}x  {row['name']}")


def attention_configs(shape: str, contexts: tuple[int, ...] = (160, 544), batch: int = 32) -> None:
    """Decode attention alone, unsplit, per launch config (BLOCK_N, num_warps, num_stages, V loaded early): µs per launch
    as `attention_splits` times them, the fastest five and the launcher's own."""
    import itertools

    import kernels.paged_attention as module

    cfg = model_config(shape)
    kv, d, bs = cfg.num_kv_heads, cfg.head_dim, 16
    default = module._config
    print(f"\n== decode attention {shape}, batch {batch}: µs per launch by (BLOCK_N, warps, stages, early V)")
    for ctx in contexts:
        blocks = -(-(ctx + 1) // bs)
        caches = [(torch.randn(batch * blocks + 1, bs, kv, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch * blocks + 1, bs, kv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(8)]  # fmt: skip
        table = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
        lens = torch.full((batch,), ctx + 1, device="cuda", dtype=torch.int64)
        q = torch.randn(batch, cfg.num_heads, d, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * batch * (ctx + 1) * kv * d * 2
        times = []
        cands = [None, *itertools.product((64, 128), (4, 8), (2, 3, 4), (False, True))]
        for cand in cands:
            if cand is not None:
                module._config = lambda group_pad, max_q, head_dim, cand=cand: (default(group_pad, max_q, head_dim)[0], *cand)
            try:
                us = _graph_launch_us(lambda: [module.paged_attention(q, *caches[i % 8], table, lens, num_splits=1) for i in range(20)]) / 20
            finally:
                module._config = default
            times.append((us, cand or "launcher"))
        now = times[0][0]
        times.sort(key=lambda t: t[0])
        print(f"   context {ctx:>5}: launcher {now:6.1f} µs ({nbytes / now / 1e3:5.0f} GB/s) | best " +
              "  ".join(f"{c}: {us:.1f}" for us, c in times[:5]))


def _graph_launch_us(go) -> float:
    """Median µs of a CUDA-graph replay of go() (warmed and captured first), over 5 replays."""
    go()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        go()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def attention_splits(shape: str, contexts: tuple[int, ...] = (160, 544, 2048), batch: int = 32) -> None:
    """Decode attention alone (kernels/paged_attention.py) at `shape`'s heads, per split count: µs per launch in a
    CUDA graph of 20 launches over 8 layers' caches (so the caches are not L2-resident), and GB/s of KV read."""
    from kernels.paged_attention import paged_attention

    cfg = model_config(shape)
    kv, d, bs = cfg.num_kv_heads, cfg.head_dim, 16
    print(f"\n== decode attention {shape}, batch {batch}: µs per launch (GB/s of KV) by split count")
    for ctx in contexts:
        blocks = -(-(ctx + 1) // bs)
        layers = 8
        caches = [(torch.randn(batch * blocks + 1, bs, kv, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch * blocks + 1, bs, kv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]  # fmt: skip
        table = torch.arange(batch * blocks, device="cuda", dtype=torch.int64).view(batch, blocks)
        lens = torch.full((batch,), ctx + 1, device="cuda", dtype=torch.int64)
        q = torch.randn(batch, cfg.num_heads, d, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * batch * (ctx + 1) * kv * d * 2
        row = []
        for splits in (1, 2, 4, 8):
            us = _graph_launch_us(lambda: [paged_attention(q, *caches[i % layers], table, lens, num_splits=splits)
                                           for i in range(20)]) / 20  # fmt: skip
            row.append(f"{splits}: {us:6.1f} µs ({nbytes / us / 1e3:5.0f} GB/s)")
        print(f"   context {ctx:>5}:  " + "   ".join(row))


if __name__ == "__main__":
    shape, out = sys.argv[1], Path(sys.argv[2])
    if "--attention" in sys.argv:
        attention_splits(shape)
        sys.exit(0)
    if "--attention-configs" in sys.argv:
        attention_configs(shape)
        sys.exit(0)
    prompt = int(sys.argv[sys.argv.index("--prompt") + 1]) if "--prompt" in sys.argv else 128
    out.mkdir(parents=True, exist_ok=True)
    print_result(profile_shape(shape, out, prompt=prompt))
