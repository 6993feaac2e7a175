"""The ledger's configuration: one frozen, validated object built once at the process edge."""

from __future__ import annotations

import re
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


def url_without_password(url: str) -> str:
    """`url` with its passwords written `***`: the user part's (`scheme://user:PASSWORD@host...`) and a `password=` query
    parameter's (libpq and redis-py take one; redis-py's `unix://` form has no other place); the rest unchanged.

    The user part ends where either reading of the URL ends it: redis-py's (urllib) at the last @ before the first /, ?
    or #; SQLAlchemy's at the first @ after the user's colon, slashes and ? included (a base64 secret holds /:
    `u:ab/cd@db` is password `ab/cd` there). The mask runs to the later of the two, so neither leaves a piece of it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    ends = []
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if (at := netloc.rfind("@")) != -1 and ":" in netloc[:at]:
        ends.append(at)
    # SQLAlchemy's reading; for Redis only an @ before any ? or # (one in its query, `client_name=a@b`, is no user part)
    if (m := re.match(r"[^:/@?#]*:[^@?#]*@" if scheme.startswith(("redis", "unix")) else r"[^:/@]*:[^@]*@", rest)) is not None:
        ends.append(m.end() - 1)
    if ends:
        colon = rest.index(":")
        rest = f"{rest[:colon]}:***{rest[max(ends):]}"
    rest = re.sub(r"([?&;](?:password|passwd|pwd)=)[^&;#]*", r"\1***", rest, flags=re.IGNORECASE)
    return f"{scheme}://{rest}"
