"""Reading a PEFT LoRA adapter and validating it against the base model before it is admitted.

An adapter that passes here can be copied into any slot and computed by the LoRA op without further
checks: every tensor has the base projection's shape at the adapter's rank, every key maps to a known
(layer, module), and the scaling is known. Everything else is refused with an AdapterError that names
the file or module, what was expected and what was found.

Scaling follows PEFT: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora` (rank-stabilised
LoRA, Kalajdzievski 2023, arXiv:2312.03732).

Base fingerprint: an adapter may record the fingerprint of the base it was trained on
(`engine.model.ModelConfig.fingerprint`) under the key `lorabatch_base_fingerprint`, either in
adapter_config.json or in the safetensors header's `__metadata__` (PEFT passes the latter through
silently; it warns about unknown adapter_config.json keys but loads them). Where it is recorded it must
equal the serving base's; where it is not, the shape checks are all there is. PEFT's
`base_model_name_or_path` is not used: it is a local path or hub name, often both for one base.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.api import AdapterError
from engine.model import LORA_TARGETS, PROJECTION_PARENT, ModelConfig
from engine.store import adapter_files, content_sha256, read_file

# PEFT's saved key for one LoRA matrix of a Llama projection (the adapter name is stripped on save). The layer is written
# as PyTorch writes it, ASCII digits without a leading zero, at most 9 of them: `\d+` took "00" and "\u0660" (an
# Arabic-Indic zero) as layer 0 too, so a second copy of a layer's tensors replaced the first unseen (PEFT leaves such a
# key unloaded), and int() of 5,000 digits raised ValueError past every caller's except.
_KEY_RE = re.compile(r"^base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,8})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_F32_MAX = torch.finfo(torch.float32).max
# safetensors' dtype names, to torch's (those this torch has); a name not here makes the file unreadable
_ST_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"), ("I32", "int32"),
    ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"), ("U32", "uint32"),
    ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
) if hasattr(torch, attr)}  # fmt: skip
FINGERPRINT_KEY = "lorabatch_base_fingerprint"
# The safetensors library's MAX_HEADER_SIZE: it refuses a longer header ("header too large"). Here one was parsed up to
# engine.max_adapter_bytes (512 MiB): 60 MB of header took 0.8 GB and 7 s, and a valid adapter could carry such a
# __metadata__ into every worker's read of it. A real adapter's header is under 1 MB (80 layers x 7 projections x 2).
MAX_HEADER_BYTES = 100_000_000
# adapter_config.json: PEFT writes about 1 KB. It was parsed up to engine.max_adapter_bytes: 48 MB of `[]`s took 1 GB and
# 2.6 s, kept by registration (unknown keys are PEFT's to ignore) and parsed again at every worker's read.
MAX_CONFIG_BYTES = 1 << 20
# A file's names and values as errors show them, cut: a tensor name may be as long as the header (100 MB), and the
# error is printed by `adapters add` and carried in results
_SHOWN = reprlib.Repr()
_SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel = 4, 4, 100, 100, 3


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in host memory, ready to copy into a slot."""

    sha256: str
    rank: int
    alpha: float
    use_rslora: bool
    scaling: float
    target_modules: tuple[str, ...]  # in LORA_TARGETS order
    # (layer, module) -> (A [r, in], B [out, r]) on the CPU, in the file's dtype; B [r, out] when b_rank_major
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    b_rank_major: bool = False  # True for the L2 copy the slots take (engine.lora.LoraState.host_copy)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter_dir(
    path: Path, model: ModelConfig, *, max_lora_rank: int, max_bytes: int, base_fingerprint: str | None = None
) -> LoraAdapter:
    """Read, hash and validate a PEFT adapter folder against the base model `model`."""
    config_path, weights_path = adapter_files(path, max_bytes)
    config_bytes = bytes(read_file(config_path, max_bytes))
    weight_bytes = read_file(weights_path, max_bytes - len(config_bytes))  # the limit is on both files together
    return parse_adapter(
        config_bytes,
        weight_bytes,
        model,
        max_lora_rank=max_lora_rank,
        sha256=content_sha256(config_bytes, weight_bytes),
        source=Path(path),
        base_fingerprint=base_fingerprint,
    )


