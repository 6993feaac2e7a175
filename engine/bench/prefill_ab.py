"""A prefill step with adapters against one without, with this checkout's LoRA kernels and, beside them on the same
engine, another version of one: `python -m engine.bench.prefill_ab --shape llama-1b --prompt 128 --reps 9
[--swap lora_shrink=FILE]`.

The bench's engine (engine.bench.build: batch 32, 32 adapters of rank 16 on all seven projections) prefills 32 prompts
of `--prompt` tokens, base-only and with a distinct adapter on each, `--reps` times each after two untimed rounds, the
versions interleaved. FILE is the kernel's module from another commit (`git show COMMIT:kernels/lora_shrink.py >
FILE`); its function of the same name stands in for the backend's (engine.backend.KernelBackend: lora_shrink,
lora_expand or lora_delta, the latter with that file's `fits`) in the "other" runs; swapping the shrink or the expand
turns the one-launch delta off in both versions, so that the kernel under test runs. `--swap lora_delta=off`: the other
runs take the shrink and the expand where this checkout's take the one-launch delta. `--profile K`: K more mixed prefills with this checkout's kernels, under cProfile,
and the functions that took the host's time (the step's Python, the launches), by own time. Prints the median wall and device ms of each case and LoRA's share per version, then
one JSON line. Device ms are a CUDA event span, so they include the gaps where the GPU waits for the host's launches.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.api import GenerationRequest, SamplingParams
from engine.bench.build import SHAPES, build_bench_engine, model_config
from engine.device import pick_device, pick_dtype

SWAPPABLE = ("lora_shrink", "lora_expand", "lora_delta")
OFF = Path("off")  # --swap lora_delta=off
CURRENT = ""  # the tag of the run under way ("mixed-other-3": kind, version, round), for a kernel under test to read


def load_other(field: str, path: Path):
    """The function `field` of the module file at `path`, imported under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"_prefill_ab_{field}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, field)


def backend_versions(backend, swap: tuple[str, Path] | None) -> dict:
    """{"this": backend[, "other": the backend with the swapped field]}. A shrink or expand under test runs where the
    engine takes the two kernels: the one-launch delta, which takes the 1b prefill's qkv, o and down, is off in both
    versions then. A delta from FILE comes with that file's `fits`, its own limits."""
    versions = {"this": backend}
    if swap is None:
        return versions
    field, path = swap
    if field != "lora_delta":
        print(f"--swap {field}: the one-launch delta is off in both versions, so that every projection runs {field}")
        versions["this"] = dataclasses.replace(backend, lora_delta=None)
        other = {field: load_other(field, path)}
    elif path == OFF:
        other = {"lora_delta": None}
    else:
        other = {"lora_delta": load_other(field, path), "lora_delta_fits": load_other("fits", path)}
    versions["other"] = dataclasses.replace(versions["this"], **other)
    return versions


def run(shape: str, prompt: int, reps: int, swap: tuple[str, Path] | None = None, device: str = "auto", batch: int = 32,
        adapters: int = 32, rank: int = 16, profile: int = 0, top: int = 30) -> dict:  # fmt: skip
    dev = pick_device(device)
    dtype = pick_dtype("auto", dev)
    cfg = model_config(shape)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    keys = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_bench_engine(cfg, shape, [rank] * adapters, None, batch, prompt, 4, dev, dtype, Path(tmp))
        state = engine.runner.lora
        versions = backend_versions(state.backend, swap)
        samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        order = list(versions.items())
        try:
            for rep in range(reps + 2):
                for kind in ("base", "mixed"):
                    for version, backend in order if rep % 2 else order[::-1]:  # each version first in turn
                        state.backend = backend
                        timed = _prefill(engine, prompts, keys[kind], f"{kind}-{version}-{rep}", dev)
                        if rep >= 2:
                            samples.setdefault((kind, version), []).append(timed)
        finally:
            state.backend = versions["this"]
        if profile:
            _profile(engine, prompts, keys["mixed"], dev, profile, top)
    out: dict = {"shape": shape, "prompt": prompt, "batch": batch, "reps": reps, "swap": None if swap is None else [swap[0], str(swap[1])]}
    for (kind, version), v in samples.items():
        out[f"{kind}_{version}_ms"] = round(statistics.median(w for w, _, _ in v), 3)
        out[f"{kind}_{version}_device_ms"] = round(statistics.median(d for _, d, _ in v), 3)
        out[f"{kind}_{version}_host_ms"] = round(statistics.median(h for _, _, h in v), 3)
    for version in versions:
        out[f"lora_pct_{version}"] = round(100 * (out[f"mixed_{version}_device_ms"] / out[f"base_{version}_device_ms"] - 1), 1)
    return out


