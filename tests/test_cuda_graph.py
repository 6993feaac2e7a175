"""Decode through CUDA graphs (engine.cuda_graphs): one graph per batch-size bucket serves every adapter mix.

With CUDA the graphs are captured and replayed for real; without, the same static buffers run the forward
eagerly (`capture=False`) in the Triton interpreter, which checks the buffers, the padding and the scratch
block. Either way each graphed step is compared with the eager forward of the same step, fp32, to 1e-5.
"""

from __future__ import annotations

import pickle

import dataclasses
import gc
import sys

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.demo_model import write_demo_set
from engine.engine import Engine
from engine.runner import BatchItem
from engine.async_engine import charged_us
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

TOL = 1e-5
ADAPTERS = ("qv-r4", "mlp-r64", "all-r16", "qkvo-r64-rslora")
SIZES = (1, 2, 4, 8)
LAYERS = 2  # of the demo model's 4: every kernel runs in Triton's interpreter here, at seconds a layer per step


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo model and adapters (as conftest's demo_set), written here so that this module also runs with
    `pytest --noconftest` on the GPU machine, which lacks the packages of the service fixtures conftest loads."""
    root = tmp_path_factory.mktemp("demo")
    return {"model": root / "model", "adapters": write_demo_set(root, seed=0, num_layers=LAYERS)}



def _config(demo, **kw) -> EngineConfig:
    base = dict(model_dir=str(demo["model"]), device=DEVICE.type, dtype="float32", max_prompt_tokens=24, max_new_tokens=8,
                kv_block_size=4, max_batch_size=8, kernel_backend="triton", cuda_graph_max_batch=8,
                cuda_graph_prompt_tokens=0,  # decode graphs alone: tests/test_mixed_graphs.py has the prompt steps'
                # the CPU's sizes on a GPU too (engine.sizing would give each engine most of the device's memory)
                kv_num_blocks=None, adapter_gpu_bytes=None, adapter_read_processes=0, adapter_read_threads=0)  # fmt: skip
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(demo) -> Engine:
    eng = Engine(_config(demo))
    for name in ADAPTERS:
        eng.load_adapter(name, demo["adapters"][name])
    if DEVICE.type != "cuda":  # the engine graphs CUDA only; here the same buffers, run eagerly
        r = eng.runner
        r.graphs = DecodeGraphs(r.model, r.lora, r.kv, sizes=SIZES, max_blocks=eng.config.blocks_per_sequence,
                                scratch_block=r.blocks.num_blocks, block_table=r.blocks.block_table, capture=False,
                                max_chain=eng.config.decode_steps)  # fmt: skip
    assert eng.runner.graphs is not None and eng.runner.graphs.sizes == SIZES
    return eng


@pytest.fixture(scope="module")
def short_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """As `engine`, on a 1-layer demo model: for the tests of how rounds and chains are scheduled and booked (several
    whole generations each), whose numerics the per-layer tests above already cover."""
    root = tmp_path_factory.mktemp("demo1")
    demo1 = {"model": root / "model", "adapters": write_demo_set(root, seed=0, num_layers=1)}
    eng = Engine(_config(demo1))
    for name in ADAPTERS:
        eng.load_adapter(name, demo1["adapters"][name])
    if DEVICE.type != "cuda":
        r = eng.runner
        r.graphs = DecodeGraphs(r.model, r.lora, r.kv, sizes=SIZES, max_blocks=eng.config.blocks_per_sequence,
                                scratch_block=r.blocks.num_blocks, block_table=r.blocks.block_table, capture=False,
                                max_chain=eng.config.decode_steps)  # fmt: skip
    return eng


@pytest.fixture(params=["cublas", "decode_linear",
                        pytest.param("overlap", marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="side streams need CUDA"))])
def projections(request, engine, monkeypatch):
    """Which kernel runs the graphed steps' projections: cuBLAS (+ the expand), or kernels/decode_linear.py with the
    deltas fused, which the engine takes only for shapes tuned on an H200; here every demo projection is made one; or
    cuBLAS with each shrink forked beside it on a side stream (engine.decode_lora_overlap)."""
    forks: list[int] = []
    state = engine.runner.lora
    was = state.side_stream is not None  # the engine's default
    state.overlap_decode(request.param == "overlap")
    request.addfinalizer(lambda: state.overlap_decode(was))
    if request.param == "overlap":
        fork = state.shrink_beside
        monkeypatch.setattr(state, "shrink_beside", lambda *a: forks.append(1) or fork(*a))
    if request.param == "decode_linear":
        linear = sys.modules[engine.runner.backend.decode_linear.__module__]
        cfg = engine.runner.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
                  (cfg.hidden_size, cfg.intermediate_size)]  # fmt: skip
        monkeypatch.setattr(linear, "_TUNED", {shape: ((16, 128, 4, 3), True, True) for shape in shapes})
    calls: list[bool] = []  # one per launch of decode_linear: with adapter rows or not
    lora_state = engine.runner.lora
    run = lora_state.backend.decode_linear

    def counted(x, weight, bias=None, lora=None):
        calls.append(lora is not None)
        return run(x, weight, bias, lora)

    monkeypatch.setattr(lora_state, "backend", dataclasses.replace(lora_state.backend, decode_linear=counted))
    _forget_graphs(engine.runner.graphs)  # captured again under this choice (on CUDA; the CPU runs eagerly)
    yield calls if request.param == "decode_linear" else None
    _forget_graphs(engine.runner.graphs)
    if request.param == "overlap":  # every plain projection of each captured graph with adapters forked its shrink
        assert len(forks) >= 4 * engine.runner.config.num_layers, f"{len(forks)} shrinks forked"


def _forget_graphs(graphs: DecodeGraphs) -> None:
    """Drop every captured graph and calibration; later captures go to a fresh memory pool (CUDA's allocator refuses
    a capture into a pool whose graphs are all gone)."""
    graphs._graphs.clear()
    graphs.lora_us.clear()
    if graphs.capture:
        graphs._pool = torch.cuda.graph_pool_handle()


def test_graphed_decode_equals_eager_for_every_adapter_mix(engine, projections):
    """Six sequences (four adapters of ranks 4..64, two without), prefilled eagerly, then decode steps of changing
    composition: 3 rows (bucket 4, one padding row), another 4 with another mix and other block tables (the same
    graph), 2 base-only rows (the no-LoRA graph of bucket 2), all 6 (bucket 8). Each step runs eagerly, then graphed
    on the same state: equal logits, equal K/V in every block a sequence holds, and nothing written outside them
    but the scratch block."""
    runner, graphs = engine.runner, engine.runner.graphs
    adapters = [ADAPTERS[0], ADAPTERS[1], None, ADAPTERS[2], None, ADAPTERS[3]]
    slots = [-1 if a is None else engine.adapters.acquire(a)[0] for a in adapters]
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(4, 500, (5 + 3 * i,), generator=gen).tolist() for i in range(6)]
    ids = [("g", i) for i in range(6)]
    try:
        logits = runner.forward([BatchItem(ids[i], tuple(s), 0, slots[i]) for i, s in enumerate(seqs)])
        for i in range(6):
            seqs[i].append(int(logits[i].argmax()))
        for rows, bucket, lora in (([0, 1, 2], 4, True), ([3, 4, 5, 0], 4, True), ([2, 4], 2, False), ([0, 1, 2, 3, 4, 5], 8, True)):
            items = [BatchItem(ids[i], (seqs[i][-1],), len(seqs[i]) - 1, slots[i]) for i in rows]
            assert graphs.fits(items) and graphs.bucket(len(items)) == bucket
            runner.graphs = None
            eager = runner.forward(items)
            kv_eager = [t.clone() for t in runner.kv.k + runner.kv.v]
            runner.graphs = graphs
            graphed = runner.forward(items)
            assert (bucket, lora) in graphs._graphs, (bucket, lora, list(graphs._graphs))
            err = ((graphed - eager).abs().max() / eager.abs().max()).item()
            assert graphed.shape == eager.shape and err < TOL, f"rows {rows}: graphed vs eager logits differ by {err:.2e}"
            held = sorted({b for i in range(6) for b in runner.blocks.block_table(ids[i])})
            scratch = runner.blocks.num_blocks
            free = [b for b in range(scratch) if b not in held]
            for before, after in zip(kv_eager, runner.kv.k + runner.kv.v):
                assert torch.allclose(after[held], before[held], rtol=TOL, atol=TOL)
                assert torch.equal(after[free], before[free])  # padding rows write only the scratch block
            for i in rows:
                seqs[i].append(int(graphed[rows.index(i)].argmax()))
    finally:
        for i, a in enumerate(adapters):
            runner.free(ids[i])
            if a is not None:
                engine.adapters.release(engine.adapters.sha_of(a))
    if DEVICE.type == "cuda":  # calibrated once per bucket that ran with LoRA
        assert set(graphs.lora_us) == {4, 8} and all(us >= 0 for us in graphs.lora_us.values())
    layers = engine.runner.config.num_layers
    if projections is not None:  # the graphed steps ran every projection through decode_linear: 3 steps with adapters
        assert sum(projections) >= 3 * 4 * layers, f"{sum(projections)} fused launches"  # and one base-only step
        assert len(projections) - sum(projections) >= 4 * layers, f"{len(projections) - sum(projections)} base-only launches"


def test_only_decode_steps_within_the_buckets_replay(engine):
    """Prefill chunks, batches over the largest bucket and sequences past the static block table run eagerly."""
    graphs = engine.runner.graphs
    one = BatchItem("a", (5,), 3)
    assert graphs.fits([one]) and graphs.fits([one] * 8)
    assert not graphs.fits([one] * 9)
    assert not graphs.fits([one, BatchItem("b", (5, 6), 0)])
    limit = engine.config.blocks_per_sequence * engine.config.kv_block_size
    assert graphs.fits([BatchItem("c", (5,), limit - 1)]) and not graphs.fits([BatchItem("c", (5,), limit)])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real CUDA graphs need CUDA")
def test_engine_with_graphs_generates_what_the_torch_backend_does(demo, engine):
    """fp32: twelve requests (greedy and sampled, eight adapters and none, joining over several steps) give the same
    tokens on the torch backend, eagerly, as on the triton backend with graphed decode steps; each step's shares sum
    to its measured time, and the graphed steps are charged their bucket's calibrated LoRA share."""
    ref = Engine(_config(demo, kernel_backend="torch"))
    for name in ADAPTERS:
        ref.load_adapter(name, demo["adapters"][name])
    gen = torch.Generator().manual_seed(9)
    reqs = [GenerationRequest(request_id=f"e{i}", input_ids=tuple(torch.randint(4, 500, (3 + i,), generator=gen).tolist()),
                              adapter_key=[None, *ADAPTERS][i % 5],
                              sampling=SamplingParams(max_new_tokens=6, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 3 == 2 else {})))
            for i in range(12)]  # fmt: skip
    want = ref.generate(reqs)
    engine.pop_step_records()
    got = engine.generate(reqs)
    assert all(r.ok for r in want + got), [r.error for r in want + got if not r.ok]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    records = engine.pop_step_records()
    assert all(r.base_us + r.lora_us == r.total_us and sum(s.lora_us for s in r.shares) == r.lora_us for r in records)
    # Rounds of 2 steps, each next one staged and launched while the last still runs on the device: the same tokens.
    config = engine.config
    engine.config = config.model_copy(update={"decode_steps": 2})
    try:
        rounds = engine.generate(reqs)
    finally:
        engine.config = config
    assert [r.output_ids for r in rounds] == [r.output_ids for r in want]


