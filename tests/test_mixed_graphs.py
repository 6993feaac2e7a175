"""Steps with prompt tokens through CUDA graphs (engine.mixed_graphs): prompts beside decode rows, one graph per bucket.

With CUDA the graphs are captured and replayed for real; without, the same static buffers run the forward eagerly
(`capture=False`) in the Triton interpreter, which checks the staging, the padding rows and items, and the scratch
block. Each graphed step is compared with the eager forward of the same step, fp32, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.demo_model import write_demo_set
from engine.engine import Engine
from engine.mixed_graphs import MixedGraphs, query_bucket, token_buckets
from engine.runner import BatchItem
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

TOL = 1e-5
ADAPTERS = ("qv-r4", "mlp-r64", "all-r16", "qkvo-r64-rslora")
BATCH, TOKENS = 8, 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A 1-layer demo engine whose runner has both kinds of graphs (uncaptured static buffers on the CPU)."""
    root = tmp_path_factory.mktemp("demo")
    adapters = write_demo_set(root, seed=0, num_layers=1)
    config = EngineConfig(model_dir=str(root / "model"), device=DEVICE.type, dtype="float32", max_prompt_tokens=24,
                          max_new_tokens=8, kv_block_size=4, max_batch_size=BATCH, kernel_backend="triton",
                          cuda_graph_max_batch=BATCH, cuda_graph_prompt_tokens=TOKENS, max_num_batched_tokens=TOKENS,
                          kv_num_blocks=None, adapter_gpu_bytes=None, adapter_read_processes=0, adapter_read_threads=0)  # fmt: skip
    eng = Engine(config)
    for name in ADAPTERS:
        eng.load_adapter(name, adapters[name])
    r = eng.runner
    if DEVICE.type != "cuda":  # the engine graphs CUDA only; here the same buffers, run eagerly
        r.graphs = DecodeGraphs(r.model, r.lora, r.kv, sizes=(1, 2, 4, 8), max_blocks=config.blocks_per_sequence,
                                scratch_block=r.blocks.num_blocks, block_table=r.blocks.block_table, capture=False)  # fmt: skip
        r.mixed = MixedGraphs(r.model, r.lora, r.kv, batch=BATCH, max_tokens=TOKENS, max_blocks=config.blocks_per_sequence,
                              scratch_block=r.blocks.num_blocks, block_table=r.blocks.block_table, capture=False)  # fmt: skip
    assert r.mixed is not None and r.mixed.tokens == (TOKENS,)
    return eng


def test_buckets():
    assert token_buckets(2048) == (64, 128, 256, 512, 1024, 2048)
    assert token_buckets(3000) == (64, 128, 256, 512, 1024, 2048, 3000)
    assert token_buckets(40) == (40,)
    assert [query_bucket(q, 2048) for q in (2, 16, 17, 64, 65, 256, 300, 1024, 1025)] == [16, 16, 64, 64, 256, 256, 1024, 1024, 2048]
    assert query_bucket(100, 64) == 64  # never past the step's own token bucket


def test_only_steps_with_prompt_tokens_within_the_bounds_replay(engine):
    mixed = engine.runner.mixed
    decode = BatchItem("d", (5,), 3)
    prompt = BatchItem("p", tuple(range(4, 14)), 0)
    assert not mixed.fits([decode] * 3), "a decode step is the decode graphs'"
    assert mixed.fits([prompt, decode]) and mixed.fits([prompt] * 6)  # 60 tokens
    assert not mixed.fits([prompt] * 7), "70 tokens, past the largest bucket"
    assert not mixed.fits([prompt] + [decode] * BATCH), "more items than places"
    limit = engine.config.blocks_per_sequence * engine.config.kv_block_size
    assert mixed.fits([prompt, BatchItem("c", (5, 6), limit - 2)]) and not mixed.fits([prompt, BatchItem("c", (5, 6), limit - 1)])
    assert mixed.key([prompt, decode]) == (64, 16, False)
    assert mixed.key([BatchItem("q", tuple(range(4, 24)), 0, lora_slot=0), decode]) == (64, 64, True)


