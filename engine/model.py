"""A plain Llama decoder over a flat token batch, loaded from a Hugging Face folder.

The forward takes every scheduled token of every sequence as one flat batch (`input_ids [N]`,
`positions [N]`, no padding): prefill chunks and single decode tokens sit side by side, and only the
attention needs to know where one sequence ends (`AttentionMetadata`). Parameter names follow HF's
(`model.layers.3.self_attn.q_proj.weight`, ...) so the checkpoint loads with a strict key check.

The model knows nothing of LoRA: `engine.lora.apply_lora` wraps the projections after the build, as
gpt-fast applies tensor parallelism (STYLE item 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from engine.api import EngineError
from engine.attention import AttentionMetadata, paged_attention

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each projection's parent module in a decoder layer (HF names): layers.N.<parent>.<projection>
PROJECTION_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                     "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """The few fields of an HF Llama `config.json` the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict, *, source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type != "llama":
            raise EngineError(
                f"{source}: model_type={model_type!r} is not supported; this engine runs Llama-family "
                "models with model_type 'llama' (point engine.model_dir at one)",
                code="model_unsupported",
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise EngineError(f"{source}: hidden_act={cfg['hidden_act']!r}; only 'silu' is supported", code="model_unsupported")
        # transformers 5 writes rope settings as `rope_parameters`, older versions as rope_theta + rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise EngineError(
                f"{source}: rope scaling {rope_type!r} is not supported yet; only plain RoPE (rope_type 'default')",
                code="model_unsupported",
            )
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim]
        # The mean square runs in fp32 even for bf16 activations, as HF's LlamaRMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] for each token's position (HF's non-interleaved half-split layout)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, head_dim / 2], fp32: positions up to 1e5 stay exact
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, head_dim]; cos, sin [N, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]  # x [N, hidden]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KV, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KV, D]
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, self.layer_idx, attn)  # [N, H, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))  # [N, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, every sequence's new tokens back to back
        positions: torch.Tensor,  # [N] int64, each token's position in its sequence
        attn: AttentionMetadata,
        logit_rows: torch.Tensor | None = None,  # [M] int64 rows to compute logits for; None: all N
    ) -> torch.Tensor:
        """Logits [M, vocab] in fp32 for the selected rows (usually each sequence's last token)."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)  # [N, D] each
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        if logit_rows is not None:
            x = x[logit_rows]  # [M, hidden]; the norm is per row, so selecting first changes nothing
        return self.lm_head(self.model.norm(x)).float()  # [M, vocab]


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EngineError(f"{path} is missing; engine.model_dir must be a Hugging Face model folder", code="model_missing")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()), source=str(path))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise EngineError(f"{path} is not a usable Llama config ({type(e).__name__}: {e}); re-save it with transformers", code="model_invalid") from e


def read_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids as HF `generate` sees them: generation_config.json first, else config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and load its safetensors with a strict key check."""
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir)
    state = _read_safetensors(model_dir)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints carry it
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise EngineError(
            f"{model_dir}: checkpoint does not match a Llama with this config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; check that config.json and the safetensors belong together",
            code="model_invalid",
        )
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        want = shapes[key]
        if tensor.shape != want:
            raise EngineError(f"{model_dir}: {key} expected {list(want)}, found {list(tensor.shape)}", code="model_invalid")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
        state.update(load_file(str(path)))
    return state
