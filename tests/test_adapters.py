"""Adapter validation against the base (errors name the module and the shapes) and the content-addressed store."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapters import load_adapter_dir
from engine.api import AdapterError
from engine.checkpoint import read_model_config
from engine.store import AdapterStore, content_sha256

MB = 1 << 20
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _copy(demo_set, tmp_path: Path, name: str = "qkvo-r8") -> Path:
    return Path(shutil.copytree(demo_set["adapters"][name], tmp_path / "adapter"))


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_weights(d: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    w = load_file(str(d / "adapter_model.safetensors"))
    fn(w)
    save_file(w, str(d / "adapter_model.safetensors"))


def _truncate(d: Path) -> None:
    p = d / "adapter_model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


# (case id, how to break the qkvo-r8 adapter (r=8, q,k,v,o), error code, substrings the message must hold)
BROKEN: list[tuple[str, Callable[[Path], None], str, list[str]]] = [
    (
        "wrong A shape",
        lambda d: _edit_weights(d, lambda w: w.__setitem__(f"{Q0}.lora_A.weight", torch.randn(8, 96))),
        "adapter_invalid",
        ["layers.0.self_attn.q_proj lora_A", "expected [8, 128]", "found [8, 96]"],
    ),
    (
        "wrong B shape",
        lambda d: _edit_weights(d, lambda w: w.__setitem__("base_model.model.model.layers.2.self_attn.k_proj.lora_B.weight", torch.randn(128, 8))),
        "adapter_invalid",
        ["layers.2.self_attn.k_proj lora_B", "expected [64, 8]", "found [128, 8]"],
    ),
    (
        "rank differs from config",
        lambda d: _edit_config(d, r=4),
        "adapter_invalid",
        ["lora_A", "expected [4, 128]", "found [8, 128]"],
    ),
    ("unknown target module in config", lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]), "adapter_invalid", ["unknown target module 'lm_head'"]),
    (
        "unknown module in weights",
        lambda d: _edit_weights(d, lambda w: w.__setitem__("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", torch.randn(8, 128))),
        "adapter_invalid",
        ["qkv_proj", "not a LoRA-targetable projection"],
    ),
    (
        "weights for an untargeted module",
        lambda d: _edit_config(d, target_modules=["q_proj", "k_proj", "v_proj"]),
        "adapter_invalid",
        ["o_proj", "target_modules"],
    ),
    (
        "layer past the base",
        lambda d: _edit_weights(d, lambda w: w.update({k.replace("layers.0.", "layers.9."): v.clone() for k, v in w.items() if ".layers.0." in k})),
        "adapter_invalid",
        ["layers.9", "4 layers"],
    ),
    ("missing B", lambda d: _edit_weights(d, lambda w: w.pop(f"{Q0}.lora_B.weight")), "adapter_invalid", ["layers.0.self_attn.q_proj", "no lora_B"]),
    ("integer dtype", lambda d: _edit_weights(d, lambda w: w.__setitem__(f"{Q0}.lora_A.weight", torch.ones(8, 128, dtype=torch.int32))), "adapter_invalid", ["torch.int32"]),
    (
        "NaN weights",
        lambda d: _edit_weights(d, lambda w: w[f"{Q0}.lora_B.weight"].__setitem__((0, 0), float("nan"))),
        "adapter_invalid",
        ["layers.0.self_attn.q_proj lora_B", "NaN"],
    ),
    ("rank over max_lora_rank", lambda d: None, "adapter_rank_too_large", ["r=64", "max_lora_rank=32"]),
    ("truncated safetensors", _truncate, "adapter_corrupt", ["adapter_model.safetensors", "corrupt or truncated"]),
    ("config not JSON", lambda d: (d / "adapter_config.json").write_text("{not json"), "adapter_corrupt", ["adapter_config.json", "not valid JSON"]),
    ("pickle .bin beside", lambda d: (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle"), "adapter_unsafe", ["adapter_model.bin", "pickle"]),
    ("missing config", lambda d: (d / "adapter_config.json").unlink(), "adapter_missing", ["adapter_config.json is missing"]),
    ("missing weights", lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_missing", ["adapter_model.safetensors is missing"]),
    ("not LoRA", lambda d: _edit_config(d, peft_type="IA3"), "adapter_invalid", ["peft_type='IA3'"]),
    ("fan_in_fan_out", lambda d: _edit_config(d, fan_in_fan_out=True), "adapter_invalid", ["fan_in_fan_out"]),
    ("trained bias", lambda d: _edit_config(d, bias="all"), "adapter_invalid", ["bias='all'"]),
    ("DoRA", lambda d: _edit_config(d, use_dora=True), "adapter_invalid", ["DoRA"]),
    # PEFT's configs of these (peft 0.21's save_pretrained): a classifier's fills modules_to_save with its head
    (
        "classifier task",
        lambda d: _edit_config(d, task_type="SEQ_CLS", modules_to_save=["classifier", "score"]),
        "adapter_invalid",
        ["task_type='SEQ_CLS'", "CAUSAL_LM"],
    ),
    ("embeddings task", lambda d: _edit_config(d, task_type="FEATURE_EXTRACTION"), "adapter_invalid", ["task_type='FEATURE_EXTRACTION'"]),
    ("layer replication", lambda d: _edit_config(d, layer_replication=[[0, 2], [0, 2]]), "adapter_invalid", ["layer_replication"]),
    ("bias on lora_B", lambda d: _edit_config(d, lora_bias=True), "adapter_invalid", ["lora_bias=true"]),
    ("trained tokens", lambda d: _edit_config(d, trainable_token_indices=[5, 6]), "adapter_invalid", ["trainable_token_indices"]),
    ("regex targets", lambda d: _edit_config(d, target_modules=".*proj"), "adapter_invalid", ["pattern"]),
    ("use_rslora a string", lambda d: _edit_config(d, use_rslora="no"), "adapter_invalid", ["use_rslora='no'", "true or false"]),
]


@pytest.mark.parametrize(("case", "breaks", "code", "needles"), BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_adapters_are_refused_with_a_message_naming_what_and_where(demo_set, tmp_path, case, breaks, code, needles):
    """Each kind of broken adapter raises AdapterError with its code, and the message names the module/file and shapes."""
    d = _copy(demo_set, tmp_path, "qkvo-r64-rslora" if case == "rank over max_lora_rank" else "qkvo-r8")
    breaks(d)
    model = read_model_config(demo_set["model"])
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert e.value.code == code, e.value
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"


def test_a_valid_adapter_loads_with_its_scaling_and_shapes(demo_set):
    """The rsLoRA demo adapter loads: scaling alpha/sqrt(r), A [r, in] and B [out, r] for every targeted (layer, module)."""
    model = read_model_config(demo_set["model"])
    a = load_adapter_dir(demo_set["adapters"]["all-r8-rslora"], model, max_lora_rank=64, max_bytes=64 * MB)
    assert a.rank == 8 and a.use_rslora and a.scaling == pytest.approx(16 / 8**0.5)
    assert len(a.weights) == model.num_layers * 7
    shapes = model.projection_shapes()
    for (layer, module), (wa, wb) in a.weights.items():
        assert tuple(wa.shape) == (8, shapes[module][0]) and tuple(wb.shape) == (shapes[module][1], 8)


def test_a_config_without_a_task_type_loads(demo_set, tmp_path):
    """task_type absent or null (PEFT on a bare model, or configs written before task types) is served as CAUSAL_LM is."""
    model = read_model_config(demo_set["model"])
    for task in ("absent", None):
        d = _copy(demo_set, tmp_path / str(task))
        cfg = json.loads((d / "adapter_config.json").read_text())
        if task == "absent":
            del cfg["task_type"]
        else:
            cfg["task_type"] = None
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        assert load_adapter_dir(d, model, max_lora_rank=64, max_bytes=64 * MB).rank == 8


def test_a_file_swapped_for_a_larger_one_after_the_size_check_is_refused_unread(demo_set, tmp_path, monkeypatch):
    """adapter_files checks the files' sizes, then they are opened and read: a weights file replaced in between by one
    over engine.max_adapter_bytes was read whole (a buffer of its full size allocated), where the limit promised no more
    than max_bytes. The read itself now refuses it, before allocating, as adapter_too_large."""
    import engine.adapters as adapters_mod

    model = read_model_config(demo_set["model"])
    d = _copy(demo_set, tmp_path)
    checked = adapters_mod.adapter_files

    def check_then_swap(path, max_bytes):
        paths = checked(path, max_bytes)
        with open(d / "adapter_model.safetensors", "ab") as f:  # the swap, after the check
            f.truncate(64 * MB + 1)
        return paths

    monkeypatch.setattr(adapters_mod, "adapter_files", check_then_swap)
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=64, max_bytes=64 * MB)
    assert e.value.code == "adapter_too_large" and str(64 * MB + 1) in str(e.value), e.value


def test_the_limit_holds_for_both_files_together_when_one_grows_after_the_check(demo_set, tmp_path, monkeypatch):
    """Each file under engine.max_adapter_bytes alone, both over it together once the config grew after the check."""
    import engine.adapters as adapters_mod

    model = read_model_config(demo_set["model"])
    d = _copy(demo_set, tmp_path)
    limit = sum(f.stat().st_size for f in d.iterdir()) + 10
    checked = adapters_mod.adapter_files

    def check_then_grow(path, max_bytes):
        paths = checked(path, max_bytes)
        with open(d / "adapter_config.json", "a") as f:
            f.write(" " * 100)
        return paths

    monkeypatch.setattr(adapters_mod, "adapter_files", check_then_grow)
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=64, max_bytes=limit)
    assert e.value.code == "adapter_too_large" and "adapter_model.safetensors" in str(e.value), e.value


def test_too_large_and_escaping_symlinks_are_refused(demo_set, tmp_path):
    model = read_model_config(demo_set["model"])
    d = _copy(demo_set, tmp_path)
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=64, max_bytes=1000)
    assert e.value.code == "adapter_too_large" and "1000" in str(e.value)

    outside = tmp_path / "elsewhere.safetensors"
    (d / "adapter_model.safetensors").rename(outside)
    os.symlink(outside, d / "adapter_model.safetensors")
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=64, max_bytes=64 * MB)
    assert e.value.code == "adapter_unsafe" and "outside the adapter folder" in str(e.value)


# ---- the store


def test_store_put_path_verify_and_dedupe(demo_set, tmp_path):
    """put returns the content hash of the module docstring; the same content twice (any folder, extra files)
    is one entry; path holds exactly the two files; verify passes on an untouched entry."""
    store = AdapterStore(tmp_path / "store", max_bytes=64 * MB)
    src = demo_set["adapters"]["qv-r4"]
    sha = store.put(src)
    want = content_sha256((src / "adapter_config.json").read_bytes(), (src / "adapter_model.safetensors").read_bytes())
    assert sha == want and len(sha) == 64
    copy = _copy(demo_set, tmp_path, "qv-r4")
    (copy / "README.md").write_text("not part of the identity")
    os.utime(copy / "adapter_model.safetensors", (1, 1))
    assert store.put(copy) == sha
    assert sorted(p.name for p in store.path(sha).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in store.root.iterdir()] == [sha]  # one entry, no temp folders left
    assert sha in store
    store.verify(sha)
    other = store.put(demo_set["adapters"]["qv-r16"])
    assert other != sha and other in store


def test_store_verify_detects_tampering(demo_set, tmp_path):
    store = AdapterStore(tmp_path / "store", max_bytes=64 * MB)
    sha = store.put(demo_set["adapters"]["mlp-r4"])
    weights = store.path(sha) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError) as e:
        store.verify(sha)
    assert e.value.code == "adapter_corrupt" and sha in str(e.value) and "put the adapter again" in str(e.value)


@pytest.mark.parametrize(
    ("breaks", "code"),
    [
        (_truncate, "adapter_corrupt"),
        (lambda d: (d / "adapter_config.json").write_text("[1, 2]"), "adapter_corrupt"),
        (lambda d: (d / "sub").mkdir() or (d / "sub" / "weights.pt").write_bytes(b"x"), "adapter_unsafe"),
        (lambda d: (d / "adapter_config.json").unlink(), "adapter_missing"),
    ],
    ids=["truncated weights", "config not an object", "pickle in a subfolder", "missing config"],
)
def test_store_refuses_bad_folders_and_leaves_nothing_behind(demo_set, tmp_path, breaks, code):
    store = AdapterStore(tmp_path / "store", max_bytes=64 * MB)
    d = _copy(demo_set, tmp_path)
    breaks(d)
    with pytest.raises(AdapterError) as e:
        store.put(d)
    assert e.value.code == code
    assert list(store.root.iterdir()) == []


@pytest.mark.parametrize("sha", ["../etc", "a" * 63, "A" * 64, "0" * 64])
def test_store_paths_only_for_well_formed_present_hashes(tmp_path, sha):
    """Malformed names never reach the filesystem; well-formed unknown ones say the adapter is missing."""
    store = AdapterStore(tmp_path / "store", max_bytes=MB)
    assert sha not in store
    with pytest.raises(AdapterError) as e:
        store.path(sha)
    assert e.value.code == "adapter_missing"


# ---- the base fingerprint


def _fp(model_dir) -> str:
    from engine.checkpoint import base_fingerprint

    return base_fingerprint(model_dir)


def _set_weights_fingerprint(d: Path, value: str) -> None:
    from engine.adapters import FINGERPRINT_KEY

    w = d / "adapter_model.safetensors"
    save_file(load_file(str(w)), str(w), metadata={FINGERPRINT_KEY: value})


def test_demo_adapters_record_their_base_fingerprint_and_pass(demo_set):
    """The demo adapters carry their base's fingerprint in the safetensors metadata; checked against it, they load."""
    model = read_model_config(demo_set["model"])
    fp = _fp(demo_set["model"])
    assert len(fp) == 64
    a = load_adapter_dir(demo_set["adapters"]["qv-r4"], model, max_lora_rank=64, max_bytes=64 * MB, base_fingerprint=fp)
    assert a.rank == 4