def test_graphed_mixed_steps_equal_eager_ones(engine):
    """Six sequences (four adapters of ranks 4..64, two without): prompts prefilled in steps of changing composition
    (a prompt alone, prompts beside decode rows, a base-only one, a prompt's second chunk without logits), each step
    run eagerly and then graphed on the same state: equal logits, equal K/V in every block a sequence holds, and nothing
    written outside them but the scratch block."""
    runner, mixed = engine.runner, engine.runner.mixed
    adapters = [ADAPTERS[0], ADAPTERS[1], None, ADAPTERS[2], None, ADAPTERS[3]]
    slots = [-1 if a is None else engine.adapters.acquire(a)[0] for a in adapters]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 500, (5 + 3 * i,), generator=gen).tolist() for i in range(6)]
    ids = [("m", i) for i in range(6)]
    done = [0] * 6  # tokens of each sequence in the cache
    seqs = [list(p) for p in prompts]

    def item(i: int, n: int | None = None, logits: bool = True) -> BatchItem:
        new = seqs[i][done[i] : done[i] + n] if n is not None else seqs[i][done[i] :]
        return BatchItem(ids[i], tuple(new), done[i], slots[i], logits)

    steps = [  # (items, expected bucket)
        (lambda: [item(0)], (64, 16, True)),
        (lambda: [item(1), item(0)], (64, 16, True)),  # a prompt beside a decode row
        (lambda: [item(2), item(4)], (64, 64, False)),  # 11 and 17 tokens: base-only
        (lambda: [item(5, 8, logits=False), item(3), item(1), item(2)], (64, 16, True)),  # a chunk of 8 of 20
        (lambda: [item(5), item(0), item(1), item(2), item(3), item(4)], (64, 16, True)),  # its rest beside 5 decode rows
    ]
    try:
        for make, bucket in steps:
            items = make()
            assert mixed.fits(items) and mixed.key(items) == bucket, (mixed.key(items), bucket)
            keep = runner.mixed
            runner.mixed = None
            eager = runner.forward(items)
            kv_eager = [t.clone() for t in runner.kv.k + runner.kv.v]
            runner.mixed = keep
            graphed = runner.forward(items)
            assert bucket in mixed._graphs, (bucket, list(mixed._graphs))
            err = ((graphed - eager).abs().max() / eager.abs().max()).item()
            assert graphed.shape == eager.shape and err < TOL, f"graphed vs eager logits differ by {err:.2e}"
            held = sorted({b for i in range(6) if ids[i] in runner.blocks for b in runner.blocks.block_table(ids[i])})
            free = [b for b in range(runner.blocks.num_blocks) if b not in held]
            for before, after in zip(kv_eager, runner.kv.k + runner.kv.v):
                assert torch.allclose(after[held], before[held], rtol=TOL, atol=TOL)
                assert torch.equal(after[free], before[free])  # padding rows write only the scratch block
            row = 0
            for it in items:
                i = int(it.seq_id[1])
                done[i] += len(it.token_ids)
                if it.logits:
                    seqs[i].append(int(graphed[row].argmax()))
                    row += 1
    finally:
        for i, a in enumerate(adapters):
            if ids[i] in runner.blocks:
                runner.free(ids[i])
            if a is not None:
                engine.adapters.release(engine.adapters.sha_of(a))
    if DEVICE.type == "cuda":  # calibrated once per bucket that ran with LoRA
        assert set(mixed.lora_us) == {(64, 16)} and mixed.lora_us[(64, 16)] >= 0


