"""Many adapters at once (issue 19): `python -m engine.bench.adapters --shape llama-1b --counts 5,100,1000,2000
--ranks 8,16,32,64 --requests 1024 --batch 64` (also `lorabatch bench adapters ...`).

One process; per adapter count a fresh engine on a random model of the shape, `requests` requests of `prompt` random
tokens and `new` generated ones, each for an adapter drawn uniformly from `count` distinct ones (ranks cycled over
`ranks`, on `targets`), after warm-up passes on adapters of their own, every rank, one with base requests among
them, one with an adapter on every request, one whose requests arrive in waves of odd sizes, and one admitting most of
a batch beside a few running requests, as a held admission does (kernels compiled, graphs captured; the row counts the
Triton compiles left in each measured pass, and each pass's steps with prompt tokens and held admissions). Two
passes over the same requests: cold (every adapter only on disk, L3) and host-warm (every adapter read once into L2,
pinned, and L1 emptied before it: each adapter's first use is an L2 load). L1 holds what the adapter budget's bytes
hold: the engine has a page-table row for every adapter, so rows never limit residency. Per count it prints tokens/s of both passes and their ratio to the
smallest count's, the loads by tier, L2 -> L1 load time p50/p99 (copy on the side stream, CUDA events) against the
pinned-copy floor of the same bytes measured in the same run (one host-to-device copy of an adapter's bytes from
pinned memory), the p99 decode step with a load in it and the median one without, and how many adapters of the
median size the adapter budget holds. It runs on the CPU too, with `--shape tiny` (tests, smoke checks).

Adapters: distinct content each (their sha256 differ, so no two share a copy), drawn cheaply: one random A and B per
rank, and each adapter's own index written into three entries of B.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.admission import COALESCE_STEPS, AdmissionHold
from engine.collector import hold_full_passes, release_full_passes, unfreeze
from engine.api import GenerationRequest, SamplingParams
from engine.bench.build import SHAPES, _kv_blocks, _word_tokenizer, model_config, random_model, sync
from engine.bench.instruments import Compiles, GcPauses, StallStacks, StepPhases
from engine.config import EngineConfig
from engine.engine import Engine
from engine.engine_process import GIL_SWITCH_S, _freeze_gc
from engine.model import PROJECTION_PARENT, ModelConfig
from engine.sizing import auto_readers

# Store reads of queued requests' adapters run ahead on this many threads (engine.adapter_records), each handing its read to
# one of as many reader processes (engine.adapter_reader; 0: none): by default what the engine derives for this host.
READ_THREADS = READ_PROCESSES = auto_readers()


def write_adapters(root: Path, cfg: ModelConfig, count: int, ranks: list[int], targets: tuple[str, ...], first: int = 0) -> list[Path]:
    """`count` PEFT adapter folders of distinct content (module docstring), rank ranks[i % len(ranks)], marked with the
    indices first..first + count - 1 (so two calls with disjoint ranges write no content twice; below 4,096)."""
    assert 0 <= first and first + count <= 4096, (first, count)
    gen = torch.Generator().manual_seed(19)
    shapes = cfg.projection_shapes()
    base = {}
    for r in sorted(set(ranks)):
        base[r] = {m: ((torch.randn(cfg.num_layers, r, shapes[m][0], generator=gen) * shapes[m][0] ** -0.5).to(torch.bfloat16),
                       (torch.randn(cfg.num_layers, shapes[m][1], r, generator=gen) * (0.05 / math.sqrt(r))).to(torch.bfloat16))
                   for m in targets}  # fmt: skip
    paths = []
    for i in range(first, first + count):
        r = ranks[i % len(ranks)]
        path = root / f"ad{i:05d}"
        path.mkdir(parents=True)
        weights = {}
        for m in targets:
            a, b = base[r][m]
            b = b.clone()
            b[0, 0, :3] = torch.tensor([(i >> 8) & 15, (i >> 4) & 15, i & 15], dtype=torch.bfloat16) / 64  # exact in bf16
            for layer in range(cfg.num_layers):
                prefix = f"base_model.model.model.layers.{layer}.{PROJECTION_PARENT[m]}.{m}"
                weights[f"{prefix}.lora_A.weight"] = a[layer].contiguous()
                weights[f"{prefix}.lora_B.weight"] = b[layer].contiguous()
        save_file(weights, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "lora_dropout": 0.0,
            "bias": "none", "adapter_index": i,
        }))  # fmt: skip
        paths.append(path)
    return paths


def pinned_copy_floor_us(nbytes: int, dev: torch.device, repeats: int = 20) -> float:
    """Median µs of one host-to-device copy of `nbytes` from pinned memory on a side stream (the floor of a load)."""
    if dev.type != "cuda":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            dst.copy_(src)
            times.append((time.perf_counter_ns() - t0) / 1000)
        return statistics.median(times)
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times[2:])


def _pass(engine: Engine, prompts: list[list[int]], keys: list[str], new: int, tag: str, batch: int, synced: bool = True) -> dict:
    """Every request, at most `batch` running (the engine's max_batch_size); tokens/s over the pass, the loads it made,
    each engine.step() call's wall time per step, and whether a load happened in it. `synced`: the device is synchronised
    after each call, so that a call's wall time holds the GPU work it launched and its own host work end to end;
    without, steps are popped as the engine process pops them (a round left in flight), and a call's wall time is the
    interval between two calls' returns, as a serving loop sees it: host work overlapped with the round in flight."""
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i, (p, k) in enumerate(zip(prompts, keys)):
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}", input_ids=tuple(p), adapter_key=k, sampling=sp))
    engine.pop_load_events()
    engine.pop_step_records()
    counters = engine.adapters.counters
    sync(engine.device)
    t0 = time.perf_counter()
    # (µs per step, a load in the call, a decode-only call, measured µs per step, GC ms, tag, steps, placements, their µs,
    # the longest collection in it as (ms, generation))
    tokens, calls = 0, []
    paused = GcPauses()
    gc_ms = 0.0  # the collector's pauses over the pass
    stalls = StallStacks()
    decode_rows = decode_steps = prompt_steps = 0
    holds = engine.planner.hold.holds
    cuts = engine.planner.load_ahead_cuts
    disk0 = counters["loads_disk"]
    placed0, placed_ns0 = engine.adapters.placements, engine.adapters.placement_ns
    # one row per step() call: ms into the pass, its wall µs, its steps' measured µs, prompt rows, decode rows, then after
    # it: requests running, waiting, store reads in flight, landed and not taken, taken so far, admission holds so far; then
    # the steps booked in it, its L1 placements for requests and their host µs, and the µs it waited for the round it read
    # back (None where no round was left in flight: a wait near 0 says the host held the GPU up, a long one the GPU)
    timeline: list[tuple] = []
    spent = {True: 0.0, False: 0.0}  # seconds of decode-only calls, of calls with prompt tokens
    try:
        while engine.has_unfinished():
            loads = counters["loads_disk"] + counters["loads_host"]
            gc_ms += paused.ms
            paused.ms, paused.longest = 0.0, None
            placed, placed_ns = engine.adapters.placements, engine.adapters.placement_ns
            c0 = stalls.begin()
            results = engine.step()
            if synced:
                sync(engine.device)
            us = (time.perf_counter() - c0) * 1e6
            waited_us = round(engine._waited_ns / 1e3) if engine._inflight is not None else None  # the read-back's wait
            stalls.end()
            records = engine.pop_step_records(drain=synced)
            time.sleep(engine.idle_wait_s())  # as the serving loop (engine.async_engine) when nothing could run
            tokens += sum(len(r.output_ids) for r in results)
            prompt_steps += sum(any(share.tokens > 1 for share in r.shares) for r in records)
            timeline.append((round((c0 - t0) * 1e3, 2), round(us), sum(r.total_us for r in records), sum(s.tokens > 1 for r in records for s in r.shares),
                             sum(s.tokens == 1 for r in records for s in r.shares), len(engine.planner.running),
                             len(engine.planner.waiting), engine.adapters.reads_in_flight, engine.adapters.reads_landed, counters["loads_disk"] - disk0,
                             engine.planner.hold.holds - holds, len(records), engine.adapters.placements - placed,
                             round((engine.adapters.placement_ns - placed_ns) / 1e3), waited_us))
            if records:
                decode = all(r.tokens <= batch for r in records)
                spent[decode] += us * 1e-6
                if decode:
                    decode_rows += sum(r.tokens for r in records)
                    decode_steps += len(records)
                calls.append((us / len(records), counters["loads_disk"] + counters["loads_host"] > loads, decode,
                              sum(r.total_us for r in records) / len(records), round(paused.ms, 2), tag, len(records),
                              engine.adapters.placements - placed, timeline[-1][-2], paused.longest or (0.0, -1), waited_us))
    finally:
        gc_ms += paused.ms
        paused.close()
        stalls.close()
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    events = [e for e in engine.pop_load_events() if e.skip_reason is None and e.error_code is None]
    # each store read of the pass: ms into the pass when it began on its thread and landed; each disk load's µs (read and copy)
    spans = sorted((round((a - t0) * 1e3, 2), round((b - t0) * 1e3, 2)) for a, b in engine.adapters.read_spans if a >= t0)
    timeline_reads = {"started_landed_ms": spans, "load_us": [e.load_us for e in events if e.tier == "disk"]}
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "events": events, "calls": calls,
            "decode_rows_mean": round(decode_rows / decode_steps, 1) if decode_steps else None,
            "decode_s": round(spent[True], 3), "mixed_s": round(spent[False], 3), "prompt_steps": prompt_steps,
            "admission_holds": engine.planner.hold.holds - holds, "load_ahead_cuts": engine.planner.load_ahead_cuts - cuts,
            "placements": engine.adapters.placements - placed0, "placement_host_ms": round((engine.adapters.placement_ns - placed_ns0) / 1e6, 1), "stall_stacks": stalls.top(), "timeline": timeline, "reads": timeline_reads, "gc_ms": round(gc_ms, 1)}  # fmt: skip


