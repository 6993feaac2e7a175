"""Hostile adapter files met at registration: each is refused as an AdapterError naming the file and the field, and a
bulk import reports it in its place while the other adapters are registered (an exception other than AdapterError or
OSError aborted the whole `lorabatch adapters add --dir` call, and failed the worker's read as adapter_load_failed)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapter_import import AdapterChecks, Imported, import_adapter, import_adapters
from engine.api import AdapterError
from engine.store import AdapterStore

MB = 1 << 20
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _safetensors(header: dict | bytes, body: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _weights(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / "adapter_model.safetensors").write_bytes(data)


def _config_text(edit: Callable[[str], str]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        p = d / "adapter_config.json"
        p.write_text(edit(p.read_text()))

    return go


def _config(**changes) -> Callable[[Path], None]:
    return _config_text(lambda text: json.dumps({**json.loads(text), **changes}))


def _layer0_copied_as(layer: str, scale: float = 100.0) -> Callable[[Path], None]:
    """Add a copy of layer 0's tensors (times `scale`) under the layer written as `layer`."""

    def go(d: Path) -> None:
        w = load_file(d / "adapter_model.safetensors")
        for k in [k for k in w if ".layers.0." in k]:
            w[k.replace(".layers.0.", f".layers.{layer}.")] = w[k] * scale
        save_file(w, d / "adapter_model.safetensors")

    return go


# (case id, how to break the qkvo-r8 adapter, error code, substrings the message must hold)
HOSTILE: list[tuple[str, Callable[[Path], None], str, list[str]]] = [
    ("header JSON nested 200,000 deep", _weights(struct.pack("<Q", 200_000) + b"[" * 200_000), "adapter_corrupt",
     ["adapter_model.safetensors", "thousands deep"]),
    ("config JSON nested 200,000 deep", _config_text(lambda _: "[" * 200_000), "adapter_corrupt",
     ["adapter_config.json", "thousands deep"]),
    ("shape 1e999 (an infinite float)", _weights(_safetensors({KEY: {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}},
                                                              b"\0" * 4)), "adapter_corrupt", ["shape", "whole numbers"]),
    ("data_offsets 1e999", _weights(_safetensors({KEY: {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}}, b"\0" * 4)),
     "adapter_corrupt", ["data_offsets", "whole numbers"]),
    ("shape 8.7 x 128.2 read as 8 x 128", _weights(_safetensors({KEY: {"dtype": "F32", "shape": [8.7, 128.2],
                                                                      "data_offsets": [0, 4096]}}, b"\0" * 4096)),
     "adapter_corrupt", ["shape", "whole numbers"]),
    ("data_offsets a string", _weights(_safetensors({KEY: {"dtype": "U8", "shape": [4], "data_offsets": "04"}}, b"\0" * 4)),
     "adapter_corrupt", ["data_offsets", "whole numbers"]),
    ("shape true", _weights(_safetensors({KEY: {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0")),
     "adapter_corrupt", ["shape", "whole numbers"]),
    ("a dimension past int64 beside a 0", _weights(_safetensors({KEY: {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}})),
     "adapter_corrupt", [KEY, "do not hold"]),
    ("lora_alpha 10**400", _config(lora_alpha=10**400), "adapter_invalid", ["lora_alpha=", "finite number"]),
    ("target_modules holding a list", _config(target_modules=[["q_proj"]]), "adapter_invalid", ["unknown target module ['q_proj']"]),
    ("r of 5,000 digits", _config_text(lambda t: t.replace('"r": ', '"r": ' + "1" * 5000 + ', "was_r": ')), "adapter_corrupt",
     ["adapter_config.json", "more than 4,300 digits"]),
    ("shape of 5,000 digits", _weights(_safetensors(b'{"%s":{"dtype":"F32","shape":[%s],"data_offsets":[0,4]}}'
                                                           % (KEY.encode(), b"1" * 5000), b"\0" * 4)), "adapter_corrupt",
     ["adapter_model.safetensors", "more than 4,300 digits"]),
    ("a layer of 5,000 digits", _layer0_copied_as("9" * 5000), "adapter_invalid", ["unexpected key", "without a leading zero"]),
    ("layer 0 again as 00", _layer0_copied_as("00"), "adapter_invalid", ["unexpected key base_model.model.model.layers.00.",
                                                                         "without a leading zero"]),
    ("layer 0 again as an Arabic-Indic zero", _layer0_copied_as("\u0660"), "adapter_invalid",
     ["unexpected key base_model.model.model.layers.\u0660.", "ASCII digits"]),
    ("config over 1 MiB", _config_text(lambda t: t.replace('"r": ', '"pad": "' + "x" * (1 << 20) + '", "r": ')),
     "adapter_invalid", ["adapter_config.json holds 1,049,", "over the 1,048,576", "keep only PEFT's fields"]),
    ("target_modules holding an object", _config(target_modules=[{"q": 1}]), "adapter_invalid", ["unknown target module"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def checks(demo_set) -> AdapterChecks:
    return AdapterChecks.for_model_dir(demo_set["model"], 64)


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_file_is_refused_naming_it(demo_set, checks, tmp_path, case):
    """Every hostile file is an AdapterError with its code and a message naming the file and what is wrong, and nothing
    is stored."""
    _, brk, code, needles = case
    d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / "adapter"))
    brk(d)
    store = AdapterStore(tmp_path / "store", 64 * MB)
    with pytest.raises(AdapterError) as ei:
        import_adapter(d, store, checks)
    assert ei.value.code == code, (ei.value.code, str(ei.value))
    for needle in needles:
        assert needle in str(ei.value), (needle, str(ei.value))
    assert str(d) in str(ei.value)
    assert store.entries() == []


def test_bulk_import_reports_hostile_files_in_place(demo_set, checks, tmp_path):
    """A bulk import of every hostile folder between two good ones: each hostile one is its AdapterError in its place,
    the good ones are stored (one hostile file aborted the whole call before)."""
    good = demo_set["adapters"]["qv-r4"]
    paths: list[Path] = [good]
    for i, (_, brk, _, _) in enumerate(HOSTILE):
        d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / f"bad{i}"))
        brk(d)
        paths.append(d)
    paths.append(demo_set["adapters"]["mlp-r4"])
    store = AdapterStore(tmp_path / "store", 64 * MB)
    out = import_adapters(paths, store, checks, threads=2)
    assert isinstance(out[0], Imported) and isinstance(out[-1], Imported), (out[0], out[-1])
    assert [type(o) for o in out[1:-1]] == [AdapterError] * len(HOSTILE), out
    assert [e.code for e in out[1:-1]] == [c[2] for c in HOSTILE]
    assert len(store.entries()) == 2


def test_an_adapter_whose_header_leaves_every_tensor_unaligned_loads(demo_set, checks, tmp_path):
    """A writer that does not pad the safetensors header to 8 bytes (the format does not require it) leaves every f32
    tensor unaligned: each is read by a copy, and the copies of tensors of one size tied in _one_view's sort, which then
    compared two tensors and raised RuntimeError past every except (a whole `adapters add --dir` call aborted)."""
    from engine.adapters import load_adapter_dir

    d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / "adapter"))
    data = (d / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.dumps(json.loads(data[8 : 8 + n]), separators=(",", ":")).encode()
    header += b" " * ((1 - len(header)) % 4)  # 8 + len(header) is 1 mod 4: no f32 is aligned
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])
    got = import_adapter(d, AdapterStore(tmp_path / "store", 64 * MB), checks)
    assert got.rank == 8
    want = load_adapter_dir(demo_set["adapters"]["qkvo-r8"], checks.model, max_lora_rank=64, max_bytes=64 * MB)
    have = load_adapter_dir(d, checks.model, max_lora_rank=64, max_bytes=64 * MB)
    assert have.weights.keys() == want.weights.keys()
    for k, (a, b) in want.weights.items():
        assert torch.equal(have.weights[k][0], a) and torch.equal(have.weights[k][1], b), k