def _requests(n: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        ids = torch.randint(4, 500, (3 + 2 * i,), generator=gen).tolist()
        out.append(GenerationRequest(request_id=f"r{i}", input_ids=tuple(ids), adapter_key=ADAPTERS[i % 4] if i % 3 else None,
                                     sampling=SamplingParams(max_new_tokens=4 + i % 3, ignore_eos=True)))  # fmt: skip
    return out


def test_generation_with_graphed_prompt_steps_gives_the_eager_tokens(engine):
    """Nine requests (adapters and none, prompts of 3-19 tokens) joining as places free: the same tokens with steps with
    prompt tokens replayed as without, and every step's booked shares sum to its measured total."""
    runner = engine.runner
    used: list[tuple] = []
    run = runner.mixed.run
    runner.mixed.run = lambda items, rows: used.append(runner.mixed.key(items)) or run(items, rows)  # type: ignore[method-assign]
    try:
        graphed = engine.generate(_requests(9))
    finally:
        del runner.mixed.run
    keep, runner.mixed = runner.mixed, None
    try:
        eager = engine.generate(_requests(9))
    finally:
        runner.mixed = keep
    assert used, "no step replayed a prompt graph"
    assert all(r.ok for r in graphed + eager)
    assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
    for rec in engine.pop_step_records():
        assert rec.base_us + rec.lora_us == rec.total_us
        assert sum(s.base_us for s in rec.shares) == rec.base_us and sum(s.lora_us for s in rec.shares) == rec.lora_us


def test_capturing_every_bucket_up_front_writes_only_the_scratch_block(engine):
    """prepare_all makes each (tokens, longest prompt) pair's graphs, with and without the adapters in the slots, on
    synthetic rows in the scratch block; a second call makes none."""
    runner, mixed = engine.runner, engine.runner.mixed
    kept = dict(mixed._graphs)
    mixed._graphs.clear()
    before = [t.clone() for t in runner.kv.k + runner.kv.v]
    slots = engine.adapters.resident_slots()
    assert slots
    made = runner.capture_graphs(slots)
    pairs = {(64, 16), (64, 64)}
    assert set(mixed._graphs) == {(t, q, lora) for t, q in pairs for lora in (False, True)}
    assert made >= 2 * len(pairs) and runner.capture_graphs(slots) == 0
    scratch = runner.blocks.num_blocks
    for b, a in zip(before, runner.kv.k + runner.kv.v):
        assert torch.equal(a[:scratch], b[:scratch])
    mixed._graphs.update(kept)


def test_isolated_forward_keeps_each_probes_logits(engine):
    """A step whose forward raises runs again in halves (engine.isolation): each half's logits rows are the ones that half
    computed, though the graphed forward returns a view of its static logits buffer, which the next half's forward
    overwrites."""
    from engine.isolation import forward_isolated

    runner = engine.runner
    gen = torch.Generator().manual_seed(5)
    items = [BatchItem(("iso", i), tuple(torch.randint(4, 500, (6 + i,), generator=gen).tolist()), 0) for i in range(4)]
    culprit = items[3].seq_id

    def forward(batch: list[BatchItem]) -> torch.Tensor:
        if any(it.seq_id == culprit for it in batch):
            raise RuntimeError("this request's forward fails")
        assert runner.mixed.fits(batch), "the probes replay prompt graphs"
        return runner.forward(batch)

    try:
        logits, failed = forward_isolated(forward, items)
        keep, runner.mixed = runner.mixed, None
        try:
            eager = runner.forward(items[:3])
        finally:
            runner.mixed = keep
    finally:
        for it in items:
            if it.seq_id in runner.blocks:
                runner.free(it.seq_id)
    assert set(failed) == {3} and logits.shape == eager.shape
    err = ((logits - eager).abs().max() / eager.abs().max()).item()
    assert err < TOL, f"isolated rows differ from the eager forward by {err:.2e}"


def test_a_steps_lora_share_goes_by_its_adapter_tokens(engine):
    """A bucket's calibrated LoRA share is charged in proportion to a step's adapter tokens against the calibrated
    step's: a step with one adapter row beside base prompts does not pay for a bucket calibrated on adapter rows only."""
    mixed = engine.runner.mixed
    slot = engine.adapters.acquire(ADAPTERS[0])[0]
    try:
        mixed.lora_us[(64, 16)], mixed._calibrated_tokens[(64, 16)] = 1_000, 40
        items = [BatchItem("a", tuple(range(4, 14)), 0, slot), BatchItem("b", tuple(range(4, 14)), 0), BatchItem("c", (5,), 3, slot)]
        for it in items:
            engine.runner.blocks.ensure(it.seq_id, it.context_len + len(it.token_ids))
        mixed._stage(items, 64)
        assert mixed._lora_share(64, 16) == 275  # 11 adapter tokens of the calibrated 40
    finally:
        for it in items:
            engine.runner.free(it.seq_id)
        engine.adapters.release(engine.adapters.sha_of(ADAPTERS[0]))
        mixed.lora_us.pop((64, 16)), mixed._calibrated_tokens.pop((64, 16))
