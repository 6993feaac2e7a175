"""The engine on its Triton kernels computes what it computes on the torch reference ops, and says which it runs.

Both backends serve the same demo model in fp32 side by side: every forward below runs on each, and the
logits must agree to fp32 error (max |triton - torch| / max |torch| under 1e-4; observed ~1e-6). Without
CUDA the kernels run in Triton's interpreter (slow: the batches are small); with CUDA, compiled.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams
from engine.backend import graph_batch_sizes, pick_backend
from engine.config import EngineConfig
from engine.demo_model import write_demo_set
from engine.engine import Engine
from engine.runner import BatchItem
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

TOL = 1e-4
# (prompt token ids, adapter): mixed ranks 4..64, all four target sets, rsLoRA, and rows without an adapter
ROWS = [
    (list(range(5, 16)), "qv-r4"),
    (list(range(40, 47)), None),
    (list(range(90, 103)), "mlp-r64"),
    (list(range(7, 12)), "qkvo-r64-rslora"),
    (list(range(200, 209)), "all-r16"),
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo model and adapters (as conftest's demo_set), written here so that this module also runs with
    `pytest --noconftest` on the GPU machine, which lacks the packages of the service fixtures conftest loads."""
    root = tmp_path_factory.mktemp("demo")
    return {"model": root / "model", "adapters": write_demo_set(root, seed=0, num_layers=2)}  # 2 of 4: the interpreter's seconds a layer



def _config(demo, backend: str, **kw) -> EngineConfig:
    base = dict(model_dir=str(demo["model"]), device=DEVICE.type, dtype="float32", max_prompt_tokens=32, max_new_tokens=8,
                kv_block_size=4, max_batch_size=8, kernel_backend=backend, cuda_graph_max_batch=0,
                # the CPU's sizes on a GPU too (engine.sizing would give each engine most of the device's memory)
                kv_num_blocks=None, adapter_gpu_bytes=None, adapter_read_processes=0, adapter_read_threads=0)  # fmt: skip
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engines(demo) -> dict[str, Engine]:
    out = {}
    for backend in ("torch", "triton"):
        eng = Engine(_config(demo, backend))
        for name in {a for _, a in ROWS if a}:
            eng.load_adapter(name, demo["adapters"][name])
        out[backend] = eng
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_backends_agree_on_prefill_chunked_prefill_and_decode_in_one_batch(engines):
    """Step 0 prefills the first three rows' prompt heads (all logits compared); step 1 mixes their decodes with
    the rest of a prompt over its cached prefix and two fresh prompts; steps 2-3 are pure decode, rows without an
    adapter among them. Every row's logits agree (tests/test_engine_numerics.py shows the adapters move them by far
    more than the tolerance)."""
    slots = {name: [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in ROWS] for name, eng in engines.items()}
    seqs = [list(p) for p, _ in ROWS]
    done = [0] * len(ROWS)
    try:
        for step in range(4):
            if step == 0:
                plan = [(i, seqs[i][:-3]) for i in range(3)]  # prompt heads: a cached prefix for step 1
            else:
                plan = [(i, seqs[i][done[i] :]) for i in range(len(ROWS))]
            logits = {}
            for name, eng in engines.items():
                items = [BatchItem(("x", i), tuple(toks), done[i], slots[name][i]) for i, toks in plan]
                logits[name] = eng.runner.forward(items, all_logits=step == 0)
            err = _rel_err(logits["triton"], logits["torch"])
            assert err < TOL, f"step {step}: triton vs torch logits differ by {err:.2e} (rows {[i for i, _ in plan]})"
            for row, (i, toks) in enumerate(plan):
                done[i] += len(toks)
                if step > 0:
                    seqs[i].append(int(logits["torch"][row].argmax()))
    finally:
        _release(engines, ROWS, "x")