def _chain_requests(n: int, new: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(21)
    return [GenerationRequest(request_id=f"c{i}", input_ids=tuple(torch.randint(4, 500, (2 + i,), generator=gen).tolist()),
                              adapter_key=[None, *ADAPTERS][i % 5],
                              sampling=SamplingParams(max_new_tokens=new - (i % 3), ignore_eos=i != 0,
                                                      **({"temperature": 0.9, "seed": i} if i % 2 else {})))
            for i in range(n)]  # fmt: skip


def _eager(engine, monkeypatch) -> None:
    """Every step of `engine` eager from here (no decode rounds): the reference the rounds are held to."""
    monkeypatch.setattr(engine.runner, "can_chain", lambda items, steps: False)


def test_the_collector_runs_while_a_round_is_in_flight(short_engine, monkeypatch, caplog):
    """engine.collector's window is called right after a round is launched (in `_run`, or in step() after the next
    round's launch) and before the round in flight is read back; never where no round was launched. With the window
    due at every call it collects, the requests get the tokens they get without it, and a window that raises is
    logged, not the step's."""
    import engine.engine as engine_module
    from engine.collector import CollectorWindow

    engine = short_engine
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 4}))
    reqs = _chain_requests(5, 8)
    monkeypatch.setattr(engine, "collector", None)
    want = engine.generate(reqs)
    events: list[str] = []

    class Recorded(CollectorWindow):
        def __call__(self, until_ns=None):
            events.append("collect")
            return super().__call__(until_ns)

    window = Recorded(rise=10**9)  # due whenever the collector is on
    load_ahead, enabled = engine._load_ahead, []

    def watched(*a, **kw):  # the automatic collector held off during a round's load-ahead (the window collects after)
        enabled.append((a[0] if a else kw.get("in_flight", 0), gc.isenabled()))
        return load_ahead(*a, **kw)

    book, launch = engine_module.book_round, engine._launch_round

    def booked(rnd, fn):
        events.append("book")
        return book(rnd, fn)

    def launched(*a, **kw):
        rnd = launch(*a, **kw)
        events.append("launch")
        return rnd

    monkeypatch.setattr(engine, "collector", window)
    monkeypatch.setattr(engine_module, "book_round", booked)
    monkeypatch.setattr(engine, "_launch_round", launched)
    monkeypatch.setattr(engine, "_load_ahead", watched)
    got = engine.generate([dataclasses.replace(r, request_id=r.request_id + "-gc") for r in reqs])
    assert gc.isenabled()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert any(n > 1 for n, _ in enabled) and all(not on for n, on in enabled if n > 1), enabled  # (eager steps: 1 in flight)
    assert events.count("collect") >= 2 and sum(window.passes) >= 1, (events, window.passes)
    for i, e in enumerate(events):
        if e == "collect":
            assert i > 0 and events[i - 1] == "launch", events  # right after a launch: the GPU has work queued
            assert "book" in events[i + 1:], events  # and before the round in flight is read back
    assert events.count("collect") == events.count("launch"), events  # one window a launch, none without one

    class Broken(CollectorWindow):
        def __call__(self, until_ns=None):
            raise RuntimeError("a window failed")

    monkeypatch.setattr(engine, "collector", Broken())
    with caplog.at_level("ERROR", logger=engine_module.log.name):
        again = engine.generate([dataclasses.replace(r, request_id=r.request_id + "-x") for r in reqs])
    assert [r.output_ids for r in again] == [r.output_ids for r in want]
    assert "garbage-collector pass between rounds raised" in caplog.text


