"""Shared pieces of the serving tests (no tests here): engine configs on the demo model, requests, running one alone."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from engine.api import GenerationRequest, GenerationResult, SamplingParams
from engine.config import EngineConfig
from engine.demo_model import write_demo_adapter
from engine.engine import Engine
from engine.model import LORA_TARGETS

# Prompts of the demo tokenizer's corpus, 5 to ~30 tokens.
TEXTS = [
    "The lighthouse keeper climbed",
    "A good recipe for soup needs patience. Cut the onions and the carrots, warm the oil in a heavy pot",
    "The river runs through the middle of the town. In spring the water is high and fast",
    "Numbers are everywhere",
    "In the morning the market opened early. Farmers brought apples, pears, cabbages and bread.",
    "The library was open from nine in the morning until six in the evening.",
]


def config(demo_set, **kw) -> EngineConfig:
    base = dict(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=64, max_new_tokens=32, max_batch_size=16,
                kv_block_size=4)  # fmt: skip
    return EngineConfig(**{**base, **kw})


def demo_engine(demo_set, *, register_only: bool = False, **kw) -> Engine:
    """An engine of `config(demo_set, **kw)` with every demo adapter loaded (or only registered: loaded on first use)."""
    eng = Engine(config(demo_set, **kw))
    for name, path in demo_set["adapters"].items():
        (eng.register_adapter if register_only else eng.load_adapter)(name, path)
    return eng


def req(rid: str, *, prompt: str | None = None, input_ids: tuple[int, ...] | None = None, adapter_key: str | None = None,
        tenant_id: str = "", priority: int = 0, **sampling) -> GenerationRequest:  # fmt: skip
    sampling.setdefault("max_new_tokens", 8)
    sampling.setdefault("ignore_eos", True)
    if prompt is None and input_ids is None:
        prompt = TEXTS[0]
    return GenerationRequest(request_id=rid, prompt=prompt, input_ids=input_ids, adapter_key=adapter_key, tenant_id=tenant_id,
                             priority=priority, sampling=SamplingParams(**sampling))  # fmt: skip


def alone(engine: Engine, r: GenerationRequest) -> GenerationResult:
    """The request run by itself on `engine` (under a fresh id)."""
    res = engine.generate([dataclasses.replace(r, request_id=r.request_id + "/alone", arrival_us=None)])[0]
    assert res.ok, res.error
    return res


def run_until_done(engine: Engine, max_steps: int = 10_000, on_step=None) -> dict[str, GenerationResult]:
    out: dict[str, GenerationResult] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for res in engine.step():
            out[res.request_id] = res
        if on_step is not None:
            on_step(engine)
    raise AssertionError(f"still unfinished after {max_steps} steps: {engine.stats()}")


def patch_forward(monkeypatch, engine: Engine, edit) -> None:
    """Wrap the runner's forward: `edit(items, logits)` may raise or change the logits in place."""
    real = engine.runner.forward

    def forward(items, **kw):
        logits = real(items, **kw).clone()  # (an inference tensor cannot be edited outside inference mode)
        edit(items, logits)
        return logits

    monkeypatch.setattr(engine.runner, "forward", forward)


TARGET_SETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"), LORA_TARGETS]
RANKS = [4, 8, 16, 64]


NO_WARM = dict(warm_pool_slots=0, warm_pool_host_bytes=0)  # engine config: no warm pool


class FakeClock:
    """A clock the test sets (`t`), for the warm pool's wall and monotonic time."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _slot_tensors(engine: Engine) -> list:
    lora = engine.runner.lora
    return [lora.pool, lora.pages, lora.rank, lora.scale]


@pytest.fixture(scope="module")
def many_adapters(demo_set, tmp_path_factory) -> list:
    """200 adapters of the demo model: ranks 4..64 and four target sets, mixed."""
    root = tmp_path_factory.mktemp("many")
    paths = []
    for i in range(200):
        path = root / f"ad{i:03d}"
        write_demo_adapter(path, demo_set["model"], rank=RANKS[i % 4], target_modules=TARGET_SETS[(i // 4) % 4],
                           alpha=2.0 * RANKS[i % 4], use_rslora=i % 7 == 0, seed=5000 + i)  # fmt: skip
        paths.append(path)
    return paths


def corrupt_copy(src, dst):
    """A copy of the adapter folder `src` at `dst` whose safetensors file is cut in half."""
    path = shutil.copytree(src, dst)
    w = path / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return path