@pytest.mark.parametrize(
    ("mutate", "code", "needles"),
    [
        (lambda d: _set_weights_fingerprint(d, "f" * 64), "adapter_base_mismatch", ["trained for base fingerprint " + "f" * 64, "this engine serves"]),
        (lambda d: _edit_config(d, lorabatch_base_fingerprint="e" * 64), "adapter_base_mismatch", ["adapter_config.json records", "e" * 64]),
        (lambda d: _edit_config(d, lorabatch_base_fingerprint=42), "adapter_invalid", ["lorabatch_base_fingerprint=42"]),
    ],
    ids=["other base in metadata", "config and metadata disagree", "not a string"],
)
def test_a_fingerprint_that_does_not_match_the_base_is_refused(demo_set, tmp_path, mutate, code, needles):
    """An adapter recording another base's fingerprint is refused, the message naming the recorded one and the base's."""
    d = _copy(demo_set, tmp_path)
    mutate(d)
    fp = _fp(demo_set["model"])
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, read_model_config(demo_set["model"]), max_lora_rank=64, max_bytes=64 * MB, base_fingerprint=fp)
    assert e.value.code == code
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"
    if code == "adapter_base_mismatch" and "disagree" not in str(e.value):
        assert fp in str(e.value)


def test_an_adapter_without_a_fingerprint_is_checked_by_shape_only(demo_set, tmp_path):
    d = _copy(demo_set, tmp_path)
    w = d / "adapter_model.safetensors"
    save_file(load_file(str(w)), str(w), metadata={"format": "pt"})
    a = load_adapter_dir(d, read_model_config(demo_set["model"]), max_lora_rank=64, max_bytes=64 * MB, base_fingerprint="0" * 64)
    assert a.rank == 8