@pytest.fixture(scope="module")
def eager_chains(short_engine) -> tuple[list[GenerationRequest], int, list, int]:
    """(requests, an EOS id, their results in eager steps with that EOS honoured, how many steps those took): the
    reference of every decode_steps below, made once (the same requests, the same engine, the same tokens each time)."""
    engine = short_engine
    reqs = _chain_requests(6, 8)
    with pytest.MonkeyPatch.context() as eager:
        _eager(engine, eager)
        single = engine.generate(reqs)  # batched as the rounds are: on a GPU a batch of one rounds differently
        eos = single[0].output_ids[2]  # request 0 (greedy, EOS honoured) stops at its third token
        eager.setattr(engine, "eos_ids", (eos,))
        engine.pop_step_records()
        want = engine.generate(reqs)
        single_steps = len(engine.pop_step_records())
    return reqs, eos, want, single_steps


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_decode_chains_generate_what_single_steps_do(short_engine, eager_chains, monkeypatch, decode_steps):
    engine = short_engine
    """Decode rounds of several graph replays (config decode_steps, engine.cuda_graphs "Chains"), or of one
    (decode_steps 1), each next round launched from the last one's tokens on the device before the host reads them,
    give every request the tokens eager steps give, greedy and sampled, with max_new_tokens that differ (rounds are
    cut to the fewest tokens left) and a request stopped early by EOS (its rows after the stop are charged to it, its
    tokens dropped). Every step is its own record, its shares sum to its time, and all records together are what the
    requests are charged."""
    reqs, eos, want, single_steps = eager_chains
    monkeypatch.setattr(engine, "eos_ids", (eos,))
    engine.pop_step_records()
    assert want[0].finish_reason == "eos" and len(want[0].output_ids) <= 3

    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": decode_steps}))
    calls = []
    chain = engine.runner.decode_chain

    def counted(items, steps, *a, first_ids=None):
        calls.append((steps, first_ids is not None))
        return chain(items, steps, *a, first_ids=first_ids)

    monkeypatch.setattr(engine.runner, "decode_chain", counted)
    got = engine.generate(reqs)
    records = engine.pop_step_records()
    assert calls and max(steps for steps, _ in calls) == decode_steps, calls  # rounds of decode_steps replays ran (cut to what the requests had left)
    assert any(fed for _, fed in calls), calls  # and a round was launched from the one before, still on the device
    assert all(r.ok for r in got), [r.error for r in got if not r.ok]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert all(r.base_us + r.lora_us == r.total_us and sum(s.base_us + s.lora_us for s in r.shares) == r.total_us for r in records)
    charged = sum(r.timings.base_us + r.timings.lora_us for r in got)
    assert charged == sum(r.total_us for r in records), "every measured µs is charged to some request"
    assert len(records) <= single_steps  # the same steps, in as many host round trips or fewer
    # Request 0's rows after its EOS: at most the rest of its round and the round launched before it was read.
    rows = sum(1 for r in records if any(share.request_id == "c0" for share in r.shares))
    assert got[0].timings.steps <= rows <= got[0].timings.steps + 2 * decode_steps - 1, (rows, got[0].timings.steps)


