"""`lorabatch bench engine`: decode and prefill speed of the engine, base-only and with many adapters.

One run builds a random-weight model of the chosen shape directly on the device (no checkpoint is read:
an 8B model would take minutes to write and read), writes N random PEFT adapters of rank R on all seven
projections (the engine loads them through its real path: files, validation, L2, slots), and measures:

- ours, base: B requests without adapters, prompt P, T new tokens (EOS ignored); the first step is the
  prefill of all B prompts, the others are decode steps of B rows.
- ours, mixed: the same with the B rows spread over N distinct adapters (row i uses adapter i mod N).
- with `mixed_ranks` (e.g. 8,16,32,64, cycled over the N adapters, used by the mixed run): also a batch over
  N more adapters all at the mean rank of the batch's adapters (30 for 8/16/32/64: the same bytes), and
  the ratio of the two steps (S-LoRA's heterogeneity cost; issue 4's target is at most 1.1x).
- the peer (HF transformers + peft `generate` with `adapter_names=`, when importable), on the very same
  weights and batch; its decode time is generate(T) - generate(1).
- the memory roofline of a decode step: the bytes it must read (base weights, the distinct adapters of
  the batch at their own rank, the KV of every row at its mean context P + T/2) over the copy bandwidth
  measured on the device (a device-to-device copy on CUDA, a large memcpy on CPU); and the matmul rate
  (an 8192^3 product in the model's dtype on random data) that the prefill's FLOP rate is set against.

Step times: `step_ms` is the decode phase's wall time (scheduling, forward, sampling, bookkeeping) over its
steps, engine.step() called back to back as a serving loop does; a call runs up to engine.config
decode_steps steps back to back (engine.cuda_graphs "Chains") and launches the next round before it
reads the last (engine.engine); `decode_rounds` counts the calls, and `*_one_per_round` are the same
batches with decode_steps 1; tokens/s is B x decode steps / their wall time;
`device_step_ms` is the engine's own measurement of the same steps (CUDA events around the
forward and sampling, engine.timing), so the gap between the two is host time the GPU waits for;
`decode_first_call_ms` (the host's time before the first round is launched, the GPU idle) and
`decode_last_call_ms` (the wait for the last round and its bookkeeping) say where.
prefill_tflops counts the matmul and attention FLOPs of the base prefill step over its wall time;
prefill_lora_overhead_pct is the mixed prefill step's extra time over the base one; both from the medians of
PREFILL_SAMPLES prefills each (base and mixed interleaved), `prefill_lora_overhead_pct_range` the share of each
pair. It prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.api import GenerationRequest, SamplingParams
from engine.bench.build import SHAPES, build_bench_engine, model_config, sync
from engine.bench.peer import run_peer
from engine.bench.roofline import adapter_bytes, kv_bytes, measure_bandwidth, measure_matmul, prefill_flops, weight_bytes
from engine.device import pick_device, pick_dtype
from engine.engine import Engine

PREFILL_SAMPLES = 11  # prefill steps timed per run (base and mixed each); the figures are their medians


def bench_engine(
    shape: str = "tiny",
    adapters: int = 8,
    rank: int = 16,
    batch: int = 8,
    prompt: int = 32,
    new: int = 16,
    mixed_ranks: str | None = None,
    peer: bool = False,
    device: str = "auto",
    json_only: bool = False,
    peer_new: int | None = None,
    kernel_backend: str = "auto",
    weight_dtype: str = "auto",
    decode_lora_in_ops: tuple[str, ...] = (),
    decode_lora_overlap: bool = True,
) -> dict:
    """Run the bench of the module docstring; print a table (unless json_only), then one JSON line; return the figures.
    `peer_new`: new tokens of the peer's runs (default `new`); `kernel_backend`: the engine's (engine.backend);
    `weight_dtype` "fp8": the projections in FP8 (engine.quant; the roofline counts their bytes); `decode_lora_in_ops`:
    the engine's engine.decode_lora_in_ops (decode deltas added by the ops that read qkv and gate_up);
    `decode_lora_overlap`: its engine.decode_lora_overlap (graphed decode shrinks beside their GEMMs)."""
    assert shape in SHAPES, f"shape {shape!r}: use one of {sorted(SHAPES)}"
    assert adapters >= 1 and batch >= 1 and prompt >= 1 and new >= 2, (adapters, batch, prompt, new)
    dev = pick_device(device)
    dtype = pick_dtype("auto", dev)
    cfg = model_config(shape)
    ranks = [int(r) for r in mixed_ranks.split(",")] if mixed_ranks else [rank]
    adapter_ranks = [ranks[i % len(ranks)] for i in range(adapters)]
    # mixed ranks: the same batch over as many adapters all of their mean rank, for the heterogeneity ratio
    uniform_rank = round(statistics.mean(adapter_ranks[: min(adapters, batch)])) if mixed_ranks else None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    out: dict = {"shape": shape, "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "weight_dtype": weight_dtype, "adapters": adapters,
                 "ranks": sorted(set(adapter_ranks)), "batch": batch, "prompt": prompt, "new": new,
                 "decode_lora_in_ops": list(decode_lora_in_ops), "decode_lora_overlap": decode_lora_overlap}  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        engine, paths = build_bench_engine(cfg, shape, adapter_ranks, uniform_rank, batch, prompt, new, dev, dtype, Path(tmp), kernel_backend,
                                           weight_dtype, tuple(decode_lora_in_ops), decode_lora_overlap)  # fmt: skip
        runs = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
        if uniform_rank is not None:
            runs["uniform"] = [f"u{i % adapters}" for i in range(batch)]
        for keys in runs.values():  # first-call costs (kernels, graph captures, allocator) at the measured shapes
            _run(engine, prompts, keys, min(3, new), "warm")
        got = {name: _run(engine, prompts, keys, new, name) for name, keys in runs.items()}
        base, mixed = got["base"], got["mixed"]
        chained = engine.config.decode_steps
        engine.config = engine.config.model_copy(update={"decode_steps": 1})  # the same batches, one step per round
        single = {name: _run(engine, prompts, runs[name], new, f"{name}-single") for name in ("base", "mixed")}
        engine.config = engine.config.model_copy(update={"decode_steps": chained})
        # The prefill is one ~0.02-0.4 s step, and one sample of it varied by several % between runs (8b LoRA share
        # +9.7% in one, +13.4% in another; pairs of one run from +5.8% to +13.9%): its figures are medians of
        # PREFILL_SAMPLES samples, base and mixed interleaved.
        samples: dict[str, list[dict]] = {"base": [base, single["base"]], "mixed": [mixed, single["mixed"]]}
        for i in range(PREFILL_SAMPLES - 2):
            for name in ("base", "mixed"):
                samples[name].append(_run(engine, prompts, runs[name], 2, f"{name}-prefill{i}"))
        prefill = {name: {key: statistics.median(r[key] for r in rs) for key in ("prefill_ms", "prefill_device_ms")}
                   for name, rs in samples.items()}  # fmt: skip
        bandwidth = measure_bandwidth(dev)
        matmul = measure_matmul(dev, dtype)
        flops = prefill_flops(cfg, batch, prompt)
        out.update(
            backend=engine.runner.backend.name, cuda_graphs=engine.runner.graphs is not None,
            ours_base_tok_s=base["tok_s"], ours_mixed_tok_s=mixed["tok_s"],
            base_step_ms=base["step_ms"], mixed_step_ms=mixed["step_ms"], decode_rounds=base["decode_rounds"],
            decode_first_call_ms=base["first_call_ms"], decode_last_call_ms=base["last_call_ms"],
            decode_steps=chained, base_step_ms_one_per_round=single["base"]["step_ms"],
            mixed_step_ms_one_per_round=single["mixed"]["step_ms"],
            base_device_step_ms=base["device_step_ms"], mixed_device_step_ms=mixed["device_step_ms"],
            prefill_ms=prefill["base"]["prefill_ms"], mixed_prefill_ms=prefill["mixed"]["prefill_ms"],
            prefill_device_ms=prefill["base"]["prefill_device_ms"], mixed_prefill_device_ms=prefill["mixed"]["prefill_device_ms"],
            prefill_samples=PREFILL_SAMPLES,
            prefill_lora_overhead_pct_range=[round(100 * (m["prefill_ms"] / b["prefill_ms"] - 1), 2)
                                             for b, m in zip(samples["base"], samples["mixed"])],
            prefill_tflops=flops / (prefill["base"]["prefill_ms"] / 1e3) / 1e12,
            mixed_prefill_tflops=flops / (prefill["mixed"]["prefill_ms"] / 1e3) / 1e12,
            prefill_lora_overhead_pct=100 * (prefill["mixed"]["prefill_ms"] / prefill["base"]["prefill_ms"] - 1),
            matmul_tflops=matmul / 1e12, prefill_matmul_pct=100 * flops / (prefill["base"]["prefill_ms"] / 1e3) / matmul,
            copy_bandwidth_gb_s=bandwidth / 1e9,
        )  # fmt: skip
        context = prompt + new / 2
        elem = torch.tensor([], dtype=dtype).element_size()
        distinct = adapter_ranks[: min(adapters, batch)]
        base_bytes = weight_bytes(engine.runner.model) + kv_bytes(cfg, batch, context, elem)
        mixed_bytes = base_bytes + sum(adapter_bytes(cfg, r, elem) for r in distinct)
        out.update(base_roofline_ms=base_bytes / bandwidth * 1e3, mixed_roofline_ms=mixed_bytes / bandwidth * 1e3)
        out.update(base_x_roofline=out["base_step_ms"] / out["base_roofline_ms"],
                   mixed_x_roofline=out["mixed_step_ms"] / out["mixed_roofline_ms"])  # fmt: skip
        if uniform_rank is not None:
            uniform = got["uniform"]
            out.update(
                uniform_rank=uniform_rank, uniform_step_ms=uniform["step_ms"], uniform_device_step_ms=uniform["device_step_ms"],
                mixed_ranks_ratio=mixed["step_ms"] / uniform["step_ms"],
                # the LoRA part alone: what each batch adds to the base-only step
                mixed_ranks_lora_ratio=_ratio(mixed["device_step_ms"] - base["device_step_ms"], uniform["device_step_ms"] - base["device_step_ms"]),
            )  # fmt: skip
        out["peer_base_tok_s"] = out["peer_mixed_tok_s"] = None
        if peer:
            out["peer_new"] = peer_new or new
            out.update(run_peer(engine.runner.model, cfg, paths[:adapters], adapter_ranks, prompts, peer_new or new, dev, dtype))
            if out["peer_mixed_tok_s"]:
                out["mixed_vs_peer"] = out["ours_mixed_tok_s"] / out["peer_mixed_tok_s"]
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    if not json_only:
        _print_table(out)
    print(json.dumps(out), flush=True)
    return out


def _run(engine: Engine, prompts: list[list[int]], adapters: list[str | None], new: int, tag: str) -> dict:
    """Prefill of every prompt in one step (wall time, the device synchronised around it), then new - 1 decode
    steps: their wall time from the end of the prefill to the device's end of the last one, as a serving loop
    runs them (engine.step() calls back to back; a call may run several steps, engine.config decode_steps,
    and launch the next round before reading the last, engine.engine), over the steps; and the engine's own
    device time per step (CUDA events, its step records)."""
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}-{a}", input_ids=tuple(p), adapter_key=a, sampling=sp))
    engine.pop_step_records()
    sync(engine.device)
    t0 = time.perf_counter()
    results = engine.step()
    sync(engine.device)
    t1 = time.perf_counter()
    calls, first_call_s, last_call_s = 0, 0.0, 0.0
    while engine.has_unfinished():
        c0 = time.perf_counter()
        results += engine.step()
        last_call_s = time.perf_counter() - c0
        first_call_s = first_call_s or last_call_s
        calls += 1
    sync(engine.device)
    t2 = time.perf_counter()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    records = engine.pop_step_records()
    engine.pop_load_events()
    assert records[0].tokens == sum(map(len, prompts)), "the prefill must be one step"
    decode_steps = len(records) - 1
    assert decode_steps == new - 1, (decode_steps, new)
    return {
        "prefill_ms": (t1 - t0) * 1e3,
        "prefill_device_ms": records[0].total_us / 1e3,
        "step_ms": (t2 - t1) / decode_steps * 1e3,
        "device_step_ms": statistics.median(r.total_us for r in records[1:]) / 1e3,
        "tok_s": len(prompts) * decode_steps / (t2 - t1),
        "decode_rounds": calls,
        "first_call_ms": first_call_s * 1e3,  # host time before the first decode round is launched: the GPU idles
        "last_call_ms": last_call_s * 1e3,  # the wait for the last round and its bookkeeping
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _print_table(out: dict) -> None:
    def f(v: object) -> str:
        return "-" if v is None else f"{v:,.2f}" if isinstance(v, float) else str(v)

    print(f"engine bench: {out['shape']} on {out['device']} ({out['dtype']}, {out['backend']}, graphs {out['cuda_graphs']}), "
          f"batch {out['batch']}, prompt {out['prompt']}, new {out['new']}, {out['adapters']} adapters of rank {out['ranks']}")  # fmt: skip
    print(f"{'':<14}{'tok/s':>12}{'step ms':>10}{'device ms':>11}{'roofline ms':>13}{'x roof':>8}{'prefill ms':>12}")
    for name in ("base", "mixed"):
        print(f"{'ours ' + name:<14}{f(out[f'ours_{name}_tok_s']):>12}{f(out[f'{name}_step_ms']):>10}{f(out[f'{name}_device_step_ms']):>11}"
              f"{f(out[f'{name}_roofline_ms']):>13}{f(out[f'{name}_x_roofline']):>8}{f(out['prefill_ms' if name == 'base' else 'mixed_prefill_ms']):>12}")  # fmt: skip
    if "uniform_rank" in out:
        print(f"{'uniform r' + str(out['uniform_rank']):<14}{'':>12}{f(out['uniform_step_ms']):>10}{f(out['uniform_device_step_ms']):>11}"
              f"   mixed / uniform: step {f(out['mixed_ranks_ratio'])}, LoRA part {f(out['mixed_ranks_lora_ratio'])}")  # fmt: skip
    print(f"{'one step/round':<14}{'':>12}{f(out['base_step_ms_one_per_round']):>10}  base, {f(out['mixed_step_ms_one_per_round'])} mixed "
          f"(decode_steps 1; above: {out['decode_steps']}, {out['decode_rounds']} rounds)")  # fmt: skip
    print(f"{'peer base':<14}{f(out['peer_base_tok_s']):>12}")
    print(f"{'peer mixed':<14}{f(out['peer_mixed_tok_s']):>12}" + (f"   ours mixed / peer mixed: {out['mixed_vs_peer']:,.1f}x" if out.get("mixed_vs_peer") else ""))
    print(f"prefill {out['prefill_tflops']:.2f} TFLOP/s ({out['prefill_matmul_pct']:.1f}% of the {out['matmul_tflops']:.1f} TFLOP/s matmul), "
          f"LoRA +{out['prefill_lora_overhead_pct']:.1f}% (median of {out['prefill_samples']}; each pair: "
          f"{', '.join(f'{v:+.1f}%' for v in out['prefill_lora_overhead_pct_range'])}); copy bandwidth {out['copy_bandwidth_gb_s']:.1f} GB/s")  # fmt: skip


def ab_prefill_consumers(shape: str = "llama-1b", adapters: int = 32, rank: int = 16, batch: int = 32, prompt: int = 128,
                         pairs: int = PREFILL_SAMPLES) -> dict:  # fmt: skip
    """A/B of gate_up's delta in SiLU x up (engine.lora "Prefill") against the delta-first order, in one process on one
    engine: base, mixed with it and mixed without it, interleaved `pairs` times; medians of the prefill's wall and
    device ms and each form's LoRA share (python -c "from engine.bench.serving import ab_prefill_consumers as f; f('llama-1b')";
    prompt 512 for llama-8b, as the issue's prefill)."""
    dev = pick_device("auto")
    cfg = model_config(shape)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist() for _ in range(batch)]
    keys = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_bench_engine(cfg, shape, [rank] * adapters, None, batch, prompt, 2, dev, pick_dtype("auto", dev), Path(tmp))
        state = engine.runner.lora
        consumers = state.consumers
        runs: dict[str, list[dict]] = {"base": [], "in the op": [], "delta first": []}
        for i in range(pairs + 1):  # the first round warms up
            for name in runs:
                state.consumers = consumers if name == "in the op" else frozenset()
                got = _run(engine, prompts, keys["base" if name == "base" else "mixed"], 2, f"ab{i}-{name}")
                if i:
                    runs[name].append(got)
        state.consumers = consumers
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("prefill_ms", "prefill_device_ms")} for name, rs in runs.items()}
    out = {"shape": shape, "pairs": pairs, **{f"{name} {k}": round(v, 3) for name, m in med.items() for k, v in m.items()}}
    for name in ("in the op", "delta first"):
        out[f"{name} lora_pct"] = round(100 * (med[name]["prefill_ms"] / med["base"]["prefill_ms"] - 1), 2)
        out[f"{name} lora_pct_device"] = round(100 * (med[name]["prefill_device_ms"] / med["base"]["prefill_device_ms"] - 1), 2)
    print(json.dumps(out), flush=True)
    return out
