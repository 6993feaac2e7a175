"""The engine computes what HF transformers + peft compute, for one batch mixing many adapters and none.

Everything runs in fp32 on the tiny demo model; errors are measured per row as
max |ours - ref| / max |ref| and must stay under 1e-4 (observed: ~5e-7).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import BatchItem

TOL = 1e-4

# (prompt, adapter): every demo adapter (ranks 4..64, four target sets, rsLoRA), one of them twice, and
# two base rows.
ROWS = [
    ("The lighthouse keeper climbed", "qv-r4"),
    ("A good recipe for soup needs patience and", "qkvo-r8"),
    ("Numbers are everywhere", "all-r16"),
    ("hi", "mlp-r64"),
    ("The river runs through the middle of the town. In spring the water", "all-r8-rslora"),
    ("Winter", "qkvo-r64-rslora"),
    ("The library was open", "qv-r16"),
    ("A computer program is a list", "mlp-r4"),
    ("The user asked", None),
    ("clouds over the harbour", "qv-r4"),
    ("In the morning the market opened early.", None),
]


@pytest.fixture(scope="module")
def engine(demo_set):
    # Blocks of 4 tokens: every prompt spans several blocks and decoding crosses block boundaries.
    eng = Engine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=64, max_new_tokens=32, kv_block_size=4, max_batch_size=16))
    for name, path in demo_set["adapters"].items():
        eng.load_adapter(name, path)
    return eng


@pytest.fixture(scope="module")
def hf_peft(demo_set):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_set["model"], dtype=torch.float32)
    names = list(demo_set["adapters"])
    model = PeftModel.from_pretrained(base, demo_set["adapters"][names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(demo_set["adapters"][name], adapter_name=name)
    return model.eval()


def _hf_logits(model, seqs: list[list[int]], adapters: list[str | None]) -> list[torch.Tensor]:
    """Per sequence, HF+peft logits [T, V] of every token, from one right-padded mixed-adapter batch."""
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, adapter_names=[a or "__base__" for a in adapters]).logits
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


def _check_close(ours: list[torch.Tensor], refs: list[torch.Tensor], what: str) -> None:
    errs = [((o - r).abs().max() / r.abs().max()).item() for o, r in zip(ours, refs)]
    assert max(errs) < TOL, (
        f"{what}: max relative error {max(errs):.3e}, mean {sum(errs) / len(errs):.3e} over {len(errs)} rows "
        f"(tolerance {TOL}); per row: {[f'{e:.1e}' for e in errs]}"
    )


def _acquire(engine: Engine, adapter: str | None) -> int:
    return -1 if adapter is None else engine.adapters.acquire(adapter)[0]


def _release(engine: Engine, seq_ids: list, adapters: list[str | None]) -> None:
    for sid, a in zip(seq_ids, adapters):
        engine.runner.free(sid)
        if a is not None:
            engine.adapters.release(engine.adapters.sha_of(a))


def test_prefill_logits_of_every_token_match_hf_peft(engine, hf_peft):
    """One flat forward of all rows (8 adapters + base) gives every token's logits as HF+peft's mixed batch does."""
    prompts = [engine.tokenizer.encode(p) for p, _ in ROWS]
    adapters = [a for _, a in ROWS]
    items = [BatchItem(("prefill", i), tuple(p), 0, _acquire(engine, a)) for i, (p, a) in enumerate(zip(prompts, adapters))]
    try:
        flat = engine.runner.forward(items, all_logits=True)  # [N, V]
    finally:
        _release(engine, [it.seq_id for it in items], adapters)
    ours = list(flat.split([len(p) for p in prompts]))
    refs = _hf_logits(hf_peft, prompts, adapters)
    _check_close(ours, refs, "prefill logits")

    # The comparison has teeth: each adapter moves its row's logits far beyond the tolerance.
    base = _hf_logits(hf_peft, prompts, [None] * len(prompts))
    for (_, a), r, b in zip(ROWS, refs, base):
        if a is not None:
            assert ((r - b).abs().max() / b.abs().max()).item() > 100 * TOL, f"adapter {a} barely changes the logits"


def test_decode_logits_match_hf_peft_with_prefill_and_decode_in_one_forward(engine, hf_peft):
    """Decode steps through the paged KV cache match HF on the full sequence, also when a step mixes
    new prefills with other rows' decodes."""
    prompts = [engine.tokenizer.encode(p) for p, _ in ROWS]
    adapters = [a for _, a in ROWS]
    half = len(ROWS) // 2
    seqs = [list(p) for p in prompts]
    computed = [0] * len(ROWS)
    slots = [_acquire(engine, a) for a in adapters]
    seq_ids = [("decode", i) for i in range(len(ROWS))]
    try:
        for step in range(5):
            # Step 0 prefills the first half; step 1 prefills the second half beside the first half's decodes.
            active = [i for i in range(len(ROWS)) if i < half or step >= 1]
            items = [BatchItem(seq_ids[i], tuple(seqs[i][computed[i] :]), computed[i], slots[i]) for i in active]
            logits = engine.runner.forward(items)  # [B, V], each row's last token
            refs = _hf_logits(hf_peft, [seqs[i] for i in active], [adapters[i] for i in active])
            _check_close(list(logits[:, None]), [r[-1:] for r in refs], f"step {step} last-token logits")
            for row, i in enumerate(active):
                computed[i] = len(seqs[i])
                seqs[i].append(int(logits[row].argmax()))
    finally:
        _release(engine, seq_ids, adapters)