def test_decode_rounds_run_with_a_full_batch_while_requests_wait(short_engine, monkeypatch):
    engine = short_engine
    """With the batch full (max_batch_size 8) and more requests waiting, rounds still run (nobody could join before a
    request finishes), end where the first request reaches its length, and the waiting ones are admitted then: every
    request gets the tokens of eager steps."""
    reqs = [GenerationRequest(request_id=f"f{i}", input_ids=(5 + i, 9, 11), adapter_key=[None, *ADAPTERS][i % 5],
                              sampling=SamplingParams(max_new_tokens=6 - i % 3, ignore_eos=True)) for i in range(10)]  # fmt: skip
    with monkeypatch.context() as eager:
        _eager(engine, eager)
        want = engine.generate(reqs)
    # Failed requests would compare equal (no tokens) and launch no round: say why they failed instead.
    assert all(r.ok for r in want), [r.error for r in want if not r.ok]
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 4}))
    waiting_at_launch = []
    launch = engine._launch_round

    def watched(*a, **kw):
        waiting_at_launch.append(len(engine.planner.waiting))
        return launch(*a, **kw)

    monkeypatch.setattr(engine, "_launch_round", watched)
    got = engine.generate(reqs)
    assert all(r.ok for r in got), [r.error for r in got if not r.ok]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert any(w > 0 for w in waiting_at_launch), waiting_at_launch  # rounds ran while requests waited


