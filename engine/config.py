"""The engine's configuration: one frozen, validated object built once at the process edge."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str = Field(".lorabatch/demo-model", description="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when a GPU is visible, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bfloat16 on cuda, float32 on cpu")
    max_batch_size: int = Field(32, ge=1, le=4096, description="most requests running at once")
    max_prompt_tokens: int = Field(1024, ge=1, description="longer prompts fail with prompt_too_long")
    max_new_tokens: int = Field(256, ge=1, description="largest max_new_tokens a job may ask for")
    kv_block_size: int = Field(16, ge=1, le=256, description="tokens per KV cache block")
    kv_num_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; None sizes it for max_batch_size full-length sequences")
    max_loras: int = Field(8, ge=1, description="adapters resident at once")
    max_lora_rank: int = Field(64, ge=1, le=512, description="largest adapter rank accepted")
    max_adapter_bytes: int = Field(512 * 1024 * 1024, ge=1, description="adapter files larger than this are refused")

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.kv_num_blocks is not None:
            need = -(-(self.max_prompt_tokens + self.max_new_tokens) // self.kv_block_size)
            if self.kv_num_blocks < need:
                raise ValueError(
                    f"engine.kv_num_blocks={self.kv_num_blocks} cannot hold one sequence of "
                    f"max_prompt_tokens + max_new_tokens = {self.max_prompt_tokens + self.max_new_tokens} tokens "
                    f"at kv_block_size={self.kv_block_size}; set it to at least {need}"
                )
        return self
