"""Hugging Face checkpoints: reading a model folder and mapping its tensors onto the model of engine.model.

A folder holds `config.json` (read into `ModelConfig`), `tokenizer.json`, optionally `generation_config.json`
(EOS ids as HF `generate` sees them), and the weights as `model.safetensors` or shards listed by
`model.safetensors.index.json`; safetensors only (no pickles). The tensors keep HF's names
(`model.layers.3.self_attn.q_proj.weight`, ...): `build_model` checks them strictly against the config
(`hf_param_shapes`) and concatenates them into the model's fused projections (`fuse_hf_state`, engine.model
"Fused projections"); `unfuse_state` gives the HF names back as views (the bench's peer shares our weights that
way). `base_fingerprint` names the architecture and vocabulary of a folder (engine.model "Base fingerprint").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.api import EngineError
from engine.model import FUSED_PARENT, FUSED_PROJECTIONS, PROJECTION_PARENT, LlamaForCausalLM, ModelConfig
from engine.quant import FP8, QUANT_METHOD, Fp8Linear, quantize_fp8
from engine.rope import inv_frequencies


def read_json_object(path: Path) -> dict:
    """The JSON object in the model folder's file `path`; EngineError (model_invalid) naming the file when it is not
    one (a download cut short, an edit by hand), where a JSONDecodeError or an AttributeError ended the start."""
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path} is not valid JSON ({e}); download or re-save the model folder's file",
                          code="model_invalid") from e
    except OSError as e:
        raise EngineError(f"{path} cannot be read ({e.strerror}); check its permissions", code="model_invalid") from e
    if not isinstance(data, dict):
        raise EngineError(f"{path} holds a JSON {type(data).__name__}, not an object; download or re-save the model "
                          f"folder's file", code="model_invalid")
    return data


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EngineError(f"{path} is missing; engine.model_dir must be a Hugging Face model folder", code="model_missing")
    data = read_json_object(path)
    try:
        return ModelConfig.from_hf(data, source=str(path))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"{path} is not a usable model config ({type(e).__name__}: {e}); re-save it with transformers", code="model_invalid") from e


def base_fingerprint(model_dir: Path) -> str:
    """The base fingerprint (module docstring) of a model folder: its config.json and tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise EngineError(f"{path} is missing; the base fingerprint covers the tokenizer", code="model_missing")
    return read_model_config(model_dir).fingerprint(path.read_bytes())


def read_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids as HF `generate` sees them: generation_config.json first, else config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = read_json_object(path).get("eos_token_id")
            if eos is None:
                continue
            ids = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise EngineError(f"{path}: eos_token_id = {json.dumps(eos)} is not a token id or a list of them; "
                                  f"re-save it with transformers", code="model_invalid")
            return tuple(ids)
    return ()


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, weight_dtype: str = "auto") -> LlamaForCausalLM:
    """Build the model of `model_dir` on `device` in `dtype` from its safetensors, with a strict key check. The
    projections are FP8 (engine.quant) when `weight_dtype` is "fp8" or the folder is an FP8 one (`is_fp8_folder`)."""
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir)
    folder_fp8 = is_fp8_folder(model_dir)
    state = _read_safetensors(model_dir)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints carry it
    try:
        return build_model(cfg, state, device, dtype, fp8=weight_dtype == "fp8" or folder_fp8, fp8_state=folder_fp8)
    except EngineError as e:
        raise EngineError(f"{model_dir}: {e}", code=e.code) from e


def is_fp8_folder(model_dir: Path) -> bool:
    """Whether `model_dir`'s config.json says its projections are stored in FP8 (engine.quant); EngineError for a
    quantization this engine does not read."""
    path = Path(model_dir) / "config.json"
    try:
        q = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False  # read_model_config says what is wrong with it
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != QUANT_METHOD:
        raise EngineError(f"{path}: quantization_config.quant_method={method!r} is not supported; the engine reads "
                          f"{QUANT_METHOD!r} folders (FP8 e4m3 weights, a scale per output channel), or quantizes a bf16 "
                          "checkpoint itself with engine.weight_dtype = \"fp8\"", code="model_invalid")  # fmt: skip
    return True