@pytest.mark.parametrize("held_steps", [1, 3])
def test_short_rounds_run_while_the_planner_would_admit_nobody(short_engine, monkeypatch, held_steps):
    """Requests waiting with room for them, held back (as the admission hold does while their adapters' store reads land):
    the running batch's steps are short rounds, each launched from the last one's tokens on the device before it is read
    back (engine.planner `admits_none` asked instead of a schedule): of one step after a schedule, then of what
    `_held_steps` says (the host's cycle in steps), never longer; once the hold lifts the waiting requests are admitted
    at the next schedule, and every request gets its tokens, every measured µs charged."""
    engine = short_engine
    monkeypatch.setattr(engine, "_held_steps", lambda: held_steps)
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 4}))
    engine.pop_step_records()
    first = [GenerationRequest(request_id=f"h{i}", input_ids=(6 + i, 9), adapter_key=[None, *ADAPTERS][i % 5],
                               sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(3)]  # fmt: skip
    later = [GenerationRequest(request_id=f"w{i}", input_ids=(8 + i, 3, 4), adapter_key=ADAPTERS[i % 4],
                               sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(3)]  # fmt: skip
    for r in first:
        engine.add_request(r)
    assert engine.step() == []  # their prompts
    held = {"on": True}
    planner = engine.planner
    monkeypatch.setattr(planner, "_held", lambda plan, queue, budget: held["on"])
    asked = []
    monkeypatch.setattr(planner, "admits_none", lambda: asked.append(held["on"]) or held["on"])
    calls = []
    chain = engine.runner.decode_chain

    def counted(items, steps, *a, first_ids=None):
        calls.append((steps, first_ids is not None, len(planner.waiting)))
        return chain(items, steps, *a, first_ids=first_ids)

    monkeypatch.setattr(engine.runner, "decode_chain", counted)
    for r in later:
        engine.add_request(r)
    results = []
    for _ in range(3):
        results += engine.step()
    assert calls and all(waiting == 3 for _, _, waiting in calls), calls
    assert all(steps == (held_steps if fed else 1) for steps, fed, _ in calls), calls  # (7 tokens left: 1 + 3 + 3)
    assert sum(fed for _, fed, _ in calls) >= 2 and len(asked) >= 2, (calls, asked)
    held["on"] = False
    while engine.has_unfinished():
        results += engine.step()
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in first + later)
    want = {r.request_id: r.sampling.max_new_tokens for r in first + later}
    assert all(r.ok and len(r.output_ids) == want[r.request_id] for r in results), [(r.request_id, r.error) for r in results]
    assert any(steps > 1 for steps, _, waiting in calls if waiting == 0), calls  # the hold lifted, all admitted: longer rounds
    records = engine.pop_step_records()
    assert sum(r.total_us for r in records) == sum(charged_us(r) for r in results)


def test_a_load_ahead_that_raises_loses_no_launched_step(short_engine, monkeypatch):
    """The adapter load-ahead runs after a decode round is launched (overlapped with it): when it raises, the step()
    raises, but the round stays in flight and the one before is booked, so the next step() goes on; every request
    gets its tokens and every measured µs is charged."""
    engine = short_engine
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 2}))
    engine.pop_step_records()
    reqs = [GenerationRequest(request_id=f"l{i}", input_ids=(4 + i, 7), adapter_key=[None, *ADAPTERS][i % 5],
                              sampling=SamplingParams(max_new_tokens=7, ignore_eos=True)) for i in range(3)]  # fmt: skip
    for r in reqs:
        engine.add_request(r)
    results = engine.step()  # the prompts
    load_ahead = engine._load_ahead
    failures = []

    covers = []

    def flaky(in_flight=0, finished_before=0, covers_us=0.0, until_ns=None):
        covers.append((in_flight, covers_us))
        if in_flight and len(failures) < 2:
            failures.append(engine._inflight is not None)
            raise RuntimeError("load-ahead failed")
        return load_ahead(in_flight, finished_before, covers_us, until_ns)

    monkeypatch.setattr(engine, "_load_ahead", flaky)
    raised = 0
    while engine.has_unfinished():
        try:
            results += engine.step()
        except RuntimeError:
            raised += 1
    assert raised == 2 and failures == [True, True]  # each time with the launched round kept in flight
    # a round's walk is bounded by its steps at the last decode step's measured µs (engine.load_ahead_share)
    assert any(n > 1 and c > 0 for n, c in covers) and all(c >= 0 for _, c in covers), covers
    assert sorted(r.request_id for r in results) == ["l0", "l1", "l2"]
    assert all(r.ok and len(r.output_ids) == 7 for r in results), [(r.request_id, r.error) for r in results]
    records = engine.pop_step_records()
    assert len(records) == 7 and sum(r.total_us for r in records) == sum(charged_us(r) for r in results)