def parse_adapter(
    config_bytes: bytes,
    weight_bytes: bytes,
    model: ModelConfig | None,
    *,
    max_lora_rank: int,
    sha256: str,
    source: Path,
    base_fingerprint: str | None = None,
) -> LoraAdapter:
    """Validate the two files' bytes (already read, so what is hashed is what is loaded).

    `base_fingerprint` is the serving base's; None skips the fingerprint check (tests of shapes alone). `model` None
    checks everything but what needs the base, its layer count and projection sizes (of each tensor only the rank
    dimension is checked): for a registration where the base model is not at hand (`lorabatch adapters add` says so)."""
    cfg = _parse_config(config_bytes, source / "adapter_config.json", max_lora_rank)
    rank, alpha, rslora, targets, config_fp, layers, excluded = cfg
    tensors, metadata = read_safetensors(weight_bytes, source / "adapter_model.safetensors")
    if base_fingerprint is not None:
        _check_fingerprint(config_fp, metadata.get(FINGERPRINT_KEY), base_fingerprint, source)

    def invalid(what: str) -> AdapterError:
        return AdapterError(f"{source}: {what}", code="adapter_invalid")

    shapes = model.projection_shapes() if model is not None else None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):  # sorted: the first error reported does not depend on file order
        m = _KEY_RE.match(key)
        if m is None or m.group(3) not in PROJECTION_PARENT or PROJECTION_PARENT[m.group(3)] != m.group(2):
            module = m.group(3) if m else None
            hint = (
                f"'{module}' is not a LoRA-targetable projection (supported: {', '.join(LORA_TARGETS)})"
                if module and module not in PROJECTION_PARENT
                else "expected base_model.model.model.layers.N.(self_attn|mlp).MODULE.lora_(A|B).weight, N a layer number "
                "in ASCII digits without a leading zero, as PyTorch writes it"
            )
            raise invalid(f"unexpected key {_cut(key)}: {hint}")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        name = f"layers.{layer}.{m.group(2)}.{module}"
        if model is not None and layer >= model.num_layers:
            raise invalid(f"{name} is past the base model's {model.num_layers} layers; the adapter was trained for another base")
        if module in excluded:  # PEFT adapts no module exclude_modules names and leaves its weights unloaded
            raise invalid(f"{name} has weights but adapter_config.json exclude_modules {sorted(excluded)} excludes {module}; "
                          f"drop its weights or its exclusion")
        if module not in targets:
            raise invalid(f"{name} has weights but adapter_config.json target_modules {list(targets)} does not list {module}")
        if layers is not None and layer not in layers:  # PEFT leaves such a layer's weights unloaded: so would the answer
            raise invalid(f"{name} has weights but adapter_config.json layers_to_transform {sorted(layers)} does not list "
                          f"layer {layer}; drop its weights or list the layer")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise invalid(f"{name} lora_{which} has dtype {tensor.dtype}; LoRA weights must be float16, bfloat16, float32 "
                          "or float64")
        if shapes is None:  # no base at hand: the rank dimension alone
            if tensor.dim() != 2 or tensor.shape[0 if which == "A" else 1] != rank:
                want = "[r, in]" if which == "A" else "[out, r]"
                raise invalid(f"{name} lora_{which}: expected {want} with r={rank}, found {list(tensor.shape)}")
        else:
            in_f, out_f = shapes[module]
            want = [rank, in_f] if which == "A" else [out_f, rank]
            if list(tensor.shape) != want:
                raise invalid(
                    f"{name} lora_{which}: expected {want} (r={rank}, base {module} {in_f} -> {out_f}), "
                    f"found {list(tensor.shape)}; the adapter does not fit this base model"
                )
        parts.setdefault((layer, module), {})[which] = tensor
    if not _all_finite(list(tensors.values())):
        for key, tensor in sorted(tensors.items()):  # name the first, in the order above
            if not _all_finite([tensor]):
                m = _KEY_RE.match(key)
                raise invalid(f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)} lora_{m.group(4)} holds NaN or infinite values "
                              f"(or, in float64, values past float32's ±{_F32_MAX:.4g}, infinite once served); "
                              "retrain or re-export the adapter")  # fmt: skip

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(parts.items(), key=lambda kv: (kv[0][0], LORA_TARGETS.index(kv[0][1]))):
        if set(ab) != {"A", "B"}:
            lacking = "lora_B" if "A" in ab else "lora_A"
            raise invalid(f"layers.{layer}.{PROJECTION_PARENT[module]}.{module} has no {lacking}.weight; the file is incomplete")
        weights[(layer, module)] = (ab["A"], ab["B"])
    present = {module for _, module in weights}
    unused = [t for t in targets if t not in present]
    if unused:
        raise invalid(f"adapter_config.json targets {unused} but adapter_model.safetensors holds no weights for them")
    return LoraAdapter(
        sha256=sha256,
        rank=rank,
        alpha=alpha,
        use_rslora=rslora,
        scaling=alpha / math.sqrt(rank) if rslora else alpha / rank,
        target_modules=tuple(t for t in LORA_TARGETS if t in targets),
        weights=weights,
    )


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of `tensors` is finite: aminmax per dtype (NaN and infinities reach the min or the max), over
    one view of all of them where read_safetensors laid them out back to back. isfinite(...).all() on bf16 took 4.8 ms for
    a 6.4 MB llama-1b adapter on the CPU against 0.28 for aminmax: most of a store read (issue 19)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        # float64 is served in float32 or narrower (adapter_pages): a finite 1e300 there is inf in the engine
        limit = _F32_MAX if dtype == torch.float64 else math.inf
        whole = _one_view(ts)
        for t in [whole] if whole is not None else ts:
            if t.numel() and not all(math.isfinite(v) and abs(v) <= limit for v in torch.aminmax(t.reshape(-1))):
                return False
    return True