def _prefill(engine, prompts, keys, tag, dev) -> tuple[float, float, float]:
    """(wall ms, device ms, host ms of the forward) of the step that prefills every prompt; the requests are then run out.
    The forward's host ms is the time its call takes to return, the launches issued and nothing waited for: where it
    is close to the device ms, the GPU waits for the host."""
    global CURRENT
    CURRENT = tag
    runner, host = engine.runner, []
    forward = runner.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            host.append((time.perf_counter() - t0) * 1e3)

    for i, (p, a) in enumerate(zip(prompts, keys)):
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}", input_ids=tuple(p), adapter_key=a,
                                             sampling=SamplingParams(max_new_tokens=2, ignore_eos=True)))  # fmt: skip
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    runner.forward = timed
    try:
        engine.step()
    finally:
        del runner.forward
    if cuda:
        end.record()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    device_ms = start.elapsed_time(end) if cuda else wall
    while engine.has_unfinished():
        engine.step()
    engine.pop_step_records()
    engine.pop_load_events()
    return wall, device_ms, sum(host)


def _profile(engine, prompts, keys, dev, reps: int, top: int) -> None:
    """`reps` mixed prefill steps under cProfile (the requests' decode steps outside it); prints the top functions."""
    prof = cProfile.Profile()
    for rep in range(reps):
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(request_id=f"prof-{rep}-{i}", input_ids=tuple(p), adapter_key=keys[i],
                                                 sampling=SamplingParams(max_new_tokens=2, ignore_eos=True)))  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize()
        prof.enable()
        engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        while engine.has_unfinished():
            engine.step()
        engine.pop_step_records()
        engine.pop_load_events()
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(f"--- {reps} mixed prefill steps under cProfile, by {key} ---")
        print(out.getvalue(), flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m engine.bench.prefill_ab", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--swap", default=None, help="FIELD=FILE: the backend's FIELD (lora_shrink, lora_expand or lora_delta) from the module file FILE; lora_delta=off: the two kernels")
    p.add_argument("--device", default="auto")
    p.add_argument("--profile", type=int, default=0, help="mixed prefills to run under cProfile after the timed ones")
    a = p.parse_args(argv)
    swap = None
    if a.swap is not None:
        field, _, path = a.swap.partition("=")
        if field == "lora_delta" and path == "off":
            swap = (field, OFF)
        elif field not in SWAPPABLE or not path or not Path(path).is_file():
            p.error(f"--swap {a.swap!r}: use FIELD=FILE with FIELD one of {', '.join(SWAPPABLE)} and FILE an existing module "
                    "file, or lora_delta=off")
        else:
            swap = (field, Path(path))
    if a.prompt < 1 or a.reps < 1:
        p.error("--prompt and --reps must be at least 1")
    if a.profile < 0:
        p.error("--profile must be 0 or more")
    out = run(a.shape, a.prompt, a.reps, swap, a.device, profile=a.profile)
    print("| case | kernels | wall ms (median) | device ms | forward's host ms |")
    for kind in ("base", "mixed"):
        for version in ("this", "other"):
            if f"{kind}_{version}_ms" in out:
                print(f"| {kind} | {version} | {out[f'{kind}_{version}_ms']:.2f} | {out[f'{kind}_{version}_device_ms']:.2f} | "
                      f"{out[f'{kind}_{version}_host_ms']:.2f} |")
    for version in ("this", "other"):
        if f"lora_pct_{version}" in out:
            print(f"{version}: LoRA +{out[f'lora_pct_{version}']:.1f}% (device)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