def hf_param_shapes(cfg: ModelConfig, *, fp8: bool = False) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of a checkpoint of `cfg` (lm_head.weight absent when the embeddings are tied); with
    `fp8`, an FP8 folder's: each projection's weight_scale [out, 1] too."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    bias = {"q_proj": cfg.qkv_bias, "k_proj": cfg.qkv_bias, "v_proj": cfg.qkv_bias, "o_proj": cfg.o_bias,
            "gate_proj": cfg.mlp_bias, "up_proj": cfg.mlp_bias, "down_proj": cfg.mlp_bias}  # fmt: skip
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        for module, (in_f, out_f) in cfg.projection_shapes().items():
            shapes[f"{p}.{PROJECTION_PARENT[module]}.{module}.weight"] = (out_f, in_f)
            if fp8:
                shapes[f"{p}.{PROJECTION_PARENT[module]}.{module}.weight_scale"] = (out_f, 1)
            if bias[module]:
                shapes[f"{p}.{PROJECTION_PARENT[module]}.{module}.bias"] = (out_f,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def fuse_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the model's: q, k, v rows concatenated into qkv_proj, gate and up into gate_up_proj."""
    out = dict(state)
    for p, fused, parts, kind in _multi_part_params(cfg):
        keys = [f"{p}.{part}.{kind}" for part in parts]
        if keys[0] in out:
            out[f"{p}.{fused}.{kind}"] = torch.cat([out.pop(k) for k in keys])
    return out


def unfuse_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors -> HF names, the fused ones split into views (no copy): the inverse of fuse_hf_state."""
    out = dict(state)
    widths = {module: out_f for module, (_, out_f) in cfg.projection_shapes().items()}
    for p, fused, parts, kind in _multi_part_params(cfg):
        tensor = out.pop(f"{p}.{fused}.{kind}", None)
        if tensor is None:
            continue
        row = 0
        for part in parts:
            out[f"{p}.{part}.{kind}"] = tensor[row : row + widths[part]]
            row += widths[part]
    return out


def _multi_part_params(cfg: ModelConfig) -> Iterator[tuple[str, str, tuple[str, ...], str]]:
    """(parent prefix, fused projection, its HF projections, "weight" or "bias") of every fused parameter that joins
    several HF ones (qkv and gate_up), layer by layer."""
    for i in range(cfg.num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            if len(parts) > 1:
                for kind in ("weight", "bias", "weight_scale"):
                    yield f"model.layers.{i}.{FUSED_PARENT[fused]}", fused, parts, kind


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, *,
                fp8: bool = False, fp8_state: bool = False) -> LlamaForCausalLM:
    """The model of `cfg` holding `state` (HF names; lm_head.weight may be absent when tied), on `device` in `dtype`;
    with `fp8`, the projections FP8 (engine.quant): `state`'s own FP8 weights and scales with `fp8_state` (an FP8
    folder), else quantized here from its weights as they are stored."""
    if cfg.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    shapes = hf_param_shapes(cfg, fp8=fp8_state)
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise EngineError(
            f"checkpoint does not match a {cfg.model_type} model with this config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; check that config.json and the safetensors belong together",
            code="model_invalid",
        )
    for key, tensor in state.items():
        want = shapes[key]
        if tuple(tensor.shape) != want:
            raise EngineError(f"{key} expected {list(want)}, found {list(tensor.shape)}", code="model_invalid")
    projection = re.compile(r"^model\.layers\.\d+\.\w+\.\w+_proj\.(weight|weight_scale)$")
    if fp8_state:
        for key, tensor in state.items():
            if key.endswith("_proj.weight") and tensor.dtype != FP8:
                raise EngineError(f"{key} is {tensor.dtype}, not float8_e4m3fn, in a folder whose quantization_config "
                                  f"says {QUANT_METHOD}; re-export it", code="model_invalid")  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # The projections' weights stay where and as they are stored until they become FP8 (quantized from the
    # checkpoint's own precision, one fused projection at a time, then moved: a model whose bf16 weights would not fit
    # the device loads in FP8), or already FP8 with fp32 scales; everything else is cast to the engine's dtype and moved.
    fused = fuse_hf_state(cfg, {k: v if fp8 and projection.match(k) else v.to(device=device, dtype=dtype)
                                for k, v in state.items()})  # fmt: skip
    made: set[str] = _make_fp8(model, fused, device, dtype) if fp8 else set()
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()) - made
    assert set(fused) == expected, (sorted(set(fused) ^ expected)[:5], "fuse_hf_state and the model disagree")
    model.load_state_dict(fused, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope, device=device)
    return model.eval()


def _make_fp8(model: LlamaForCausalLM, fused: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> set[str]:
    """Replace each layer's projections by Fp8Linear modules on `device` made from (and taken out of) `fused`; return
    the state_dict keys they hold (set here, not loaded)."""
    made = set()
    for i, layer in enumerate(model.model.layers):
        for name, parent in FUSED_PARENT.items():
            p = f"model.layers.{i}.{parent}.{name}"
            weight, bias, scale = fused.pop(f"{p}.weight"), fused.pop(f"{p}.bias", None), fused.pop(f"{p}.weight_scale", None)
            bias = None if bias is None else bias.to(device)
            if scale is None:  # on the device, one projection at a time: its full-precision copy is freed at once
                q, scale = quantize_fp8(weight.to(device))
            else:
                q = weight
            module = Fp8Linear(q.to(device), scale.reshape(-1).float().to(device), bias, dtype)
            setattr(getattr(layer, parent), name, module)
            made |= {f"{p}.{k}" for k in module.state_dict()}
    return made


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise EngineError(f"{index} has no weight_map of tensor names to files; download or re-save the model "
                              f"folder's file", code="model_invalid")
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise EngineError(
                f"{path} is missing; the engine loads safetensors weights only (convert .bin checkpoints first)",
                code="model_missing",
            )
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:  # a download cut short, a file overwritten
            raise EngineError(f"{path} is not a readable safetensors file ({e}); download it again",
                              code="model_invalid") from e
    return state