def test_greedy_tokens_match_hf_generate(engine, hf_peft):
    """Engine.generate's greedy tokens (16 new, stopping at EOS) equal HF+peft generate's, row by row."""
    reqs = [
        GenerationRequest(request_id=f"g{i}", prompt=p, adapter_key=a, sampling=SamplingParams(max_new_tokens=16))
        for i, (p, a) in enumerate(ROWS)
    ]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.ok, res.error
        ids = torch.tensor([engine.tokenizer.encode(req.prompt)])
        with torch.no_grad():
            out = hf_peft.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[req.adapter_key or "__base__"],
                max_new_tokens=16, do_sample=False,
            )  # fmt: skip
        assert res.output_ids == out[0, ids.shape[1] :].tolist(), f"{req.request_id} ({req.adapter_key})"


def test_tied_embeddings_match_hf(demo_set, tmp_path):
    """A checkpoint with tie_word_embeddings and no lm_head.weight reuses the embeddings as HF does."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "tied"
    shutil.copytree(demo_set["model"], model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(model_dir / "model.safetensors"))

    eng = Engine(EngineConfig(model_dir=str(model_dir), device="cpu", max_prompt_tokens=64, max_new_tokens=8, max_batch_size=2))
    prompt = eng.tokenizer.encode(ROWS[0][0])
    ours = eng.runner.forward([BatchItem("tied", tuple(prompt), 0)], all_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    _check_close([ours], [ref], "tied-embedding logits")


# ---- other architectures: Mistral, Qwen2 (qkv bias, tied embeddings), Llama 3 RoPE scaling


@pytest.fixture(scope="module", params=["mistral", "qwen2", "llama3"])
def arch_set(request, tmp_path_factory):
    """(arch, engine, HF+peft model) for a demo set of that architecture with the 8 demo adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.demo_model import write_demo_set

    root = tmp_path_factory.mktemp(request.param)
    adapters = write_demo_set(root, seed=1, arch=request.param)
    eng = Engine(EngineConfig(model_dir=str(root / "model"), device="cpu", max_prompt_tokens=64, max_new_tokens=32, kv_block_size=4, max_batch_size=16))
    for name, path in adapters.items():
        eng.load_adapter(name, path)
    base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return request.param, eng, model.eval(), root


