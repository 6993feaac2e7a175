"""The ledger's configuration: one frozen, validated object built once at the process edge."""

from __future__ import annotations

from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field


class LedgerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field("sqlite:///.lorabatch/ledger.db", description="SQLAlchemy URL: sqlite:///FILE or postgresql+psycopg://HOST/DB")
    gpu_price_per_hour: Decimal = Field(Decimal("2.50"), ge=0, description="cost of one GPU hour, in currency units")
    currency: str = Field("USD", min_length=3, max_length=3)
    gpu_kind: str = Field("default", min_length=1, max_length=64, description="price-list key of the GPU this deployment runs on")
    finance_flag_factor: Decimal = Field(
        Decimal("1.5"), gt=0, description="the finance report flags a tenant whose share of GPU time exceeds its share of revenue by this factor"
    )