def _round_in_flight(engine, monkeypatch, tag: str) -> None:
    """Three requests of 5 new tokens, prefilled, then a decode round of 4 launched and not read back."""
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 4}))
    engine.pop_step_records()
    for i in range(3):
        engine.add_request(GenerationRequest(request_id=f"{tag}{i}", input_ids=(7, 8 + i),
                                             sampling=SamplingParams(max_new_tokens=5, ignore_eos=True)))
    assert engine.step() == []  # the prefill: one token each
    assert engine.step() == []  # a round of 4 launched, not read
    assert engine._inflight is not None and engine._inflight.steps == 4


def test_popping_step_records_reads_a_round_in_flight_back(engine, monkeypatch):
    """pop_step_records() first reads back a decode round still on the device, so every step launched before the call
    is in what it returns (a worker's busy-time record covers exactly the span between two pops); the round's
    finished requests come back from the next step()."""
    _round_in_flight(engine, monkeypatch, "p")
    records = engine.pop_step_records()
    assert engine._inflight is None and len(records) == 1 + 4
    done = engine.step()
    assert sorted(r.request_id for r in done) == ["p0", "p1", "p2"] and all(len(r.output_ids) == 5 for r in done)
    assert not engine.has_unfinished()


def test_popping_without_a_drain_leaves_the_round_running_and_its_steps_come_with_its_results(engine, monkeypatch):
    """pop_step_records(drain=False), the engine process's pop after each pass: the steps booked so far, every one of
    the results handed out, while the round in flight keeps the GPU busy; its steps come with the pass that books it,
    the one that returns its finished requests. Nothing is popped twice or lost."""
    _round_in_flight(engine, monkeypatch, "q")
    first = engine.pop_step_records(drain=False)
    assert len(first) == 1, "the prefill's step alone: the round is not read back"
    assert engine._inflight is not None and engine._inflight.steps == 4
    done = engine.step()  # reads the round back: its requests finish
    assert sorted(r.request_id for r in done) == ["q0", "q1", "q2"]
    records = engine.pop_step_records(drain=False)
    assert len(records) == 4, "the round's steps, with the pass that returned its results"
    assert sum(r.total_us for r in first + records) == sum(charged_us(r) for r in done)  # every step's time, once
    assert not engine.has_unfinished() and engine.pop_step_records() == []