def _staggered(engine: Engine, prompts: list[list[int]], keys: list[str], new: int, tag: str) -> None:
    """Run `prompts` arriving in waves of 1, 3, 5, 7, ... requests with a step between waves (warm-up only)."""
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    i, wave = 0, 1
    while i < len(prompts) or engine.has_unfinished():
        for j in range(i, min(i + wave, len(prompts))):
            engine.add_request(GenerationRequest(request_id=f"{tag}-{j}", input_ids=tuple(prompts[j]), adapter_key=keys[j], sampling=sp))
        i, wave = i + wave, wave + 2
        engine.step()
    engine.pop_load_events()
    engine.pop_step_records()


def _partial_admissions(engine: Engine, prompts: list[list[int]], keys: list[str], new: int, tag: str, batch: int) -> None:
    """Steps that admit most of a batch beside a few running requests, as the admission hold makes (engine.admission:
    once 3/4 of the free places' requests are ready, or all of them): `running` requests first, then 3/4 of the other
    places' worth, or all of them, one step later; each round run out before the next (warm-up only)."""
    # The mixed step is the second, the rest only drains; the running requests have more tokens left than
    # COALESCE_STEPS, or the wave would be held back until their places free (engine.admission)
    sp = SamplingParams(max_new_tokens=min(new, COALESCE_STEPS + 3), ignore_eos=True)
    n = 0
    for running in sorted(r for r in {1, 5, batch // 4 + 1, batch // 2 + 1} if r < batch):
        for wave in sorted({AdmissionHold.enough(batch - running), batch - running}):
            for size in (running, wave):
                for _ in range(size):
                    i = n % len(prompts)
                    engine.add_request(GenerationRequest(request_id=f"{tag}-{n}", input_ids=tuple(prompts[i]), adapter_key=keys[i], sampling=sp))
                    n += 1
                engine.step()
            while engine.has_unfinished():
                engine.step()
    engine.pop_load_events()
    engine.pop_step_records()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run(shape: str, counts: list[int], ranks: list[int], requests: int, batch: int, *, prompt: int = 128, new: int = 64,
        targets: tuple[str, ...] = ("q_proj", "v_proj"), gpu_bytes: int | None = None, device: str | None = None,
        root: Path | None = None, read_threads: int = READ_THREADS, read_processes: int = READ_PROCESSES,
        timeline: Path | None = None, gil_switch_s: float = GIL_SWITCH_S, synced: bool = True,
        gc_in_rounds: str = "held", load_ahead_share: float | None = 0.5, phases: bool = False) -> list[dict]:  # fmt: skip
    """The bench (module docstring): one row per count; with `timeline`, each count's passes step by step go to
    timeline/timeline_<count>.json and the cold pass's steps with prompt tokens are printed. The engine runs on this
    thread with the GIL switch interval `gil_switch_s`, as in the engine process (engine.engine_process). `synced`
    False: the device is not synchronised after each engine.step() call (`_pass`). `gc_in_rounds`: "on" or "off", the
    engine's engine.gc_in_rounds (the garbage collector's passes run while a decode round is in flight); "held" (on, with
    every full pass left to the engine's window, engine.collector `hold_full_passes`, as the engine process does).
    `load_ahead_share`: the
    engine's engine.load_ahead_share (None: placements ahead of admission unbounded)."""
    assert gc_in_rounds in ("held", "on", "off"), f"gc_in_rounds {gc_in_rounds!r}: held, on or off"
    previous = sys.getswitchinterval()
    sys.setswitchinterval(gil_switch_s)
    try:
        return _run(shape, counts, ranks, requests, batch, prompt, new, targets, gpu_bytes, device, root, read_threads, read_processes, timeline,
                    synced, gc_in_rounds, load_ahead_share, phases)  # fmt: skip
    finally:
        sys.setswitchinterval(previous)


def _run(shape, counts, ranks, requests, batch, prompt, new, targets, gpu_bytes, device, root, read_threads, read_processes,
         timeline, synced, gc_in_rounds, load_ahead_share, phases=False) -> list[dict]:  # fmt: skip
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = model_config(shape)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        paths = write_adapters(tmp / "adapters", cfg, max(counts), ranks, targets)
        # Warm-up adapters: as many distinct ones as a batch of the largest count holds, every rank among them, content
        # of their own (marked past the measured ones'), so the passes meet no kernel variant the warm-up did not.
        warm_paths = write_adapters(tmp / "warm", cfg, _warm_count(max(counts), ranks, batch), ranks, targets, first=4096 - 128)
        print(f"wrote {len(paths)} adapters in {time.perf_counter() - t0:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(4)
        prompts = torch.randint(0, cfg.vocab_size, (requests, prompt), generator=gen).tolist()
        file_bytes = sum(p.joinpath("adapter_model.safetensors").stat().st_size for p in paths)
        elem = torch.empty(0, dtype=dtype).element_size()
        rows = []
        for count in counts:
            row = _one_count(cfg, shape, count, paths[:count], warm_paths, prompts, ranks, batch, new, dev, dtype, tmp,
                             gpu_bytes, host_bytes=file_bytes * elem // 2 + (256 << 20), read_threads=read_threads, read_processes=read_processes,
                             synced=synced, gc_in_rounds=gc_in_rounds, load_ahead_share=load_ahead_share, phases=phases)  # fmt: skip
            passes = row.pop("timeline")
            if timeline is not None:
                timeline.mkdir(parents=True, exist_ok=True)
                (timeline / f"timeline_{count}.json").write_text(json.dumps({"columns": TIMELINE_COLUMNS, **passes}))
                _print_prompt_steps(count, passes["cold"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows:
        row["cold_ratio"] = round(row["cold_tok_s"] / base["cold_tok_s"], 4)
        row["warm_ratio"] = round(row["warm_tok_s"] / base["warm_tok_s"], 4)
    _print_table(rows)
    return rows


def _one_count(cfg, shape, count, paths, warm_paths, prompts, ranks, batch, new, dev, dtype, tmp, gpu_bytes, host_bytes, read_threads,
               read_processes, synced=True, gc_in_rounds="held", load_ahead_share=0.5, phases=False) -> dict:  # fmt: skip
    requests = len(prompts)
    max_rank = max(ranks)
    config = EngineConfig(
        model_dir=str(tmp), device=dev.type, max_batch_size=batch, max_prompt_tokens=len(prompts[0]), max_new_tokens=new,
        max_num_batched_tokens=batch * len(prompts[0]), kv_num_blocks=_kv_blocks(batch, len(prompts[0]) + new),
        max_loras=count + len(warm_paths), max_lora_rank=max_rank, adapter_gpu_bytes=gpu_bytes,
        enable_prefix_caching=False, adapter_loads_per_s=1e9, adapter_load_burst=10**6, warm_pool_slots=0,
        warm_pool_host_bytes=0, host_cache_bytes=host_bytes, adapter_read_threads=read_threads,
        adapter_read_processes=read_processes, gc_in_rounds=gc_in_rounds != "off", load_ahead_share=load_ahead_share,
    )  # fmt: skip
    if gpu_bytes is None:  # the bytes of 64 slots of max rank over all seven projections: what issue 19 measured with
        full = max_rank * cfg.num_layers * sum(i + o for i, o in cfg.projection_shapes().values()) * torch.empty(0, dtype=dtype).element_size()
        config = config.model_copy(update={"adapter_gpu_bytes": 64 * full})
    model = random_model(cfg, dev, dtype, seed=0)
    engine = Engine.from_model(config, model, _word_tokenizer(cfg.vocab_size), fingerprint=f"bench-{shape}")
    for p in warm_paths:
        engine.register_adapter(f"warm/{p.name}", p)
    keys = [f"t/{p.name}" for p in paths]
    for p, k in zip(paths, keys):
        engine.register_adapter(k, p)
    gen = torch.Generator().manual_seed(count)
    picks = torch.randint(0, count, (requests,), generator=gen).tolist()
    chosen = [keys[i] for i in picks]
    # Warm-up: the same requests on adapters of their own (as many distinct ones a batch as the count gives, every rank)
    # and the base, so every step shape and kernel variant the passes meet has been compiled, captured and calibrated
    # before. With two warm-up adapters of one rank, the 5-adapter cold pass compiled 13 Triton variants (about 5 s of it).
    n_warm = _warm_count(count, ranks, batch)
    warm_keys = [f"warm/{warm_paths[i % n_warm].name}" if i % 3 else None for i in range(requests)]
    # A second warm-up pass with an adapter on every request, as the measured passes have: on a machine whose Triton cache
    # was empty, the first alone left about 9 s of compiles in the 5-adapter cold pass (H200, session 9, call 1).
    every = torch.randint(0, n_warm, (requests,), generator=torch.Generator().manual_seed(count + 1)).tolist()
    with Compiles() as compiles:
        _pass(engine, prompts, warm_keys, new, f"w{count}", batch, synced)
        _pass(engine, prompts, [f"warm/{warm_paths[i].name}" for i in every], new, f"v{count}", batch, synced)
        # A third with requests arriving in waves of odd sizes: cold passes admit requests as their adapters' reads land,
        # so steps mix prompts with any number of decode rows, shapes the first two never make (H200, session 10: the
        # cold passes compiled 1-5 Triton variants, about a second each, after two full-batch warm-ups).
        # Eagerly, with the prompt steps' graphs set aside: its small prompt steps would replay graphs, and the eager
        # variants they compiled (odd row counts) came up in the cold pass's large eager steps instead (H100, session 32:
        # one compile, a 737 ms step). The graphs are all captured below.
        mixed, engine.runner.mixed = engine.runner.mixed, None
        try:
            _staggered(engine, prompts[: 4 * batch], [f"warm/{warm_paths[i].name}" for i in every[: 4 * batch]], new, f"s{count}")
        finally:
            engine.runner.mixed = mixed
        # A fourth with the steps a held admission makes (engine.admission): most of a batch admitted beside a few
        # running requests, which the waves above (small ones, into a batch filling up) do not make.
        _partial_admissions(engine, prompts, [f"warm/{warm_paths[i].name}" for i in every], new, f"p{count}", batch)
        # Then every decode bucket's graphs (and prompt steps') the passes above did not meet, calibrated on the warm-up adapters in the slots:
        # the admission hold makes decode batches of sizes no warm-up made, and a bucket's first step captured and
        # calibrated its graphs inside the cold pass (H200, session 13: one decode step of 127-159 ms at 2000 adapters).
        captured = engine.capture_decode_graphs()
        # What lives now out of the collector's walks, as the engine process does after building its engine and after
        # new decode graphs (engine.engine_process `_freeze_gc`): the adapters' records and the graphs among it
        _freeze_gc()
        held = gc_in_rounds == "held" and engine.runner.graphs is not None and hold_full_passes()  # as the engine process
        try:
            warmup_compiles = compiles.take()
            with StepPhases() if phases else contextlib.nullcontext() as watch:  # the slowest calls' phases (--phases)
                cold = _pass(engine, prompts, chosen, new, f"c{count}", batch, synced)
                cold_compiles, slow = compiles.take(), {"cold": watch.take() if watch else None}
                engine.adapters.offload()  # the host-warm pass starts with every adapter in L2 and none in L1
                warm = _pass(engine, prompts, chosen, new, f"h{count}", batch, synced)
                warm_compiles, slow["warm"] = compiles.take(), watch.take() if watch else None
        finally:
            unfreeze()  # this count's engine collectable again once dropped (the next count builds its own)
            if held:
                release_full_passes()
    host_loads = [e for e in warm["events"] + cold["events"] if e.tier == "host"]
    load_us = [e.load_us for e in host_loads]
    disk_us = [e.load_us for e in cold["events"] if e.tier == "disk"]
    nbytes = statistics.median(e.nbytes for e in host_loads) if host_loads else statistics.median(e.nbytes for e in cold["events"] or [])
    floors = {b: pinned_copy_floor_us(b, dev) for b in {e.nbytes for e in host_loads} | {int(nbytes)}}
    floor = floors[int(nbytes)]
    over = [e.load_us / floors[e.nbytes] for e in host_loads]  # each L2 load against the floor of its own bytes
    steps = [c for c in warm["calls"] + cold["calls"] if c[2]]
    with_load = [c[0] for c in steps if c[1]]
    without = [c[0] for c in steps if not c[1]]
    # the same on the device (each call's booked step µs per step): the wall figures also carry the call's host work,
    # which the bench's sync after each call exposes and a serving loop overlaps with the round it launched before
    with_load_device = [c[3] for c in steps if c[1]]
    without_device = [c[3] for c in steps if not c[1]]
    mixed = [c for c in warm["calls"] + cold["calls"] if not c[2]]  # steps with prompt tokens (admissions: where loads go)
    mixed_load = [c[0] for c in mixed if c[1]]
    mixed_plain = [c[0] for c in mixed if not c[1]]
    pool = engine.adapters
    lora = engine.runner.lora
    fits = int(lora.nbytes // nbytes) if nbytes else None
    row = {
        "count": count, "synced_calls": synced, "cold_tok_s": round(cold["tok_s"], 1), "warm_tok_s": round(warm["tok_s"], 1),
        "loads_cold": _tiers(cold["events"]), "loads_warm": _tiers(warm["events"]),
        "host_load_p50_us": _pct(load_us, 0.5), "host_load_p99_us": _pct(load_us, 0.99),
        "disk_load_p50_us": _pct(disk_us, 0.5), "disk_load_p99_us": _pct(disk_us, 0.99),
        "median_adapter_bytes": int(nbytes), "pinned_floor_us": round(floor, 1),
        "load_over_floor_p50": round(_pct(over, 0.5), 3) if over else None,
        "load_over_floor_p99": round(_pct(over, 0.99), 3) if over else None,
        "floors_us": {b: round(f, 1) for b, f in sorted(floors.items())},
        "decode_step_p99_with_load_us": _pct(with_load, 0.99), "decode_step_p50_without_us": _pct(without, 0.5),
        "decode_step_device_p99_with_load_us": _pct(with_load_device, 0.99),
        "decode_step_device_p50_without_us": _pct(without_device, 0.5),
        "decode_steps_with_load": len(with_load), "prefill_step_p99_with_load_us": _pct(mixed_load, 0.99),
        "prefill_step_p50_with_load_us": _pct(mixed_load, 0.5), "prefill_step_p50_without_load_us": _pct(mixed_plain, 0.5),
        "prefill_steps_with_load": len(mixed_load), "prefill_steps_without_load": len(mixed_plain),
        "gpu_budget_bytes": lora.nbytes, "adapters_of_median_size_in_budget": fits,
        "resident_after": pool.stats()["lora_slots_used"],
        # Triton kernels compiled in each (a pass that compiles measures the compiler; the warm-up is there to take them)
        "compiles_warmup": warmup_compiles, "compiles_cold": cold_compiles, "compiles_warm": warm_compiles,
        # the collector's passes the engine ran between rounds (engine.collector), per generation, over the warm-up and both passes
        "gc_in_rounds": gc_in_rounds, "collector_passes": list(engine.collector.passes) if engine.collector is not None else None,
        "collector_ms": round(engine.collector.ns / 1e6, 1) if engine.collector is not None else None,
        # calls that put a due full pass off to a round with room for it, and the last full pass's ms
        "collector_full_put_off": engine.collector.full_put_off if engine.collector is not None else None,
        "collector_full_ms": round(engine.collector.full_ns / 1e6, 2) if engine.collector is not None and engine.collector.full_ns else None,
        # where each pass's time went: decode-only steps (and their mean rows) against steps with prompt tokens
        "cold_s": round(cold["seconds"], 3), "warm_s": round(warm["seconds"], 3),
        "warm_decode_s": warm["decode_s"], "warm_mixed_s": warm["mixed_s"], "warm_decode_rows_mean": warm["decode_rows_mean"],
        "cold_decode_s": cold["decode_s"], "cold_mixed_s": cold["mixed_s"], "cold_decode_rows_mean": cold["decode_rows_mean"],
        # steps with prompt tokens (a batch admitted in pieces pays one each), and steps whose admissions were held back
        # while reads landed (engine.admission)
        "cold_prompt_steps": cold["prompt_steps"], "warm_prompt_steps": warm["prompt_steps"],
        "cold_admission_holds": cold["admission_holds"], "warm_admission_holds": warm["admission_holds"],
        # load-aheads that left placements to later steps, their host time past engine.load_ahead_share of the work launched
        "load_ahead_share": engine.config.load_ahead_share,
        "cold_load_ahead_cuts": cold["load_ahead_cuts"], "warm_load_ahead_cuts": warm["load_ahead_cuts"],
        # decode calls by the steps they booked (a held round is as long as the host's cycle: engine.engine `_held_steps`)
        "cold_decode_calls_by_steps": _by_steps(cold["calls"]), "warm_decode_calls_by_steps": _by_steps(warm["calls"]),
        "cold_gc_ms": cold["gc_ms"], "warm_gc_ms": warm["gc_ms"],  # the collector's pauses in each pass
        # L1 placements for requests and their host time on the engine thread (eviction choice, pages, the copies' launches)
        "cold_placements": cold["placements"], "cold_placement_host_ms": cold["placement_host_ms"],
        "warm_placements": warm["placements"], "warm_placement_host_ms": warm["placement_host_ms"],
        # the slowest decode steps with a load: wall µs against the step's own measured µs (the rest is host time the
        # step() call spent outside the measured sections), the collector's pause in it, and the pass
        "stall_stacks": {"cold": cold["stall_stacks"], "warm": warm["stall_stacks"]}, "graphs_captured_after_warmup": captured,
        "slowest_calls_phases": slow,  # with --phases: each pass's slowest step() calls by phase (instruments.StepPhases)
        "timeline": {"cold": cold["timeline"], "warm": warm["timeline"], "cold_reads": cold["reads"]},
        "slowest_decode_with_load": [{"wall_us": round(c[0]), "measured_us": round(c[3]), "gc_ms": c[4], "pass": c[5], "steps": c[6],
                                      "placed": c[7], "placing_us": c[8], "gc_longest_ms_gen": list(c[9]), "waited_us": c[10]}
                                     for c in sorted((c for c in steps if c[1]), reverse=True)[:5]],
    }  # fmt: skip
    for name, passed in (("cold", cold), ("warm", warm)):
        row.update({f"{name}_{k}": v for k, v in pass_shape(passed["timeline"], batch).items()})
    if row["decode_step_p99_with_load_us"] and row["decode_step_p50_without_us"]:
        row["load_step_ratio"] = round(row["decode_step_p99_with_load_us"] / row["decode_step_p50_without_us"], 3)
    if row["decode_step_device_p99_with_load_us"] and row["decode_step_device_p50_without_us"]:
        row["load_step_device_ratio"] = round(row["decode_step_device_p99_with_load_us"] / row["decode_step_device_p50_without_us"], 3)
    for k in ("host_load_p50_us", "host_load_p99_us", "disk_load_p50_us", "disk_load_p99_us", "decode_step_p99_with_load_us",
              "decode_step_p50_without_us", "decode_step_device_p99_with_load_us", "decode_step_device_p50_without_us",
              "prefill_step_p99_with_load_us", "prefill_step_p50_with_load_us",
              "prefill_step_p50_without_load_us"):  # fmt: skip
        if row[k] is not None:
            row[k] = round(row[k], 1)
    engine.adapters.close()
    del engine, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def pass_shape(timeline: list[list], batch: int) -> dict:
    """Where a pass's device time went, from its timeline (TIMELINE_COLUMNS rows, one a step() call): the ms at which it
    first ran a full batch (None if never), its device ms in all, and in the calls with prompt rows (what a cold pass's
    waits for reads and slower prefills add to; engine/PERF.md, session 19)."""
    col = {c: i for i, c in enumerate(TIMELINE_COLUMNS)}
    full = next((r[col["ms"]] for r in timeline if r[col["running"]] >= batch), None)
    device = sum(r[col["step_us"]] for r in timeline) / 1000
    prefill = sum(r[col["step_us"]] for r in timeline if r[col["prompt_rows"]] > 0) / 1000
    return {"full_batch_at_ms": full, "device_ms": round(device, 1), "prompt_calls_device_ms": round(prefill, 1),
            "prompt_calls": sum(1 for r in timeline if r[col["prompt_rows"]] > 0)}


def _warm_count(count: int, ranks: list[int], batch: int) -> int:
    """Distinct warm-up adapters for `count`: as many as one batch of its requests holds, and every rank."""
    return max(len(ranks), min(count, batch))


def _tiers(events) -> dict[str, int]:
    out = {"disk": 0, "host": 0}
    for e in events:
        out[e.tier] = out.get(e.tier, 0) + 1
    return out


TIMELINE_COLUMNS = ["ms", "wall_us", "step_us", "prompt_rows", "decode_rows", "running", "waiting", "reads_in_flight", "reads_landed", "reads_taken", "holds",
                    "steps", "placed", "placing_us", "waited_us"]  # fmt: skip


def _print_prompt_steps(count: int, timeline: list[tuple]) -> None:
    """The cold pass's steps with prompt tokens, and the decode steps between them summed: where admissions waited."""
    print(f"cold pass at {count} adapters, steps with prompt tokens ({' / '.join(TIMELINE_COLUMNS)}; "
          "decode steps between them: count, ms):")
    between = [0, 0.0]
    for row in timeline:
        if row[3]:
            print(f"  {' / '.join(str(v) for v in row)}   after {between[0]} decode steps, {between[1] / 1e3:.1f} ms")
            between = [0, 0.0]
        else:
            between[0] += 1
            between[1] += row[1]


def _print_table(rows: list[dict]) -> None:
    head = ("count", "cold tok/s", "ratio", "warm tok/s", "ratio", "loads c d/h", "loads w d/h", "L2 p50/p99 us", "floor us",
            "load/floor p50", "step+load p99", "step p50", "on the device", "placing us c/w", "fits")  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(v) for v in (
            r["count"], r["cold_tok_s"], r["cold_ratio"], r["warm_tok_s"], r["warm_ratio"],
            f"{r['loads_cold']['disk']}/{r['loads_cold']['host']}", f"{r['loads_warm']['disk']}/{r['loads_warm']['host']}",
            f"{r['host_load_p50_us']}/{r['host_load_p99_us']}", r["pinned_floor_us"], r["load_over_floor_p50"],
            r["decode_step_p99_with_load_us"], r["decode_step_p50_without_us"],
            f"{r['decode_step_device_p99_with_load_us']}/{r['decode_step_device_p50_without_us']}",
            f"{_per(r['cold_placement_host_ms'], r['cold_placements'])}/{_per(r['warm_placement_host_ms'], r['warm_placements'])}",
            r["adapters_of_median_size_in_budget"],
        )))  # fmt: skip
    print("count | full batch at ms, cold/warm | device ms, cold/warm | in calls with prompt rows, cold/warm (calls)")
    for r in rows:
        print(f"{r['count']} | {r['cold_full_batch_at_ms']}/{r['warm_full_batch_at_ms']} | {r['cold_device_ms']}/{r['warm_device_ms']} | "
              f"{r['cold_prompt_calls_device_ms']}/{r['warm_prompt_calls_device_ms']} ({r['cold_prompt_calls']}/{r['warm_prompt_calls']})")
    print("count | slowest decode call with a load: wall / measured µs a step, steps, pass, placements (host µs), collector "
          "ms | collector passes gen 0/1/2 (ms)")  # fmt: skip
    for r in rows:
        slow = r["slowest_decode_with_load"][0] if r["slowest_decode_with_load"] else None
        worst = "-" if slow is None else (f"{slow['wall_us']} / {slow['measured_us']}, {slow['steps']}, {slow['pass']}, "
                                          f"{slow['placed']} ({slow['placing_us']}), {slow['gc_ms']}")  # fmt: skip
        window = "off" if r["collector_passes"] is None else f"{'/'.join(map(str, r['collector_passes']))} ({r['collector_ms']})"
        print(f"{r['count']} | {worst} | {window}")


def _by_steps(calls: list[tuple]) -> dict[int, int]:
    """How many of a pass's decode calls booked each number of steps, fewest first."""
    return dict(sorted(collections.Counter(c[6] for c in calls if c[2]).items()))


def _per(ms: float, n: int) -> int | None:
    """µs per item of `ms` over `n` items (None for none)."""
    return round(ms * 1000 / n) if n else None


def parse_share(raw: str) -> float | None:
    """--load-ahead-share's value: a share above 0, at most 100, or None for "none"; ValueError naming the fix."""
    if raw.strip().lower() == "none":
        return None
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share <= 100:
        raise ValueError(f"--load-ahead-share {raw}: use a share above 0, at most 100 (0.5: half the launched work's time), or none")
    return share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench.adapters", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--counts", default="5,100,1000,2000", help="adapter counts, comma-separated; the first is the ratios' base")
    p.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled over the adapters")
    p.add_argument("--targets", default="q_proj,v_proj", help="target modules of every adapter")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--gpu-bytes", type=int, default=None, help="adapter budget (default: 64 max-rank all-projection slots' bytes)")
    p.add_argument("--device", default=None)
    p.add_argument("--read-threads", type=int, default=READ_THREADS, help="engine.adapter_read_threads: store reads run ahead on these")
    p.add_argument("--read-processes", type=int, default=READ_PROCESSES, help="engine.adapter_read_processes: ... in these processes")
    p.add_argument("--timeline", type=Path, default=None, help="a folder for each count's passes step by step (JSON)")
    p.add_argument("--gil-switch-ms", type=float, default=GIL_SWITCH_S * 1000,
                   help="sys.setswitchinterval for the run, in ms: how long the read-ahead threads wait before the engine "
                   "thread must hand them the GIL (default: the engine process's; Python's own is 5)")  # fmt: skip
    p.add_argument("--gc-in-rounds", choices=("held", "on", "off"), default="held",
                   help="engine.gc_in_rounds: the garbage collector's passes run while a decode round is in flight (on); "
                   "held (the default, as the engine process runs): on, and every full pass left to that window")
    p.add_argument("--load-ahead-share", default="0.5", metavar="SHARE|none",
                   help="engine.load_ahead_share: placements ahead of admission stop at this share of the launched work's "
                   "device time; none: unbounded (default 0.5)")
    p.add_argument("--pipelined", action="store_true",
                   help="do not synchronise the device after each engine.step() call: a call's wall time is then the interval "
                   "between call returns, as a serving loop sees it, its host work overlapped with the round in flight")  # fmt: skip
    p.add_argument("--phases", action="store_true", help="time the engine's phases in each step() call (wall and CPU) and "
                   "give each pass's slowest calls by phase in its row (slowest_calls_phases)")
    a = p.parse_args(argv)
    try:
        a.load_ahead_share = parse_share(a.load_ahead_share)
    except ValueError as e:
        p.error(str(e))
    if not 0 < a.gil_switch_ms <= 1000:
        p.error(f"--gil-switch-ms {a.gil_switch_ms}: use a number of ms above 0, at most 1000")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    run(a.shape, [int(c) for c in a.counts.split(",")], [int(r) for r in a.ranks.split(",")], a.requests, a.batch, prompt=a.prompt,
        new=a.new, targets=tuple(a.targets.split(",")), gpu_bytes=a.gpu_bytes, device=a.device, read_threads=a.read_threads,
        read_processes=a.read_processes, timeline=a.timeline, gil_switch_s=a.gil_switch_ms / 1000, synced=not a.pipelined,
        gc_in_rounds=a.gc_in_rounds, load_ahead_share=a.load_ahead_share, phases=a.phases)  # fmt: skip


if __name__ == "__main__":
    main()