def test_other_architectures_match_hf_peft_in_prefill_and_decode(arch_set):
    """Mistral, Qwen2 and Llama-3-scaled RoPE: one mixed batch (ranks 4..64, four target sets, rsLoRA, base rows)
    gives HF+peft's logits for every prompt token, then for two decode steps beside fresh prefills."""
    arch, engine, hf_peft, _ = arch_set
    prompts = [engine.tokenizer.encode(p) for p, _ in ROWS]
    adapters = [a for _, a in ROWS]
    items = [BatchItem((arch, "p", i), tuple(p), 0, _acquire(engine, a)) for i, (p, a) in enumerate(zip(prompts, adapters))]
    try:
        flat = engine.runner.forward(items, all_logits=True)
    finally:
        _release(engine, [it.seq_id for it in items], adapters)
    _check_close(list(flat.split([len(p) for p in prompts])), _hf_logits(hf_peft, prompts, adapters), f"{arch} prefill logits")

    seqs = [list(p) for p in prompts]
    computed = [0] * len(ROWS)
    slots = [_acquire(engine, a) for a in adapters]
    seq_ids = [(arch, "d", i) for i in range(len(ROWS))]
    try:
        for step in range(3):
            active = [i for i in range(len(ROWS)) if i % 2 == 0 or step >= 1]
            items = [BatchItem(seq_ids[i], tuple(seqs[i][computed[i] :]), computed[i], slots[i]) for i in active]
            logits = engine.runner.forward(items)
            refs = _hf_logits(hf_peft, [seqs[i] for i in active], [adapters[i] for i in active])
            _check_close(list(logits[:, None]), [r[-1:] for r in refs], f"{arch} step {step}")
            for row, i in enumerate(active):
                computed[i] = len(seqs[i])
                seqs[i].append(int(logits[row].argmax()))
    finally:
        _release(engine, seq_ids, adapters)


def test_other_architectures_generate_hf_greedy_tokens(arch_set):
    """Engine.generate's greedy tokens equal HF+peft generate's for a few rows of each architecture."""
    arch, engine, hf_peft, _ = arch_set
    for i, (prompt, adapter) in enumerate(ROWS[::3]):
        res = engine.generate([GenerationRequest(request_id=f"{arch}-g{i}", prompt=prompt, adapter_key=adapter, sampling=SamplingParams(max_new_tokens=12))])[0]
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf_peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[adapter or "__base__"], max_new_tokens=12, do_sample=False)
        assert res.output_ids == out[0, ids.shape[1] :].tolist(), f"{arch} row {i} ({adapter})"


def test_llama3_rope_scaling_changes_the_logits_and_matches_hf(tmp_path):
    """The llama3 RoPE scaling is really applied: the same weights with plain RoPE give logits far apart (so the
    llama3 match above has teeth); both match HF's model of their own config."""
    from transformers import AutoModelForCausalLM

    from engine.demo_model import write_demo_model

    logits = {}
    for name, scaling in (("scaled", True), ("plain", False)):
        model_dir = tmp_path / name
        write_demo_model(model_dir, seed=2, arch="llama3")
        if not scaling:
            cfg = json.loads((model_dir / "config.json").read_text())
            cfg["rope_scaling"] = None
            (model_dir / "config.json").write_text(json.dumps(cfg))
        eng = Engine(EngineConfig(model_dir=str(model_dir), device="cpu", max_prompt_tokens=64, max_new_tokens=8, max_batch_size=2))
        assert eng.runner.config.rope.rope_type == ("llama3" if scaling else "default")
        prompt = eng.tokenizer.encode(ROWS[4][0])  # ~20 tokens: positions where the scaled frequencies differ
        logits[name] = eng.runner.forward([BatchItem(name, tuple(prompt), 0)], all_logits=True)
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([prompt])).logits[0]
        _check_close([logits[name]], [ref], f"{name} llama logits")
    plain = logits["plain"]
    assert ((logits["scaled"] - plain).abs().max() / plain.abs().max()).item() > 100 * TOL


@pytest.mark.parametrize(("window", "ok"), [(96, True), (95, False)])
def test_sliding_window_shorter_than_a_sequence_is_refused(demo_set, tmp_path, window, ok):
    """Mistral's sliding window is not implemented: a window under max_prompt_tokens + max_new_tokens (96 here)
    is refused at start with a message naming both, since full attention would compute something else."""
    from engine.api import EngineError
    from engine.demo_model import write_demo_model

    write_demo_model(tmp_path / "m", arch="mistral")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["sliding_window"] = window
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    make = lambda: Engine(EngineConfig(model_dir=str(tmp_path / "m"), device="cpu", max_prompt_tokens=64, max_new_tokens=32))
    if ok:
        assert make().runner.config.sliding_window == window
    else:
        with pytest.raises(EngineError) as e:
            make()
        assert e.value.code == "model_unsupported" and "95" in str(e.value) and "96" in str(e.value)