def test_a_result_waits_for_the_round_that_still_charges_it(short_engine, monkeypatch):
    """A request stopped by EOS in a round has a row in the next round, launched before the stop was known and charged
    to it. Popping steps after each step without a read-back (the engine process's way), every result handed out
    already carries that row, and every µs of the steps popped is in a result: nothing is billed after its result left."""
    engine = short_engine
    reqs = _chain_requests(3, 8)
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 1}))
    eos = engine.generate(reqs)[0].output_ids[2]  # request 0 (greedy, EOS honoured) stops at its third token
    monkeypatch.setattr(engine, "eos_ids", (eos,))
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 4}))
    engine.pop_step_records()
    for r in reqs:
        engine.add_request(r)
    busy = sent = 0
    results = []
    while engine.has_unfinished():
        done = engine.step()
        busy += sum(s.total_us for s in engine.pop_step_records(drain=False))
        sent += sum(charged_us(pickle.loads(pickle.dumps(r))) for r in done)  # as the engine process sends them
        results += done
        assert busy >= sent
    assert next(r for r in results if r.request_id == "c0").finish_reason == "eos"
    assert engine.pop_step_records() == [] and busy == sent, (busy, sent)
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)


def test_capturing_every_bucket_up_front_changes_no_token(short_engine):
    """Engine.capture_decode_graphs makes every bucket's two graphs at once (the with-LoRA ones on rows of the adapters in
    the slots, calibrated where graphs are captured), a second call makes none, and generation gives the same tokens as
    with graphs made at each bucket's first step."""
    graphs = short_engine.runner.graphs
    reqs = _chain_requests(6, 4)
    lazily = short_engine.generate(reqs)
    _forget_graphs(graphs)
    assert short_engine.adapters.resident_slots(), "the fixture's adapters are in slots"
    assert short_engine.capture_decode_graphs() == 2 * len(SIZES)
    assert set(graphs._graphs) == {(b, lora) for b in SIZES for lora in (False, True)}
    assert set(graphs.lora_us) == set(graphs.lora_floor_us) == (set(SIZES) if graphs.capture else set())
    assert short_engine.capture_decode_graphs() == 0
    upfront = short_engine.generate(reqs)
    assert all(r.ok for r in lazily + upfront)
    assert [r.output_ids for r in upfront] == [r.output_ids for r in lazily]