def test_a_header_longer_than_the_safetensors_library_reads_is_refused(demo_set, checks, tmp_path):
    """A header over 100,000,000 bytes (the library's MAX_HEADER_SIZE; here a valid adapter's with a huge __metadata__)
    is refused before it is parsed: it was parsed up to engine.max_adapter_bytes, gigabytes of memory at every read."""
    from engine.adapters import MAX_HEADER_BYTES

    d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / "adapter"))
    data = (d / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["pad"] = ""
    raw = json.dumps(header).encode()
    raw = raw.replace(b'"pad": ""', b'"pad": "' + b"x" * (MAX_HEADER_BYTES + 8 - len(raw)) + b'"')
    raw += b" " * ((-len(raw)) % 8)
    assert MAX_HEADER_BYTES < len(raw) <= MAX_HEADER_BYTES + 16
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    store = AdapterStore(tmp_path / "store", 512 * MB)
    with pytest.raises(AdapterError) as ei:
        import_adapter(d, store, checks)
    assert ei.value.code == "adapter_corrupt" and "over the 100,000,000 the safetensors library reads" in str(ei.value), ei.value
    assert store.entries() == []


LONG = "x" * 1_000_000
LONG_NAMES = {
    "a key of a million characters": _safetensors({"base_model." + LONG: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                                  b"\0" * 4),
    "a dtype of a million characters": _safetensors({KEY: {"dtype": LONG, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "a shape of 200,000 dimensions": _safetensors({KEY: {"dtype": "F32", "shape": [1] * 200_000, "data_offsets": [0, 8]}},
                                                  b"\0" * 4),
    "a name of a million characters out of place": _safetensors({LONG: {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
                                                                b"\0" * 8),
}  # fmt: skip


@pytest.mark.parametrize("data", LONG_NAMES.values(), ids=LONG_NAMES.keys())
def test_an_error_shows_a_long_name_or_value_cut(demo_set, checks, tmp_path, data):
    """A tensor name, dtype or shape from the file is shown cut in the error: it was shown whole, a line of up to the
    header's 100 MB on `adapters add`'s stderr."""
    d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / "adapter"))
    (d / "adapter_model.safetensors").write_bytes(data)
    with pytest.raises(AdapterError) as ei:
        import_adapter(d, AdapterStore(tmp_path / "store", 64 * MB), checks)
    assert len(str(ei.value)) < 1000 + len(str(d)), str(ei.value)[:2000]
    assert "adapter_model.safetensors" in str(ei.value) or "unexpected key" in str(ei.value), str(ei.value)[:300]


@pytest.mark.parametrize("field", ["modules_to_save", "layer_replication", "target_modules", "exclude_modules", "bias", "peft_type"])
def test_a_config_error_shows_a_long_value_cut(demo_set, checks, tmp_path, field):
    """A config value is shown cut in its error (it was shown whole: up to the config's 1 MiB on a line)."""
    d = Path(shutil.copytree(demo_set["adapters"]["qkvo-r8"], tmp_path / "adapter"))
    _config(**{field: ["y" * 1000] * 500})(d)
    with pytest.raises(AdapterError) as ei:
        import_adapter(d, AdapterStore(tmp_path / "store", 64 * MB), checks)
    assert field in str(ei.value) and len(str(ei.value)) < 1000 + len(str(d)), str(ei.value)[:2000]
