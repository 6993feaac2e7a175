"""The ledger's configuration: one frozen, validated object built once at the process edge."""

from __future__ import annotations

from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_FLAG_FACTOR = Decimal(10**6)  # beyond, no tenant could be flagged, and the report's products overflow


class LedgerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    url: str = Field("sqlite:///.lorabatch/ledger.db", description="SQLAlchemy URL: sqlite:///FILE or postgresql+psycopg://HOST/DB")
    gpu_price_per_hour: Decimal = Field(Decimal("2.50"), ge=0, description="cost of one GPU hour, in currency units")
    currency: str = Field("USD", min_length=3, max_length=3)
    gpu_kind: str = Field("default", min_length=1, max_length=64, description="price-list key of the GPU this deployment runs on")
    finance_flag_factor: Decimal = Field(
        Decimal("1.5"), gt=0, le=MAX_FLAG_FACTOR,
        description="the finance report flags a tenant whose share of GPU time exceeds its share of revenue by this factor",
    )  # fmt: skip

    @field_validator("url")
    @classmethod
    def _usable_url(cls, value: str) -> str:
        """Checked at load, as every other key is: an unknown driver or a URL that does not parse was found only when a
        command opened the ledger, and a worker took it for the ledger being down and waited for it for ever."""
        from billing.db import check_url
        from billing.errors import LedgerConfigError

        try:
            check_url(value)
        except LedgerConfigError as e:
            raise ValueError(str(e)) from None
        return value

    @field_validator("currency")
    @classmethod
    def _currency_code(cls, value: str) -> str:
        """An ISO 4217 code in capitals: closed invoices keep the code they were closed in, and the finance report refuses
        a month of two codes, so "usd" beside "USD" was two currencies (and "U$D" was taken)."""
        if not (value.isascii() and value.isalpha() and value.isupper()):
            raise ValueError(f"{value!r} is not a currency code: write its three-letter ISO 4217 code in capitals, such as "
                             f"{value.upper() if value.isascii() and value.isalpha() else 'USD'}")
        return value

    @field_validator("gpu_price_per_hour")
    @classmethod
    def _storable_price(cls, value: Decimal) -> Decimal:
        """The fallback price is frozen into closed invoices' lines as `prices set-gpu`'s are: the same rules, here, so
        that a config with a price the ledger cannot store is refused at load, not by the first close."""
        from billing.errors import PriceError
        from billing.prices import check_price

        try:
            return check_price("ledger.gpu_price_per_hour", value)
        except PriceError as e:
            raise ValueError(str(e)) from None