def test_a_chained_cycle_is_timed_from_its_launch_less_the_wait_for_its_round(short_engine, monkeypatch):
    """What `_held_steps` reads: each round's launch marks the cycle's start and clears the waits, step() adds the wait
    book_round reports for the round it reads back after launching the next, and the last decode step's measured µs is
    the round's; a drain or a fresh schedule ends the chain (no cycle to time)."""
    import engine.engine as engine_module

    engine = short_engine
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"decode_steps": 2}))
    book = engine_module.book_round
    monkeypatch.setattr(engine_module, "book_round", lambda rnd, fn: book(rnd, fn) * 0 + 123_456)
    for r in _chain_requests(2, 9):
        engine.add_request(r)
    engine.step()  # the prompts
    engine.step()  # a schedule: the first round launched, nothing read back
    assert engine._launched_ns is not None and engine._waited_ns == 0
    launched = engine._launched_ns
    engine.step()  # the next round launched, the first read back
    assert engine._launched_ns > launched and engine._waited_ns == 123_456 and engine._decode_us > 0
    engine.pop_step_records()  # drains the round in flight
    assert engine._launched_ns is None
    while engine.has_unfinished():
        engine.step()


def test_a_graphed_steps_lora_share_goes_from_the_one_row_floor_to_the_full_bucket(short_engine, monkeypatch):
    """A replay's LoRA µs (engine.cuda_graphs, "Timing"): none without adapter rows, the bucket's one-row calibration
    with one, its all-row one with every row, and in proportion to the adapter rows between: a step's lone adapter
    row no longer pays for a bucket calibrated on 8 of them. What the engine books is that share (capped at the step's
    total), so the shares of a step still sum to its measured time."""
    graphs = short_engine.runner.graphs
    monkeypatch.setattr(graphs, "lora_us", {8: 800})
    monkeypatch.setattr(graphs, "lora_floor_us", {8: 100})

    def items(k: int, n: int = 8) -> list[BatchItem]:
        return [BatchItem(f"s{i}", (5,), 3, lora_slot=0 if i < k else -1) for i in range(n)]

    assert [graphs.lora_share(8, items(k)) for k in range(9)] == [0, 100, 200, 300, 400, 500, 600, 700, 800]
    assert graphs.lora_share(8, items(5, n=5)) == 500  # 5 rows in bucket 8, all with adapters: by rows, not the batch