def test_base_fingerprint_covers_architecture_and_tokenizer_only(demo_set, tmp_path):
    """Same for a copy, for another max_position_embeddings and for rope_parameters spelled the transformers-5 way;
    different for another architecture, other RoPE scaling, or another tokenizer."""
    from engine.demo_model import write_demo_model

    fp = _fp(demo_set["model"])
    copy = Path(shutil.copytree(demo_set["model"], tmp_path / "copy"))
    assert _fp(copy) == fp
    cfg = json.loads((copy / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    rope_theta = cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    (copy / "config.json").write_text(json.dumps(cfg))
    assert _fp(copy) == fp
    for arch in ("llama3", "mistral", "qwen2"):
        write_demo_model(tmp_path / arch, arch=arch)
        assert _fp(tmp_path / arch) != fp, arch
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 10_000, "content": "<extra>"})
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert _fp(copy) != fp


def _st_file(header: dict, data: bytes, pad_to: int = 8) -> bytes:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % pad_to)
    return len(head).to_bytes(8, "little") + head + data


def test_read_safetensors_views_what_the_library_writes(tmp_path):
    """Tensors of every float dtype and an int one, with metadata, read back equal to what safetensors wrote, as views of
    the buffer (no copy), from bytes and from a bytearray."""
    from safetensors.torch import save
    from engine.adapters import read_safetensors

    want = {"a": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "c": torch.randn(2, 2).half(),
            "d": torch.arange(6, dtype=torch.int32).view(2, 3), "e": torch.randn(1, 7, dtype=torch.float64), "z": torch.zeros(0, 4)}  # fmt: skip
    raw = save(want, metadata={"k": "v"})
    for data in (raw, bytearray(raw)):
        got, meta = read_safetensors(data, tmp_path / "x.safetensors")
        assert meta == {"k": "v"} and set(got) == set(want)
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    buf = bytearray(raw)
    got, _ = read_safetensors(buf, tmp_path / "x.safetensors")
    got["a"].zero_()  # through the view, into the buffer
    assert torch.equal(read_safetensors(buf, tmp_path / "x.safetensors")[0]["a"], torch.zeros(3, 5))


