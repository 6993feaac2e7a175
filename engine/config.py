"""The engine's configuration: one frozen, validated object built once at the process edge."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# The fields a CUDA engine derives from its device when the configuration leaves them unset (engine.sizing): a
# configuration written out should leave them unset too, or the file fixes the CPU demo's values on a GPU.
DEVICE_SIZED = ("max_batch_size", "kv_num_blocks", "adapter_gpu_bytes", "max_loras", "adapter_read_processes",
                "adapter_read_threads", "adapter_loads_per_s", "adapter_load_burst")  # fmt: skip

GiB = 1 << 30
MiB = 1 << 20


def no_bool_for_number(cls: type[BaseModel], value: object, info: ValidationInfo) -> object:
    """A configuration field's before-validator: TOML's true or false where a number goes is refused. Pydantic's lax
    mode read them as 1 and 0, so `max_new_tokens = true` served every job one token, silently."""
    if isinstance(value, bool) and info.field_name is not None:
        annotation = cls.model_fields[info.field_name].annotation
        if bool not in (annotation, *get_args(annotation)) and {int, float} & {annotation, *get_args(annotation)}:
            raise ValueError(f"{str(value).lower()} is a boolean, not a number; write the number")
    return value


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _no_bool_for_number = field_validator("*", mode="before")(no_bool_for_number)

    model_dir: str = Field(".lorabatch/demo-model", min_length=1, description="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when a GPU is visible, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bfloat16 on cuda, float32 on cpu")
    weight_dtype: Literal["auto", "fp8"] = Field("auto", description="the projections' stored weights: auto, as the "
                                                 "checkpoint has them (FP8 for a folder whose quantization_config says "
                                                 "fbgemm_fp8, else `dtype`); fp8, quantized at load to e4m3 with a scale "
                                                 "per output channel (embeddings, norms, LM head and adapters keep `dtype`)")

    # ---- compute backend (engine.backend)
    kernel_backend: Literal["auto", "triton", "torch"] = Field(
        "auto",
        description="LoRA and attention ops: triton kernels (auto on cuda) or the pure-torch references (auto on cpu); "
        "triton on cpu runs only under TRITON_INTERPRET=1 (tests)",
    )
    decode_lora_in_ops: list[Literal["qkv_proj", "gate_up_proj"]] = Field(
        [],
        description="triton backend, decode steps: the projections whose adapters' delta is added by the op that reads "
        "their output (qkv_proj: RoPE + attention, gate_up_proj: SiLU x up) instead of an expand launch of its own a "
        "layer (engine.lora, \"Decode\"); none by default: on an H100 the two together made a decode step with adapters "
        "6% slower than their own launches, at llama-1b and -8b; qkv_proj alone 1-2%, gate_up_proj alone 4-6%",
    )
    decode_lora_overlap: bool = Field(
        True,
        description="triton backend on cuda, decode steps in a CUDA graph: each projection's LoRA shrink runs on a side "
        "stream beside the projection's GEMM (a fork and a join in the graph), so that its latency leaves the step's "
        "critical path; the expand then adds into the GEMM's output (engine.lora, \"Decode\"); on an H100, llama-1b "
        "with 32 adapters of rank 16, a decode step took 2.35 ms with it against 2.42 without",
    )
    cuda_graph_max_batch: int = Field(
        256, ge=0, le=4096,
        description="decode steps of up to this many requests (and max_batch_size) replay a CUDA graph captured once per "
        "batch-size bucket (1, 2, 4, ...); 0 runs every step eagerly; only with the triton backend on cuda",
    )  # fmt: skip
    cuda_graph_prompt_tokens: int = Field(
        2048, ge=0, le=65536,
        description="steps with prompt tokens (prefills, and prompts admitted beside decode rows) of up to this many "
        "tokens (and max_num_batched_tokens) and up to cuda_graph_max_batch requests replay a CUDA graph captured once "
        "per bucket of tokens and longest prompt; eagerly, such a step's kernel launches cost more host time than its "
        "kernels take (at llama-1b ~15 ms against 1-4 ms for a few prompts); 0 runs them eagerly",
    )  # fmt: skip

    decode_steps: int = Field(
        8, ge=1, le=64,
        description="decode steps run back to back on the GPU per scheduling round when every running request is "
        "decoding, none asks for logprobs and none waits (CUDA graphs only); the host reads their tokens once, after it "
        "launched the next round (1: rounds of one step, each still launched before the last is read). Rounds "
        "are cut to the fewest tokens any request has left, so none computes past max_new_tokens; a request that stops "
        "early (EOS, stop string) may have computed up to 2 x decode_steps - 1 tokens it does not keep (the rest of its "
        "round and the next, launched before it was read)",
    )  # fmt: skip
    gc_in_rounds: bool = Field(
        True,
        description="run Python's garbage collector's passes while a decode round is in flight, where the automatic "
        "collector would otherwise fire before the next step, so that a pass rarely falls where the GPU waits for the host "
        "(engine.collector); in the engine's own process, where decode rounds run as CUDA graphs, full passes are left "
        "to it first (generation 2's threshold raised 21-fold as a backstop); gc.freeze and a disabled collector are "
        "left as they are",
    )

    load_ahead_share: float | None = Field(
        0.5, gt=0, le=100,
        description="the host time a step may spend placing the adapters of queued requests in GPU memory ahead of their "
        "admission, as a share of the device time of the work it just launched (a decode round's steps at the last "
        "round's measured step, an eager step's prompt tokens at the measured cost of a prompt token, else the last eager "
        "step's time), and never past where the rest of the host's cycle, as the last chained rounds measured it, would "
        "start after a decode round's end: past it the rest are placed by "
        "later steps, or at admission, so that the GPU does not wait for the host's placements; None (the Python API; in "
        "a TOML file, a large share such as 100): no bound",
    )  # fmt: skip

    gpu_memory_fraction: float = Field(
        0.90, gt=0, le=1,
        description="share of the GPU's memory the engine may take; on CUDA the fields below that the configuration does "
        "not set (max_batch_size, kv_num_blocks, adapter_gpu_bytes, max_loras, the store readers and the admission bucket) "
        "are derived from it and the device at start (engine.sizing; `lorabatch config show` prints them); the CPU keeps "
        "the defaults",
    )  # fmt: skip

    # ---- continuous batching
    max_batch_size: int = Field(32, ge=1, le=4096, description="most requests running at once")
    max_prompt_tokens: int = Field(1024, ge=1, description="longer prompts fail with prompt_too_long")
    max_new_tokens: int = Field(256, ge=1, description="largest max_new_tokens a job may ask for")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens one step computes at most; longer prefills are split into chunks across steps"
    )
    admission_hold_ms: float = Field(
        40.0, ge=0, le=10_000,
        description="while the running batch has work: the longest a step holds back admitting the requests whose "
        "adapters are ready when, with read-ahead threads, fewer than 3/4 of the places the waiting requests could fill "
        "are ready (the others' adapters still being read from the store), or when running requests that reach their "
        "max_new_tokens within a few steps would free more places, so that a batch is admitted in few prompt steps, not "
        "one per read landing or per part of a batch finishing (engine.admission; the default's reasoning is there); 0: "
        "never hold",
    )  # fmt: skip

    # ---- paged KV cache
    kv_block_size: int = Field(16, ge=1, le=256, description="tokens per KV cache block")
    kv_num_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; None sizes it for max_batch_size full-length sequences")
    enable_prefix_caching: bool = Field(True, description="reuse the KV of full blocks computed before for the same tenant, adapter and tokens")
    kv_tenant_quota: float = Field(
        1.0, gt=0, le=1, description="share of the KV pool the running requests of one tenant may hold together"
    )

    # ---- adapter pool (L1 GPU slots, L2 host cache, L3 store)
    max_loras: int = Field(
        8, ge=1, description="L1: most adapters resident on the device at once (rows of the adapter page tables)"
    )
    max_lora_rank: int = Field(64, ge=1, le=512, description="largest adapter rank accepted")
    adapter_gpu_bytes: int | None = Field(
        None,
        ge=1,
        description="L1: device memory for adapter weights, preallocated at start in pages (an adapter takes its rank over "
        "the modules it targets); None: enough for max_loras adapters of max_lora_rank on all seven projections",
    )
    max_adapter_bytes: int = Field(512 * MiB, ge=1, description="adapter files larger than this are refused")
    adapter_read_threads: int = Field(
        0, ge=0, le=64, description="threads reading the adapters of queued requests from the store ahead of their admission (0: none)"
    )
    adapter_read_processes: int = Field(
        0, ge=0, le=64,
        description="long-lived processes doing those reads (each imports torch once), off the engine process's GIL; "
        "the read-ahead threads then only wait for them and receive the pages (0: the threads read)",
    )  # fmt: skip
    host_cache_bytes: int = Field(2 * GiB, ge=0, description="L2: host memory for adapters' copies, an LRU bounded in bytes; taken at start with a quarter more for "
        "reads in flight (engine.host_arena), pinned on CUDA (about 0.6 ms a MB, once)")
    adapter_loads_per_s: float = Field(
        4.0, gt=0, description="token-bucket rate of adapter reads from the store (L3) (seed 002, incident 1: adapter storms)"
    )
    adapter_load_burst: int = Field(8, ge=1, description="token-bucket depth: store reads allowed back to back")
    adapter_slo_weights: dict[str, float] = Field(
        default_factory=lambda: {"premium": 4.0, "standard": 1.0, "batch": 0.25},
        description="slo_tier -> keep weight in the L1 eviction score; a stricter tier stays resident longer",
    )
    adapter_mem_weight: float = Field(
        1.0, ge=0, description="weight of an adapter's reload cost (its bytes over a slot's) in the eviction score"
    )

    # ---- warm pool (prefetch by predicted traffic, seed 003)
    warm_pool_interval_s: float = Field(60.0, gt=0, description="how often the predictor re-plans the warm set")
    warm_pool_host_bytes: int = Field(512 * MiB, ge=0, description="L2 bytes the warm pool may fill ahead of requests")
    warm_pool_slots: int = Field(2, ge=0, description="free L1 slots the warm pool may fill ahead of requests (it never evicts)")
    warm_pool_min_per_hour: float = Field(1.0, gt=0, description="predicted requests in the next hour below which nothing is prefetched")
    warm_pool_alpha: float = Field(0.3, gt=0, le=1, description="EWMA weight of the latest hour's count")
    warm_pool_recent_weight: float = Field(
        0.6, ge=0, le=1, description="prediction = w * EWMA + (1 - w) * mean count of the same hour on past days"
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.kv_num_blocks is not None:
            need = self.blocks_per_sequence
            if self.kv_num_blocks < need:
                raise ValueError(
                    f"engine.kv_num_blocks={self.kv_num_blocks} cannot hold one sequence of "
                    f"max_prompt_tokens + max_new_tokens = {self.max_prompt_tokens + self.max_new_tokens} tokens "
                    f"at kv_block_size={self.kv_block_size}; set it to at least {need}"
                )
        if "standard" not in self.adapter_slo_weights:
            raise ValueError(
                f"engine.adapter_slo_weights={self.adapter_slo_weights} lacks 'standard', the tier of adapters registered without one"
            )
        bad = {k: v for k, v in self.adapter_slo_weights.items() if not v > 0}
        if bad:
            raise ValueError(f"engine.adapter_slo_weights must be positive, got {bad}")
        return self

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one sequence of max_prompt_tokens + max_new_tokens tokens needs."""
        return -(-(self.max_prompt_tokens + self.max_new_tokens) // self.kv_block_size)

    @property
    def kv_pool_blocks(self) -> int:
        """KV blocks in the pool: kv_num_blocks, or enough for max_batch_size longest sequences."""
        return self.kv_num_blocks or self.max_batch_size * self.blocks_per_sequence