def _one_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `tensors` (one dtype) if they are views of one buffer lying back to back, else None."""
    # by (offset, size) alone: unaligned tensors are copies of their own at offset 0, and a tie went on to compare two
    # tensors (RuntimeError) for a file whose header is not padded to 8 bytes
    spans = sorted(((t.storage_offset(), t.numel(), t) for t in tensors), key=lambda span: span[:2])
    first = spans[0][2]
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for _, _, t in spans):
        return None
    if any(o + n != spans[i + 1][0] for i, (o, n, _) in enumerate(spans[:-1])):
        return None
    start, total = spans[0][0], sum(n for _, n, _ in spans)
    return first.as_strided((total,), (1,), start)


def read_safetensors(data: bytes | bytearray, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, the header's __metadata__) of a safetensors file's bytes, each tensor a view of `data` (no copy).

    The format (github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets: [begin, end]}} and `__metadata__`, then the tensors' bytes, back to back, offsets
    counted from the end of the header. Checked as the safetensors library checks it (every tensor's bytes within the
    file and of its shape's size, the tensors covering the data exactly); a failed check is AdapterError
    adapter_corrupt naming the file. Views rather than `safetensors.torch.load`'s copies: a store read runs on read-ahead
    threads beside the engine thread, and that copy held the GIL (issue 19). `bytes` are copied once into a writable
    buffer (torch views need one); readers of files pass a bytearray."""

    def corrupt(what: str) -> AdapterError:
        return AdapterError(f"{path} is corrupt or truncated ({what}); re-save or re-download the adapter", code="adapter_corrupt")

    if len(data) < 8:
        raise corrupt(f"{len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise corrupt(f"the header says {n} bytes, the file holds {len(data) - 8} after the length")
    if n > MAX_HEADER_BYTES:
        raise corrupt(f"a header of {n:,} bytes, over the {MAX_HEADER_BYTES:,} the safetensors library reads; keep "
                      "__metadata__ small")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and int()'s own for a number of over 4,300 digits
        raise corrupt(f"the header is not valid JSON: {_json_error(e)}") from e
    except RecursionError:  # the decoder nests a call per array or object: 200,000 '[' raised past every caller's except
        raise corrupt("the header's JSON nests arrays or objects thousands deep") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise corrupt("__metadata__ must map names to strings")
    size = len(data) - 8 - n
    if isinstance(data, bytes):
        data = bytearray(data)
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    entries = []
    for name, info in header.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape, offsets = info["shape"], info["data_offsets"]
        except (KeyError, TypeError) as e:
            raise corrupt(f"tensor {_cut(name)}: a dtype this torch knows, a shape and two data_offsets are needed "
                          f"({_SHOWN.repr(e)})") from e
        # whole numbers only, as the safetensors library reads them: int() took 8.7 as 8 and "04" as [0, 4], and raised
        # OverflowError (past every caller's except) on 1e999, which json reads as an infinite float
        if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
            raise corrupt(f"tensor {_cut(name)}: shape {_SHOWN.repr(shape)} and data_offsets {_SHOWN.repr(offsets)} must be lists of "
                          "whole numbers (data_offsets two of them)")
        begin, end = offsets
        if not all(0 <= d < 1 << 63 for d in shape) or not 0 <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"tensor {_cut(name)}: data_offsets {[begin, end]} do not hold {info['dtype']} {_SHOWN.repr(shape)} within "
                          f"{size} bytes")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    covered = 0
    for begin, end, name, _, _ in entries:
        if begin != covered:
            raise corrupt(f"tensor {_cut(name)} starts at {begin}, the bytes before it end at {covered}")
        covered = end
    if covered != size:
        raise corrupt(f"the tensors cover {covered} of the {size} data bytes")
    tensors = {}
    for begin, end, name, dtype, shape in entries:
        view = raw[8 + n + begin : 8 + n + end]
        if (8 + n + begin) % dtype.itemsize:
            view = view.clone()  # unaligned (other writers than safetensors'): a dtype view needs an aligned start
        tensors[name] = view.view(dtype).view(shape)
    return tensors, metadata