BAD_ST = [
    ("short", b"\x01\x02", "shorter than the 8-byte header length"),
    ("header past the end", (1000).to_bytes(8, "little") + b"{}", "the header says 1000 bytes"),
    ("not JSON", _st_file({}, b"")[:8] + b"{nope   ", "not valid JSON"),
    ("not an object", _st_file([1], b""), "not a JSON object"),  # type: ignore[arg-type]
    ("unknown dtype", _st_file({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "tensor a"),
    ("no offsets", _st_file({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "tensor a"),
    ("offsets past the data", _st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "within 4 bytes"),
    ("size not the shape's", _st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "do not hold F32 [2]"),
    ("negative shape", _st_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""), "do not hold"),
    ("a gap", _st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "starts at 4"),
    ("overlap", _st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "the bytes before it end at 8"),  # fmt: skip
    ("trailing bytes", _st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12), "cover 4 of the 12"),
    ("bad metadata", _st_file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
]


@pytest.mark.parametrize(("case", "data", "needle"), BAD_ST, ids=[c[0] for c in BAD_ST])
def test_read_safetensors_refuses_a_broken_file_by_name(tmp_path, case, data, needle):
    from engine.adapters import read_safetensors

    with pytest.raises(AdapterError) as e:
        read_safetensors(data, tmp_path / "w.safetensors")
    assert e.value.code == "adapter_corrupt" and "w.safetensors is corrupt or truncated" in str(e.value), e.value
    assert needle in str(e.value), e.value


def test_read_safetensors_takes_an_unaligned_tensor(tmp_path):
    """A writer other than safetensors' may put an f32 at an odd offset (after a one-byte tensor): read by a copy."""
    from engine.adapters import read_safetensors

    vals = torch.tensor([1.5, -2.0])
    data = _st_file({"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                     "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}, b"\x07" + vals.numpy().tobytes())  # fmt: skip
    got, _ = read_safetensors(data, tmp_path / "w.safetensors")
    assert torch.equal(got["f"], vals) and int(got["u"][0]) == 7


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_value_anywhere_is_found_and_named(demo_set, tmp_path, bad, dtype):
    """NaN, +inf or -inf in the last layer's B, in any float dtype, with the rest of the file in another dtype or the
    same: refused, naming that layer and matrix (the one-view check and the per-dtype fallback both look everywhere)."""
    d = _copy(demo_set, tmp_path)
    model = read_model_config(demo_set["model"])
    last = f"base_model.model.model.layers.{model.num_layers - 1}.self_attn.v_proj.lora_B.weight"

    def poison(w):
        for k in w:
            w[k] = w[k].to(dtype if k == last or dtype == torch.float32 else torch.float32)
        w[last][-1, -1] = bad

    _edit_weights(d, poison)
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert e.value.code == "adapter_invalid" and f"layers.{model.num_layers - 1}.self_attn.v_proj lora_B" in str(e.value)


@pytest.mark.parametrize("big", [1e300, -1e39])
def test_a_float64_value_past_float32s_range_is_refused_and_named(demo_set, tmp_path, big):
    """float64 weights are served in float32 or narrower, where 1e300 (or -1e39) is infinite: refused like an infinity,
    naming the layer and matrix (it was registered, and its jobs ran on infinities). Values within range still load."""
    d = _copy(demo_set, tmp_path)
    model = read_model_config(demo_set["model"])
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"

    def widen(w):
        for k in w:
            w[k] = w[k].double()

    _edit_weights(d, widen)
    assert load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB).weights  # float64 within range loads

    def poison(w):
        widen(w)
        w[key][0, 0] = big

    _edit_weights(d, poison)
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert e.value.code == "adapter_invalid" and "layers.1.self_attn.q_proj lora_A" in str(e.value), e.value
    assert "float32" in str(e.value), e.value


def test_weights_of_a_layer_layers_to_transform_leaves_out_are_refused(demo_set, tmp_path):
    """PEFT adapts only the layers of layers_to_transform and leaves the file's weights of the others unloaded: served
    all the same, the adapter answered otherwise than PEFT does. Refused, naming the layer; weights of the listed layers
    alone load (the other layers unadapted), and a malformed value is refused by its field."""
    d = _copy(demo_set, tmp_path)
    model = read_model_config(demo_set["model"])
    _edit_config(d, layers_to_transform=[0, 2])
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert e.value.code == "adapter_invalid" and "layers.1.self_attn" in str(e.value), e.value
    assert "layers_to_transform [0, 2] does not list layer 1" in str(e.value), e.value
    _edit_weights(d, lambda w: [w.pop(k) for k in list(w) if ".layers.1." in k or ".layers.3." in k])
    assert {layer for layer, _ in load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB).weights} == {0, 2}
    for bad in ("0", [0, -1], [True]):
        _edit_config(d, layers_to_transform=bad)
        with pytest.raises(AdapterError, match="layers_to_transform="):
            load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)


