"""The KV credit a request is billed: what its cached prompt tokens saved, bounded by what it was charged.

The engine measures the saving: kv_saved_us = cached tokens x the marginal device time of a prefill
token, the slope of a least-squares fit of step time against step tokens (engine.timing.PrefillCost,
not the average time per token, which carries each step's fixed cost). Billing takes that figure from
the usage row as it is and credits no more than the request would have been charged to compute those
tokens:

    charged  = base_us + lora_us                                  (its share of the steps it ran in)
    computed = input_tokens - cached_tokens + output_tokens       (the tokens it put through the forward)
    cap      = charged * min(cached_tokens, computed) // computed  (0 when computed <= 0)
    credit   = min(kv_saved_us, cap)

That is, the cached tokens at most at the request's own charged time per computed token, and never more
than its whole charge, so base + LoRA - credit >= 0 and a line's net GPU time (that plus routing and
cold start, both >= 0) is never negative. Example (the auditor's row): charged 46_000 us over 24 computed
tokens with 992 cached and kv_saved_us 846_000: min(992, 24) = 24, cap = 46_000, credit 46_000, net 0.

The same rule exists twice, as Python for one record and as SQL for sums over rows, so invoices and
reports sum it in the database; tests/test_credit.py checks that the two agree.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ColumnElement, case, cast

from billing.models import Usage

KV_CREDIT_RULE = (
    "min(kv_saved_us, (base_us + lora_us) * min(cached_tokens, computed) // computed), "
    "computed = input_tokens - cached_tokens + output_tokens (0 when computed <= 0); "
    "kv_saved_us = cached_tokens x the fitted slope of step time over step tokens"
)


def kv_credit_us(*, kv_saved_us: int, base_us: int, lora_us: int, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
    """The credit one request is billed, in integer microseconds (the module docstring's rule)."""
    computed = input_tokens - cached_tokens + output_tokens
    if computed <= 0:
        return 0
    cap = (base_us + lora_us) * min(cached_tokens, computed) // computed
    return min(kv_saved_us, cap)


def kv_credit_sql() -> ColumnElement[int]:
    """The same rule as a SQL expression over a usage row (`//` is integer division on SQLite and PostgreSQL alike; every operand is >= 0 there).

    Every intermediate stays within 64-bit integers for any row the ledger takes (billing/checks.py): token counts are
    widened to bigint before they are added (two int4 counts of a billion each passed int4, and PostgreSQL refused every
    invoice of the month while SQLite billed it), and charged * cached // computed is taken as
    (charged // computed) * cached + (charged % computed) * cached // computed, equal in integers, whose products stay
    under charged and under 2^31 * 2^32 (the product itself passed 2^63 for a 2^40 us request with 2^30 tokens cached:
    PostgreSQL failed, SQLite went on in floating point and credited 1 us more than the rule).
    """
    charged = Usage.base_us + Usage.lora_us
    cached = cast(Usage.cached_tokens, BigInteger)
    computed = cast(Usage.input_tokens, BigInteger) - cached + cast(Usage.output_tokens, BigInteger)
    cap = case(
        (computed <= 0, 0),
        (cached >= computed, charged),
        else_=(charged // computed) * cached + ((charged % computed) * cached) // computed,
    )
    return case((Usage.kv_saved_us < cap, Usage.kv_saved_us), else_=cap)
