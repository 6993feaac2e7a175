"""A plain Llama-family decoder over a flat token batch, loaded from a Hugging Face folder.

Architectures: Llama 2/3 (`model_type` llama, with default, linear or llama3 RoPE scaling), Mistral
(mistral) and Qwen2 (qwen2: biases on q, k and v), tied embeddings or not. They differ only in the
config fields read below; the layer code is one.

Sliding-window attention (Mistral, Qwen2 with use_sliding_window) is not implemented: attention always
sees the whole context, which equals sliding-window attention exactly while a sequence fits in the
window. The engine refuses a model whose window is shorter than its longest possible sequence
(max_prompt_tokens + max_new_tokens) rather than compute something else (`check_sliding_window`).

The forward takes every scheduled token of every sequence as one flat batch (`input_ids [N]`,
`positions [N]`, no padding): prefill chunks and single decode tokens sit side by side, and only the
attention needs to know where one sequence ends (`AttentionMetadata`).

Fused projections, as gpt-fast's `wqkv` and vLLM's QKV/merged-column layers: q, k and v are one
`qkv_proj` ([q | k | v] rows) and gate and up one `gate_up_proj` ([gate | up]). A decode step is bound
by launches as much as by bytes: at llama-1b, batch 32, each of these GEMMs streams 8-33 MB in 2-8 µs,
and every launch saved is 2-5 µs; the LoRA kernels likewise add one shrink and one expand for all of
q, k and v together (kernels/lora_shrink.py, "Fused projections"). The checkpoint keeps HF's names
(`model.layers.3.self_attn.q_proj.weight`, ...); engine.checkpoint reads it and maps those names onto these.

The model knows nothing of LoRA: `engine.lora.apply_lora` wraps the projections after the build, as
gpt-fast applies tensor parallelism (STYLE item 3).

Base fingerprint (`ModelConfig.fingerprint`): sha256 over b"lorabatch-base-v1\n", the canonical JSON of
the fields that define what the network computes (everything in ModelConfig but
max_position_embeddings, normalised, so transformers 4's `rope_scaling` and 5's `rope_parameters`
spellings agree), and the sha256 of tokenizer.json. It names the architecture and the vocabulary an
adapter was trained against (its shapes and token ids mean nothing elsewhere), not one checkpoint of
weights: hashing 16 GB of weights at every start would cost more than the check is worth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.api import EngineError
from engine.attention import AttentionMetadata, attend, write_kv
from engine.rope import ROPE_TYPES, RopeConfig, apply_rope, rope_cos_sin

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's projections and the HF projections (slices, in row order) each one holds.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                     "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip
FUSED_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
# Each projection's parent module in a decoder layer (HF names): layers.N.<parent>.<projection>
PROJECTION_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                     "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
MODEL_TYPES = ("llama", "mistral", "qwen2")
_FINGERPRINT_DOMAIN = b"lorabatch-base-v1\n"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF `config.json` the engine uses, normalised over the supported architectures."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    model_type: str = "llama"
    sliding_window: int | None = None  # None: full attention in every layer

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @classmethod
    def from_hf(cls, cfg: dict, *, source: str = "config.json") -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise EngineError(
                f"{source}: model_type={model_type!r} is not supported; this engine runs {', '.join(MODEL_TYPES)} "
                "models (point engine.model_dir at one)",
                code="model_unsupported",
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise EngineError(f"{source}: hidden_act={cfg['hidden_act']!r}; only 'silu' is supported", code="model_unsupported")
        heads = cfg["num_attention_heads"]
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False  # Qwen2Attention: bias on q, k, v only
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        elif model_type == "mistral":
            qkv_bias = o_bias = mlp_bias = False
            window = cfg.get("sliding_window")
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = bool(cfg.get("mlp_bias", False))
            window = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope=_rope_config(cfg, source),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            model_type=model_type,
            sliding_window=int(window) if window is not None else None,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }  # fmt: skip

    def fingerprint(self, tokenizer_json: bytes) -> str:
        """The base fingerprint of the module docstring."""
        fields = dataclasses.asdict(self)
        del fields["max_position_embeddings"]
        h = hashlib.sha256(_FINGERPRINT_DOMAIN)
        h.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
        h.update(hashlib.sha256(tokenizer_json).digest())
        return h.hexdigest()

    def check_sliding_window(self, max_sequence_tokens: int) -> None:
        """Refuse a window shorter than the longest sequence the engine may run (see the module docstring)."""
        if self.sliding_window is not None and self.sliding_window < max_sequence_tokens:
            raise EngineError(
                f"the model uses sliding-window attention over {self.sliding_window} tokens, but sequences may reach "
                f"{max_sequence_tokens} tokens (engine.max_prompt_tokens + engine.max_new_tokens) and this engine "
                f"attends over the whole context; lower those limits to at most {self.sliding_window} tokens together",
                code="model_unsupported",
            )


def _rope_config(cfg: dict, source: str) -> RopeConfig:
    # transformers 5 writes rope settings as `rope_parameters`, older versions as rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in ROPE_TYPES:
        raise EngineError(
            f"{source}: rope scaling {rope_type!r} is not supported; only {', '.join(ROPE_TYPES)} RoPE",
            code="model_unsupported",
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise EngineError(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported", code="model_unsupported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(rope["factor"]))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


@dataclass(frozen=True)
class ModelOps:
    """The model's non-GEMM ops: composite torch (the default, and the CPU path) or fused Triton kernels.

    The runner swaps in the kernels of `kernels/` when the engine runs the triton backend (engine.backend):
    residual add + RMSNorm in one launch (kernels/rms_norm.py), RoPE of q and k + the KV-cache write in one
    (kernels/rope_cache.py), SiLU x up in one (kernels/silu_mul.py). At llama-1b, batch 32, that is ~110 fewer
    launches of a ~270-launch decode step. A decode step (one new token a sequence, the triton attention) also folds
    RoPE and the KV write into the attention launch (kernels/paged_attention.py `decode_rope_attention`). Each kernel's
    torch reference sits beside it; the composite ops here are the model as it always ran, so the CPU path and HF
    parity are unchanged."""

    add_rms_norm: Callable | None = None  # kernels.rms_norm.add_rms_norm
    rope_and_cache: Callable | None = None  # kernels.rope_cache.rope_and_cache
    silu_mul: Callable | None = None  # kernels.silu_mul.silu_mul
    # kernels.paged_attention.decode_rope_attention: a decode step's RoPE, KV write and attention in one launch a layer
    decode_rope_attention: Callable | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: ModelOps = ModelOps()) -> torch.Tensor:
        """rmsnorm(x + residual) [N, dim]; `residual` [N, dim] becomes x + residual, in place (the residual stream)."""
        if ops.add_rms_norm is not None:
            return ops.add_rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # One fused kernel on CUDA (the composite x * rsqrt(mean(x^2) + eps) * w took 8 launches, 2-3 µs each in
        # a decode graph, twice per layer). The mean square runs in fp32 even for bf16 activations, as HF's
        # LlamaRMSNorm does; HF also rounds the normalised x to bf16 before the weight, this rounds once, after it.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.qkv_bias)  # rows [q | k | v]
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionMetadata, ops: ModelOps) -> torch.Tensor:
        n = x.shape[0]  # x [N, hidden]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [N, (H + 2 KV) * D]
        k_pool, v_pool = attn.kv_cache.k[self.layer_idx], attn.kv_cache.v[self.layer_idx]  # [blocks, bs, KV, D]
        if ops.decode_rope_attention is not None and attn.kernel is not None and attn.cu_seqlens_q is None:
            out = ops.decode_rope_attention(qkv, rope.positions, rope.inv_freq, k_pool, v_pool, attn.slot_mapping,
                                            attn.block_table, attn.seq_lens, h)  # fmt: skip
            return self.o_proj(out.view(n, h * d))  # [N, hidden]
        if ops.rope_and_cache is not None:
            q = ops.rope_and_cache(qkv, rope.positions, rope.inv_freq, k_pool, v_pool, attn.slot_mapping, h)  # [N, H, D]
        else:
            qk = apply_rope(qkv[:, : (h + kv) * d].view(n, h + kv, d), rope.cos, rope.sin)  # [N, H + KV, D]: q and k in one pass
            q = qk[:, :h]
            write_kv(k_pool, v_pool, qk[:, h:], qkv[:, (h + kv) * d :].view(n, kv, d), attn.slot_mapping)
        out = attend(q, self.layer_idx, attn)  # [N, H, D]
        return self.o_proj(out.reshape(n, h * d))  # [N, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # rows [gate | up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:  # [N, hidden]
        gate_up = self.gate_up_proj(x)  # [N, 2 I]
        if ops.silu_mul is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        i = self.intermediate_size
        return self.down_proj(F.silu(gate_up[:, :i]) * gate_up[:, i:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs, attn: AttentionMetadata,
                ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this layer's MLP output, the residual stream before it is added) [N, hidden] each; the caller adds
        them, fused with the next norm. `residual` None: x is the embeddings, and starts the stream."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x, None, ops)
        else:
            h = self.input_layernorm(x, residual, ops)  # residual += x
        h = self.self_attn(h, rope, attn, ops)
        h = self.post_attention_layernorm(h, residual, ops)  # residual += attention output
        return self.mlp(h, ops), residual


@dataclass
class RopeInputs:
    """What the layers' RoPE reads: the positions and inv_freq (the fused kernel computes cos/sin itself), or
    the cos/sin tables the composite path builds once per forward."""

    positions: torch.Tensor  # [N] int64
    inv_freq: torch.Tensor  # [D / 2] fp32
    cos: torch.Tensor | None = None  # [N, D]
    sin: torch.Tensor | None = None  # [N, D]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # The weight passed in: nn.Embedding's own init (normal_) on the meta device goes through torch's reference ops,
        # whose first use imports torch._dynamo (3 s of every engine start on the CPU); the checkpoint's weights replace it.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq: torch.Tensor | None = None  # [head_dim / 2] fp32, set by engine.checkpoint.build_model on the weights' device
        self.ops = ModelOps()  # composite torch ops; the runner sets the fused kernels on the triton backend

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, every sequence's new tokens back to back
        positions: torch.Tensor,  # [N] int64, each token's position in its sequence
        attn: AttentionMetadata,
        logit_rows: torch.Tensor | None = None,  # [M] int64 rows to compute logits for; None: all N
    ) -> torch.Tensor:
        """Logits [M, vocab] in fp32 for the selected rows (usually each sequence's last token)."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        assert self.inv_freq is not None, "build the model with engine.checkpoint's build_model or load_model"
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        ops = self.ops
        rope = RopeInputs(positions, self.inv_freq)
        if ops.rope_and_cache is None:
            rope.cos, rope.sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # [N, D] each
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, attn, ops)
        if logit_rows is not None:
            # [M, hidden]; the final add and norm are per row, so selecting first changes nothing
            x, residual = x[logit_rows], residual[logit_rows]
        return self.lm_head(self.model.norm(x, residual, ops)).float()  # [M, vocab]