def test_weights_of_a_module_exclude_modules_names_are_refused(demo_set, tmp_path):
    """PEFT (0.14+) adapts no module that exclude_modules names and leaves its weights unloaded; the key was ignored
    and those weights served, so the adapter answered otherwise than PEFT does. Refused, naming the module; without
    them the adapter loads with the module left out of its targets. Patterns and single layers' paths (which PEFT also
    takes) are refused by the field, as is an exclusion of every target."""
    d = _copy(demo_set, tmp_path)
    model = read_model_config(demo_set["model"])
    _edit_config(d, exclude_modules=["v_proj"])
    with pytest.raises(AdapterError) as e:
        load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert e.value.code == "adapter_invalid" and "exclude_modules ['v_proj'] excludes v_proj" in str(e.value), e.value
    _edit_weights(d, lambda w: [w.pop(k) for k in list(w) if ".v_proj." in k])
    loaded = load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
    assert loaded.target_modules == ("q_proj", "k_proj", "o_proj"), loaded.target_modules
    for bad in ("v_.*", "v_proj", ["model.layers.0.self_attn.q_proj"], [1], {"v_proj": True}, ["q_proj", "k_proj", "v_proj", "o_proj"]):
        _edit_config(d, exclude_modules=bad)
        with pytest.raises(AdapterError, match="exclude_modules="):
            load_adapter_dir(d, model, max_lora_rank=32, max_bytes=64 * MB)