def _cut(name: str) -> str:
    """A name from a file as an error shows it: whole up to 160 characters, else its start and its length."""
    return name if len(name) <= 160 else f"{name[:160]}... ({len(name):,} characters)"


def _json_error(e: ValueError) -> str:
    """What json.loads found wrong. A number of more than 4,300 digits is refused by int() with a plain ValueError (Python
    3.11's limit on int-string conversion), not a JSONDecodeError: it went past the excepts of every caller, aborting a
    whole `lorabatch adapters add --dir` call."""
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return str(e)
    return "a number of more than 4,300 digits, which no field takes"


def _finite_number(x: object) -> bool:
    """An int or float finite as a float: math.isfinite(10**400) raises OverflowError, which went past every caller."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _int_list(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _check_fingerprint(in_config: str | None, in_weights: str | None, base: str, source: Path) -> None:
    if in_config is not None and in_weights is not None and in_config != in_weights:
        raise AdapterError(
            f"{source}: adapter_config.json records {FINGERPRINT_KEY}={in_config} but the safetensors metadata "
            f"records {in_weights}; re-export the adapter with one base",
            code="adapter_base_mismatch",
        )
    recorded = in_config or in_weights
    if recorded is not None and recorded != base:
        raise AdapterError(
            f"{source}: the adapter was trained for base fingerprint {recorded}, but this engine serves {base}; "
            "load it on the base it was trained for, or retrain it on this one",
            code="adapter_base_mismatch",
        )


def _parse_config(data: bytes, path: Path, max_lora_rank: int
                  ) -> tuple[int, float, bool, tuple[str, ...], str | None, frozenset[int] | None, frozenset[str]]:
    """(rank, alpha, use_rslora, target_modules less exclude_modules, base fingerprint or None, layers_to_transform or
    None: every layer, exclude_modules) of a LoRA adapter_config.json this engine can run."""
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path} holds {len(data):,} bytes, over the {MAX_CONFIG_BYTES:,} an adapter config may hold (PEFT "
                           "writes about 1 KB); keep only PEFT's fields in it", code="adapter_invalid")  # fmt: skip
    try:
        cfg = json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and int()'s own for a number of over 4,300 digits
        raise AdapterError(f"{path} is not valid JSON ({_json_error(e)}); re-save the adapter with peft", code="adapter_corrupt") from e
    except RecursionError:  # arrays or objects nested thousands deep: it went past every caller's except
        raise AdapterError(f"{path} nests JSON arrays or objects thousands deep; re-save the adapter with peft",
                           code="adapter_corrupt") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} must hold a JSON object; re-save the adapter with peft", code="adapter_corrupt")

    def refuse(what: str) -> AdapterError:
        return AdapterError(f"{path}: {what}", code="adapter_invalid")

    if cfg.get("peft_type") != "LORA":
        raise refuse(f"peft_type={_SHOWN.repr(cfg.get('peft_type'))}; only LORA adapters are served")
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):  # before modules_to_save, which PEFT fills with such a task's head ("score", ...)
        raise refuse(f"task_type={_SHOWN.repr(task)}: the adapter was trained for another head than the base's LM head (a classifier, "
                     "embeddings, ...); only CAUSAL_LM adapters generate text: train it with task_type CAUSAL_LM")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r={_SHOWN.repr(rank)}; the rank must be a positive integer")
    if rank > max_lora_rank:
        raise AdapterError(
            f"{path}: r={rank} is over engine.max_lora_rank={max_lora_rank}; "
            f"raise max_lora_rank or use an adapter of rank <= {max_lora_rank}",
            code="adapter_rank_too_large",
        )
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if not _finite_number(alpha):
        raise refuse(f"lora_alpha={_SHOWN.repr(alpha)}; it must be a finite number (PEFT's default is 8)")
    if cfg.get("fan_in_fan_out", False):
        raise refuse("fan_in_fan_out=true is for GPT-2 style Conv1D layers; Llama projections need false")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"bias={_SHOWN.repr(cfg['bias'])}; only 'none' is supported (trained biases would change the base model)")
    if cfg.get("use_dora", False):
        raise refuse("use_dora=true: DoRA adapters are not supported; merge or retrain as plain LoRA")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise refuse(f"{field} is set; per-module ranks or alphas are not supported yet, use one r and lora_alpha")
    if cfg.get("modules_to_save"):
        raise refuse(f"modules_to_save={_SHOWN.repr(cfg['modules_to_save'])}: fully trained extra modules cannot share one base; drop them")
    # PEFT options that change more than the targeted projections: served as plain LoRA, the output would differ from PEFT's
    if cfg.get("layer_replication"):
        raise refuse(f"layer_replication={_SHOWN.repr(cfg['layer_replication'])} stacks the base's layers into another model, which one "
                     "shared base cannot be; train the adapter without it")
    if cfg.get("lora_bias", False):
        raise refuse("lora_bias=true: a bias on lora_B is not supported; train the adapter with lora_bias=false")
    if cfg.get("trainable_token_indices"):
        raise refuse("trainable_token_indices is set: trained embedding rows cannot share one base; train the adapter without it")
    raw = cfg.get("target_modules")
    if isinstance(raw, str):
        if raw not in PROJECTION_PARENT:  # PEFT reads a string as a regex (or 'all-linear'); only plain names are accepted
            raise refuse(f"target_modules={_SHOWN.repr(raw)} is a pattern; list the module names instead, from {list(LORA_TARGETS)}")
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise refuse(f"target_modules={_SHOWN.repr(raw)}; list the targeted modules, from {list(LORA_TARGETS)}")
    unknown = [t for t in raw if not isinstance(t, str) or t not in PROJECTION_PARENT]  # str first: a list is unhashable
    if unknown:
        raise refuse(f"unknown target module {_SHOWN.repr(unknown[0])} in target_modules; supported: {', '.join(LORA_TARGETS)}")
    excluded = cfg.get("exclude_modules") or []  # PEFT 0.14+: modules of target_modules left unadapted
    names = excluded  # PEFT reads a string as a regex over the whole module path: refused with the patterns
    if not isinstance(names, list) or any(not isinstance(n, str) or n not in PROJECTION_PARENT for n in names):
        raise refuse(f"exclude_modules={_SHOWN.repr(excluded)}; only whole projection names ({', '.join(LORA_TARGETS)}) can be "
                     f"excluded here, not patterns or single layers' paths: drop them from target_modules instead")
    raw = [t for t in raw if t not in names]
    if not raw:
        raise refuse(f"exclude_modules={_SHOWN.repr(excluded)} excludes every module of target_modules: the adapter adapts nothing")
    fingerprint = cfg.get(FINGERPRINT_KEY)
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise refuse(f"{FINGERPRINT_KEY}={_SHOWN.repr(fingerprint)}; it must be the base fingerprint, a hex string")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):  # bool() of the string "false" is True: a wrong scaling, silently
        raise refuse(f"use_rslora={_SHOWN.repr(rslora)}; it must be true or false (a JSON boolean)")
    layers = cfg.get("layers_to_transform")
    if layers is not None:
        listed = [layers] if isinstance(layers, int) else layers
        if not isinstance(listed, list) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in listed):
            raise refuse(f"layers_to_transform={_SHOWN.repr(layers)}; it must be a layer index or a list of them (or null: every layer)")
        layers = frozenset(listed)
    return rank, float(alpha), rslora, tuple(raw), fingerprint, layers, frozenset(names)