def test_decode_steps_rotate_inside_their_attention_launch(engines, monkeypatch):
    """A decode step (one new token a sequence) runs RoPE, the KV write and attention in one launch a layer
    (kernels.paged_attention `decode_rope_attention`); a step with prompt tokens, chunked with decode rows or not,
    keeps RoPE + KV write and then attention. Both agree with the torch backend (the test above runs the same rows)."""
    eng = engines["triton"]
    ops = eng.runner.model.ops
    calls: dict[str, int] = {"fused": 0, "rope": 0}

    def counted(name, fn):
        def call(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return call

    monkeypatch.setattr(eng.runner.model, "ops", replace(ops, decode_rope_attention=counted("fused", ops.decode_rope_attention),
                                                         rope_and_cache=counted("rope", ops.rope_and_cache)))  # fmt: skip
    layers = eng.runner.config.num_layers
    rows = ROWS[:3]
    slot = [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in rows]
    try:
        eng.runner.forward([BatchItem(("r", i), tuple(p[:-1]), 0, slot[i]) for i, (p, _) in enumerate(rows)])
        assert calls == {"fused": 0, "rope": layers}, calls
        eng.runner.forward([BatchItem(("r", i), (p[-1],), len(p) - 1, slot[i]) for i, (p, _) in enumerate(rows)])
        assert calls == {"fused": layers, "rope": layers}, "a decode step must take the one launch a layer"
        eng.runner.forward([BatchItem(("r", 0), (5,), len(rows[0][0]), slot[0]), BatchItem(("r", 9), (7, 8, 9), 0, -1)])
        assert calls == {"fused": layers, "rope": 2 * layers}, "a step with prompt tokens keeps the two kernels"
    finally:
        for i, (_, a) in enumerate(rows):
            eng.runner.free(("r", i))
            if a is not None:
                eng.adapters.release(eng.adapters.sha_of(a))
        eng.runner.free(("r", 9))


def test_decode_shrinks_split_k_into_one_zeroed_buffer(engines, monkeypatch):
    """Decode rows' shrinks add their K splits into views of one buffer zeroed once per forward (engine.lora
    `decode_t`): forced to split here (the demo's in_features would not), a decode step still matches torch."""
    shrink = sys.modules[engines["triton"].runner.backend.lora_shrink.__module__]
    monkeypatch.setattr(shrink, "_MIN_K_PER_SPLIT", 32)
    monkeypatch.setattr(shrink, "_TARGET_PROGRAMS", 10**6)
    rows = ROWS[:4]
    slots = {name: [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in rows] for name, eng in engines.items()}
    try:
        logits = {}
        for name, eng in engines.items():
            eng.runner.forward([BatchItem(("k", i), tuple(p[:-1]), 0, slots[name][i]) for i, (p, _) in enumerate(rows)])
            logits[name] = eng.runner.forward([BatchItem(("k", i), (p[-1],), len(p) - 1, slots[name][i]) for i, (p, _) in enumerate(rows)])
        assert eng.runner.lora.total_slices == 7 * eng.runner.config.num_layers
        err = _rel_err(logits["triton"], logits["torch"])
        assert err < TOL, f"split-K decode: triton vs torch logits differ by {err:.2e}"
    finally:
        _release(engines, rows, "k")


def _release(engines: dict[str, Engine], rows, tag: str) -> None:
    """Free the blocks of the runner-driven sequences (tag, i) and unpin the adapters their rows acquired."""
    for eng in engines.values():
        for i, (_, a) in enumerate(rows):
            eng.runner.free((tag, i))
            if a is not None:
                eng.adapters.release(eng.adapters.sha_of(a))


def test_backends_generate_the_same_tokens(engines):
    """Greedy and seeded sampled requests, with and without adapters, batched together: the same tokens."""
    reqs = [GenerationRequest(request_id=f"g{i}", input_ids=tuple(p), adapter_key=a,
                              sampling=SamplingParams(max_new_tokens=4, ignore_eos=True, **({"temperature": 0.9, "seed": i} if i % 2 else {})))
            for i, (p, a) in enumerate(ROWS)]  # fmt: skip
    out = {name: [r.output_ids for r in eng.generate(reqs)] for name, eng in engines.items()}
    assert out["triton"] == out["torch"]
    assert all(len(o) == 4 for o in out["torch"])


def test_the_backend_is_chosen_once_and_logged(demo, caplog):
    """auto is torch on the CPU and triton on CUDA; the start-up log names the backend and the graph setting."""
    with caplog.at_level(logging.INFO, logger="lorabatch.engine"):
        eng = Engine(_config(demo, "auto"))
    want = "triton" if DEVICE.type == "cuda" else "torch"
    assert eng.runner.backend.name == want
    lines = [r.getMessage() for r in caplog.records if r.name == "lorabatch.engine" and "engine backend" in r.getMessage()]
    assert len(lines) == 1 and f"engine backend: {want} on {DEVICE.type}" in lines[0], lines
    assert "CUDA graphs" in lines[0]


def test_triton_on_the_cpu_without_the_interpreter_is_refused():
    """A fresh process that did not set TRITON_INTERPRET: the triton backend on the CPU is an error naming the fix."""
    code = ("import torch; from engine.backend import pick_backend\n"
            "try:\n    pick_backend('triton', torch.device('cpu'))\nexcept Exception as e:\n    print(type(e).__name__, e.code, str(e))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("EngineError config_invalid") and "TRITON_INTERPRET=1" in out.stdout, out.stdout
    assert pick_backend("torch", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize(("cap", "sizes"), [(0, ()), (1, (1,)), (2, (1, 2)), (32, (1, 2, 4, 8, 16, 32)), (48, (1, 2, 4, 8, 16, 32, 48))])
def test_graph_buckets(cap, sizes):
    """Powers of two below the cap, then the cap: every batch up to it has a bucket at most twice its size."""
    assert graph_batch_sizes(cap) == sizes
    for batch in range(1, cap + 1):
        bucket = next(b for b in sizes if b >= batch)
        assert bucket < 2 * batch or bucket == 1


def test_backends_agree_with_a_biased_qkv(tmp_path):
    """Qwen2's q, k and v carry a bias: the prefill's delta-first projection (the GEMM adding into the written
    delta, then the bias) and the decode after it give the torch backend's logits, adapter rows and base rows alike."""
    adapters = write_demo_set(tmp_path, seed=2, arch="qwen2")
    names = ["all-r16", "qkvo-r64-rslora"]
    engines = {}
    for backend in ("torch", "triton"):
        eng = Engine(_config({"model": tmp_path / "model"}, backend))
        for name in names:
            eng.load_adapter(name, adapters[name])
        engines[backend] = eng
    assert engines["triton"].runner.model.model.layers[0].self_attn.qkv_proj.base.bias is not None
    rows = [(list(range(5, 14)), names[0]), (list(range(30, 36)), None), (list(range(60, 71)), names[1])]
    slots = {name: [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in rows] for name, eng in engines.items()}
    try:
        prefill, decode = {}, {}
        for name, eng in engines.items():
            prefill[name] = eng.runner.forward([BatchItem(("q", i), tuple(p), 0, slots[name][i]) for i, (p, _) in enumerate(rows)],
                                               all_logits=True)  # fmt: skip
            decode[name] = eng.runner.forward([BatchItem(("q", i), (7,), len(p), slots[name][i]) for i, (p, _) in enumerate(rows)])
        for what, got in (("prefill", prefill), ("decode", decode)):
            err = _rel_err(got["triton"], got["torch"])
            assert err < TOL, f"qwen2 {what}: triton vs torch logits differ by {err:.2e}"
    finally:
        _release(engines, rows, "q")


def test_prefill_delta_of_gate_up_goes_to_silu_mul(engines, monkeypatch):
    """A LoRA prefill's gate_up leaves its delta pending for SiLU x up (engine.lora, "Prefill"), consumed within its
    layer; a decode step takes the decode form instead (the test below); the logits still agree with the torch backend's
    (the first test of this file, same rows)."""
    runner = engines["triton"].runner
    state = runner.lora
    assert state.consumers == {"gate_up_proj"}, state.consumers
    deferred, real = [], state.base_then_pending

    def spy(base, x, w):
        assert state.pending is None, "the previous pending delta was not consumed"
        deferred.append(sum(w.slices))
        return real(base, x, w)

    monkeypatch.setattr(state, "base_then_pending", spy)
    rows = ROWS[:3]
    slot = [-1 if a is None else engines["triton"].adapters.acquire(a)[0] for _, a in rows]
    try:
        runner.forward([BatchItem(("d", i), tuple(p), 0, slot[i]) for i, (p, _) in enumerate(rows)])
        cfg = runner.config
        assert deferred == [2 * cfg.intermediate_size] * cfg.num_layers and state.pending is None
        deferred.clear()
        runner.forward([BatchItem(("d", i), (3,), len(p), slot[i]) for i, (p, _) in enumerate(rows)])
        assert deferred == [], "a decode step's rows are their own groups: not the prefill's pending form"
    finally:
        for i, (_, a) in enumerate(rows):
            runner.free(("d", i))
            if a is not None:
                engines["triton"].adapters.release(engines["triton"].adapters.sha_of(a))


@pytest.mark.parametrize("in_ops", [["qkv_proj"], ["gate_up_proj"], ["qkv_proj", "gate_up_proj"]], ids="+".join)
def test_decode_deltas_go_to_their_ops_where_asked(demo, engines, monkeypatch, in_ops):
    """With engine.decode_lora_in_ops, a decode step with adapters leaves those projections' deltas to RoPE + attention
    (qkv) and to SiLU x up (gate_up) (engine.lora, "Decode"), each consumed by the next op, the others keep their own
    expand; a step without adapters defers nothing; the logits equal, to fp32 error, those of the engine that defers
    nothing (the default)."""
    assert engines["triton"].runner.lora.decode_consumers == frozenset(), "none by default"
    eng = Engine(_config(demo, "triton", decode_lora_in_ops=in_ops))
    runner = eng.runner
    state = runner.lora
    assert state.decode_consumers == set(in_ops), state.decode_consumers
    deferred, real = [], state.base_then_decode_pending

    def spy(base, x, w, slice_offset):
        assert state.pending is None, "the previous pending delta was not consumed"
        deferred.append(w.slices)
        return real(base, x, w, slice_offset)

    monkeypatch.setattr(state, "base_then_decode_pending", spy)
    rows = ROWS[:4]
    cfg = runner.config
    widths = {"qkv_proj": (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim),
              "gate_up_proj": (cfg.intermediate_size,) * 2}  # fmt: skip
    for a in {a for _, a in rows if a}:
        eng.load_adapter(a, demo["adapters"][a])
    logits = {}
    for name, e in (("fused", eng), ("plain", engines["triton"])):  # the module's engine has them loaded
        slot = [-1 if a is None else e.adapters.acquire(a)[0] for _, a in rows]
        try:
            e.runner.forward([BatchItem(("e", i), tuple(p), 0, slot[i]) for i, (p, _) in enumerate(rows)])
            logits[name] = e.runner.forward([BatchItem(("e", i), (3,), len(p), slot[i]) for i, (p, _) in enumerate(rows)])
            e.runner.forward([BatchItem(("e", 9), (5,), 0, -1)])
            e.runner.forward([BatchItem(("e", 9), (6,), 1, -1)])
        finally:
            _release({name: e}, rows, "e")
            e.runner.free(("e", 9))
    want = [widths[p] for p in ("qkv_proj", "gate_up_proj") if p in in_ops] * cfg.num_layers
    assert deferred == want and state.pending is None, f"deferred {deferred}, want one decode step's {want}"
    err = _rel_err(logits["fused"], logits["plain"])
    assert err < TOL, f"decode deltas in their ops against their own launches: logits differ by {err:.2e}"


def test_decode_lora_in_ops_names_what_it_takes(demo):
    """A projection the option does not know is refused by the config, naming the field."""
    with pytest.raises(ValueError, match="decode_lora_in_ops"):
        _config(demo, "triton", decode_lora_in_ops=["o_proj"])


def test_a_pending_delta_reaching_another_tensor_is_refused(engines):
    """The consumer op must receive the very tensor whose delta is pending: anything else is an assertion, never a
    delta dropped or added to the wrong rows."""
    state = engines["triton"].runner.lora
    ops = engines["triton"].runner.model.ops
    y = torch.zeros(2, 2 * engines["triton"].runner.config.intermediate_size, device=DEVICE)
    state.pending = (y.clone(), None, None)
    try:
        with pytest.raises(AssertionError, match="another tensor"):
            ops.silu_mul(y)
    finally:
        state.pending = None


@pytest.mark.parametrize(("rows", "points"), [(0, []), (1, [1]), (12, [12]), (16, [16]), (17, [16, 18]), (1000, [960, 1024]),
                                             (16385, [16384, 18432])])  # fmt: skip
def test_consumer_calibration_interpolates_between_grid_points(engines, monkeypatch, rows, points):
    """The plain op's time at N rows: measured once at each of the two grid points around N (8 a power of two, so the
    scratch input is at most 1/8 larger than the step's), linear in between; N on the grid is measured as it is."""
    cal = engines["triton"].runner.lora.calibration
    measured = []

    def fake(op, n):
        measured.append(n)
        return float(n * n)  # not linear: the interpolation's weights show

    monkeypatch.setattr(cal, "_measured", fake)
    got = cal.plain_us("silu_mul", rows)
    assert sorted(set(measured)) == points
    if len(points) == 2:
        lo, hi = points
        assert got == pytest.approx(lo * lo + (hi * hi - lo * lo) * (rows - lo) / (hi - lo))
    else:
        assert got == rows * rows


def test_a_timed_section_counts_its_time_less_the_credit(monkeypatch):
    """A section with a credit counts what it measured less the credit, never below zero (engine.timing); a section
    opened by `begin` and closed by `end` counts the same. The CPU clock is a fake that advances 3 ms per reading."""
    import engine.timing as timing

    clock = iter(range(0, 10**12, 3_000_000))
    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: next(clock))
    timer = timing.DeviceTimer(torch.device("cpu"))
    with timer.section(credit_us=1e9):
        pass
    assert timer.elapsed_us() == 0
    with timer.section():
        pass
    start = timer.begin()
    timer.end(start, credit_us=1000.0)
    assert timer.elapsed_us() == 3000 + 2000



def test_a_lora_prefill_step_charges_lora_time_through_the_fused_op(engines, monkeypatch):
    """A prefill whose gate_up delta goes to SiLU x up still books LoRA time: the shrink and the fused op's excess over
    the plain op (calibrated), within the step's measured total; a huge calibrated plain time leaves the shrinks of the
    other projections alone, never a negative share."""
    eng = engines["triton"]
    # prompts no other test sends (the prefix cache would shorten the prefill), reversed for the second run
    prompts = [tuple(range(300 + 20 * i, 300 + 20 * i + len(p))) for i, (p, _) in enumerate(ROWS)]
    for tag, reverse in (("lp", False), ("lq", True)):
        if reverse:
            monkeypatch.setattr(eng.runner.lora.calibration, "plain_us", lambda op, rows: 1e12)
        reqs = [GenerationRequest(request_id=f"{tag}{i}", input_ids=p[::-1] if reverse else p, adapter_key=a,
                                  sampling=SamplingParams(max_new_tokens=1)) for i, (p, (_, a)) in enumerate(zip(prompts, ROWS))]  # fmt: skip
        eng.pop_step_records()
        assert all(r.ok for r in eng.generate(reqs))
        prefill = eng.pop_step_records()[0]
        assert prefill.tokens == sum(map(len, prompts)) and 0 < prefill.lora_us <= prefill.total_us, (tag, prefill)


def _prefill_rows(eng: Engine, rows, tag: str) -> torch.Tensor:
    """One forward of `rows` (prompt, adapter key or None) on the engine's runner, each adapter acquired for it and
    released after, and the sequences' blocks freed, whether the forward returns or raises."""
    slot = [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in rows]
    try:
        return eng.runner.forward([BatchItem((tag, i), tuple(p), 0, slot[i]) for i, (p, _) in enumerate(rows)])
    finally:
        for i, (_, a) in enumerate(rows):
            eng.runner.free((tag, i))
            if a is not None:
                eng.adapters.release(eng.adapters.sha_of(a))


def test_a_lora_prefill_times_three_sections_a_layer_silu_and_down_in_one(engines, monkeypatch):
    """Delta-first prefill: qkv's and o's LoRA are a section each, and the section opened by gate_up's shrink runs on
    through SiLU x up into the down projection's delta (nothing runs between them), credited once with the plain op's
    time; so a layer records three sections, not four, and every section opened is closed within the forward."""
    eng = engines["triton"]
    timer = eng.runner.lora.timer
    begun, ended = [], []
    real_begin, real_end = timer.begin, timer.end
    monkeypatch.setattr(timer, "begin", lambda: begun.append(real_begin()) or begun[-1])
    monkeypatch.setattr(timer, "end", lambda start, credit_us=0.0: (ended.append((start, credit_us)), real_end(start, credit_us))[1])
    monkeypatch.setattr(eng.runner.lora.calibration, "plain_us", lambda op, rows: 7.0)
    _prefill_rows(eng, ROWS[:3], "s")
    layers = eng.runner.config.num_layers
    assert len(begun) == len(ended) == 3 * layers, (len(begun), len(ended))
    assert [s for s, _ in ended] == begun, "a section closed that was not the last one opened"
    assert [c for _, c in ended] == [0.0, 0.0, 7.0] * layers


def test_a_consumer_section_left_open_is_closed_by_the_next_batch(engines):
    """A forward that stops between SiLU x up and the down projection leaves its carried section open; setting the next
    batch closes it (counted up to there), so no section of one step reaches into the next."""
    state = engines["triton"].runner.lora
    state.timer.reset()
    state._carry = (state.timer.begin(), 0.0)
    state.set_batch()
    assert state._carry is None and state.timer.elapsed_us() >= 0
    assert len(state.timer._events) == (1 if state.timer._cuda else 0)
    state.timer.reset()


def test_a_forward_that_raises_leaves_no_pending_delta(engines, monkeypatch):
    """A prefill that fails after gate_up deferred its delta (here SiLU x up raises) leaves nothing pending: the next
    batch runs and agrees with the torch backend, so one failed step cannot wedge the engine."""
    eng = engines["triton"]
    ops = eng.runner.model.ops

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng.runner.model, "ops", replace(ops, silu_mul=broken))
    with pytest.raises(RuntimeError, match="boom"):
        _prefill_rows(eng, ROWS[:2], "r")
    assert eng.runner.lora.pending is None
    monkeypatch.setattr(eng.runner.model, "ops", ops)
    test_backends_agree_on_prefill_chunked_prefill_and_decode_in_one_batch(engines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_the_device_timer_records_its_events_again_on_the_current_stream():
    """DeviceTimer keeps its events from step to step (`reset` hands them back) and records each on the stream current
    at the time: a section on a side stream times the work of that stream."""
    from engine.timing import DeviceTimer

    timer = DeviceTimer(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    pools = []
    for _ in range(3):
        timer.reset()
        with timer.section():
            x @ x
        start = timer.begin()
        x @ x
        timer.end(start)
        assert timer.elapsed_us() > 0
        pools.append([id(e) for e in timer._pool])
    assert pools[0] == pools[1] == pools[2] and len(pools[0]) == 4
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        timer.reset()
        with timer.section():
            for _ in range(20):
                x @ x
    side.synchronize()
    assert timer._stream.stream_id == side.stream_id and timer.elapsed_us() > 0
