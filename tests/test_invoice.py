"""Invoices: lines and totals, the cold-start spread, UTC month boundaries, renderings, bad periods.

Runs on SQLite and the machine's PostgreSQL (fixtures from tests/db_fixtures.py). The worked example
below is computed by hand in the comments; the price makes one microsecond cost exactly 2e-9.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from billing.apportion import apportion
from billing.config import LedgerConfig
from billing.credit import KV_CREDIT_RULE
from billing.errors import InvalidPeriodError, UnbillablePeriodError, UnknownTenantError
from billing.invoice import Invoice, build_invoice
from billing.invoice_render import render_csv, render_json, render_table
from billing.ledger import Ledger
from tests.test_ledger import load_record, usage_record

PRICE = Decimal("7.20")  # per GPU hour: 7.20 / 3.6e9 = 2e-9 per microsecond
CONFIG = LedgerConfig(gpu_price_per_hour=PRICE)  # no price list entries: the fallback price applies
S1, S2, S3 = "11" * 32, "22" * 32, "33" * 32
MARCH = datetime(2026, 3, 10, 9, 0, tzinfo=timezone.utc)


def at(day: int, hour: int = 12, offset_h: int = 0) -> datetime:
    return datetime(2026, 3, day, hour, 0, tzinfo=timezone(timedelta(hours=offset_h)))


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url), gpu_price_per_hour=PRICE))


@pytest.fixture
def march(ledger: Ledger) -> Ledger:
    """March 2026 for tenants acme and globex.

    summarize@1 is public (content S1): acme used it for 400 + 50 tokens, globex for 900. Its loads in
    March, 60_000 + 40_000 = 100_000 us, split 450 : 900 = 33_333.33 : 66_666.67 us; the leftover
    microsecond goes to globex's larger remainder: acme 33_333, globex 66_667.
    support@2 exists twice, private: acme's (content S2, one 50_000 us load, all acme's) and globex's
    (content S3, 7_000 us, all globex's); neither tenant pays for the other's load.
    Not in acme's March: a summarize@1 load in February, an other@1 load acme never used, a February request.
    """
    ledger.record_usage(
        [
            usage_record("a1", created_at=at(2), input_tokens=100, output_tokens=50, base_us=40_000, routing_us=1_000),
            usage_record(
                "a2", created_at=at(3, offset_h=-7), adapter="summarize@1", adapter_sha256=S1, input_tokens=300, output_tokens=100,
                cached_tokens=64, base_us=120_000, lora_us=30_000, routing_us=2_000, kv_saved_us=10_000,
            ),
            usage_record(
                "a3", created_at=at(4), adapter="summarize@1", adapter_sha256=S1, status="failed", error_code="oom",
                input_tokens=50, base_us=5_000, lora_us=1_000, routing_us=500,
            ),
            usage_record(
                "a4", created_at=at(5), adapter="support@2", adapter_sha256=S2, input_tokens=200, output_tokens=200, cached_tokens=50,
                base_us=80_000, lora_us=20_000, routing_us=1_500, kv_saved_us=5_000,
            ),
            usage_record("a5", created_at=datetime(2026, 2, 20, tzinfo=timezone.utc), adapter="summarize@1", adapter_sha256=S1, input_tokens=10**6),
            usage_record(
                "g1", tenant_id="globex", created_at=at(6), adapter="summarize@1", adapter_sha256=S1, input_tokens=700,
                output_tokens=200, base_us=200_000, lora_us=50_000, routing_us=3_000,
            ),
            usage_record(
                "g2", tenant_id="globex", created_at=at(7), adapter="support@2", adapter_sha256=S3, input_tokens=10,
                output_tokens=10, base_us=9_000, lora_us=1_000,
            ),
        ]
    )
    ledger.record_adapter_loads(
        [
            load_record(adapter="summarize@1", adapter_sha256=S1, load_us=60_000, created_at=at(1)),
            load_record(adapter="summarize@1", adapter_sha256=S1, load_us=40_000, created_at=at(20)),
            load_record(adapter="support@2", adapter_sha256=S2, tenant_id="acme", load_us=50_000, created_at=at(5)),
            load_record(adapter="support@2", adapter_sha256=S3, tenant_id="globex", load_us=7_000, created_at=at(7)),
            load_record(adapter="summarize@1", adapter_sha256=S1, load_us=999_000, created_at=datetime(2026, 2, 28, tzinfo=timezone.utc)),
            load_record(adapter="other@1", adapter_sha256=S1, load_us=123_000, created_at=at(8)),
        ]
    )
    return ledger


ACME_MARCH_JSON = {
    "tenant": "acme",
    "period": "2026-03",
    "status": "draft",
    "closed_at": None,  # a draft
    "currency": "USD",
    "tiers_billed": [],  # acme's rows record no tier, and the registry holds no acme: no tier priced its tokens
    "lines": [
        {   # a1: gpu = 40_000 + 0 + 1_000 = 41_000 us
            "adapter": "base", "adjustment_for": None, "gpu_price_per_hour": "7.20", "requests": 1, "failed": 0, "input_tokens": 100, "output_tokens": 50, "cached_tokens": 0,
            "base_ms": "40.000", "lora_ms": "0.000", "routing_ms": "1.000", "kv_saved_ms": "0.000", "cold_start_ms": "0.000",
            "gpu_ms": "41.000", "cost": "0.000082000", "revenue": "0.000000000",
        },
        {   # a2 + a3: base 125_000, lora 30_000 + 1_000 = 31_000, routing 2_000 + 500 = 2_500, kv 10_000, cold 33_333
            # gpu = 125_000 + 31_000 + 2_500 - 10_000 + 33_333 = 181_833 us
            "adapter": "summarize@1", "adjustment_for": None, "gpu_price_per_hour": "7.20", "requests": 2, "failed": 1, "input_tokens": 350, "output_tokens": 100, "cached_tokens": 64,
            "base_ms": "125.000", "lora_ms": "31.000", "routing_ms": "2.500", "kv_saved_ms": "10.000", "cold_start_ms": "33.333",
            "gpu_ms": "181.833", "cost": "0.000363666", "revenue": "0.000000000",
        },
        {   # a4: gpu = 80_000 + 20_000 + 1_500 - 5_000 + 50_000 = 146_500 us
            "adapter": "support@2", "adjustment_for": None, "gpu_price_per_hour": "7.20", "requests": 1, "failed": 0, "input_tokens": 200, "output_tokens": 200, "cached_tokens": 50,
            "base_ms": "80.000", "lora_ms": "20.000", "routing_ms": "1.500", "kv_saved_ms": "5.000", "cold_start_ms": "50.000",
            "gpu_ms": "146.500", "cost": "0.000293000", "revenue": "0.000000000",
        },
    ],
    "totals": {
        "requests": 4, "failed": 1, "input_tokens": 650, "output_tokens": 350, "cached_tokens": 114,
        "base_ms": "245.000", "lora_ms": "51.000", "routing_ms": "5.000", "kv_saved_ms": "15.000", "cold_start_ms": "83.333",
        "gpu_ms": "369.333", "cost": "0.000738666", "revenue": "0.000000000",
        "unpriced_requests": 3,  # a1, a2, a4 succeeded; acme has no tier with a token price, so they earned nothing
    },
    "kv_credit_rule": KV_CREDIT_RULE,  # a2: 10_000 <= 150_000 * 64 // 336; a4: 5_000 <= 100_000 * 50 // 350 (billing/credit.py)
}  # fmt: skip


def test_invoice_lines_and_totals_by_hand(march: Ledger, engine: Engine) -> None:
    """Each line is base + LoRA + routing decision - KV credit + its share of cold start; totals are the lines' sums."""
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert json.loads(render_json(invoice)) == ACME_MARCH_JSON
    assert all(isinstance(line.cost, Decimal) and isinstance(line.gpu_ms, Decimal) for line in invoice.lines)
    assert invoice.totals.cost == sum(line.cost for line in invoice.lines)


def test_cold_start_is_conserved_across_tenants(march: Ledger, engine: Engine) -> None:
    """Conservation: the tenants' cold-start shares of an adapter add up to its measured load time of the period, exactly."""
    acme, globex = (build_invoice(engine, tenant, "2026-03", CONFIG) for tenant in ("acme", "globex"))
    cold = {(inv.tenant, line.adapter): line.cold_start_ms for inv in (acme, globex) for line in inv.lines}
    assert cold[("acme", "summarize@1")] == Decimal("33.333")
    assert cold[("globex", "summarize@1")] == Decimal("66.667")
    assert cold[("acme", "summarize@1")] + cold[("globex", "summarize@1")] == Decimal("100.000")  # 60_000 + 40_000 us
    assert (cold[("acme", "support@2")], cold[("globex", "support@2")]) == (Decimal("50.000"), Decimal("7.000"))
    # All GPU time of March on the invoices = every request's net time + the loads of adapters that were used.
    net_us = (41_000 + 148_500 + 96_500) + (253_000 + 10_000)  # acme a1..a4, globex g1, g2 (base + lora + routing - kv)
    load_us = 100_000 + 50_000 + 7_000  # other@1 was never used and the February load is February's
    assert acme.totals.gpu_ms + globex.totals.gpu_ms == Decimal(net_us + load_us) / 1000


def test_invoice_is_tenant_scoped(march: Ledger, engine: Engine) -> None:
    """Tenant isolation: globex's invoice shows only globex's requests, with its own share of the shared adapter."""
    invoice = build_invoice(engine, "globex", "2026-03", CONFIG)
    assert [(line.adapter, line.requests, line.input_tokens) for line in invoice.lines] == [("summarize@1", 1, 700), ("support@2", 1, 10)]


def test_session_and_engine_give_the_same_invoice(march: Ledger, engine: Engine) -> None:
    """build_invoice reads the same numbers inside a caller's Session as from an Engine."""
    with Session(engine) as session:
        assert build_invoice(session, "acme", "2026-03", CONFIG) == build_invoice(engine, "acme", "2026-03", CONFIG)


def test_tokenless_requests_share_load_time_equally(ledger: Ledger, engine: Engine) -> None:
    """When no request of an adapter produced a token, its load time is spread per request instead (2 : 1)."""
    ledger.record_usage(
        [
            usage_record("x1", tenant_id="x", adapter="a@1", status="failed", created_at=MARCH),
            usage_record("x2", tenant_id="x", adapter="a@1", status="failed", created_at=MARCH),
            usage_record("y1", tenant_id="y", adapter="a@1", status="failed", created_at=MARCH),
        ]
    )
    ledger.record_adapter_loads([load_record(adapter="a@1", load_us=90, created_at=MARCH)])
    shares = [build_invoice(engine, tenant, "2026-03", CONFIG).totals.cold_start_ms for tenant in ("x", "y")]
    assert shares == [Decimal("0.060"), Decimal("0.030")]


def test_empty_invoice(migrated_url: str, engine: Engine) -> None:
    """A registered tenant without usage in the period gets no lines and zero totals, rendered as plain zeros."""
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, display_name) VALUES ('acme', 'Acme')"))
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert invoice.lines == ()
    document = json.loads(render_json(invoice))
    assert document["lines"] == []
    assert document["totals"]["gpu_ms"] == "0.000" and document["totals"]["cost"] == "0.000000000"
    assert render_table(invoice).splitlines()[-1].split() == ["total"] + ["0"] * 5 + ["0.000"] * 6 + ["0.000000000"] * 2


# ---- UTC month boundaries ----------------------------------------------------------------------------


def test_period_is_the_utc_month(ledger: Ledger, engine: Engine) -> None:
    """A request belongs to the UTC month of its instant, whatever offset it was stamped with."""
    minus_5, plus_1 = timezone(timedelta(hours=-5)), timezone(timedelta(hours=1))
    ledger.record_usage(
        [
            usage_record("jan-last-us", created_at=datetime(2026, 1, 31, 23, 59, 59, 999999, tzinfo=timezone.utc), base_us=1),
            usage_record("feb-first-us", created_at=datetime(2026, 2, 1, 0, 0, 0, tzinfo=timezone.utc), base_us=10),
            usage_record("feb-local-jan-utc", created_at=datetime(2026, 2, 1, 0, 30, tzinfo=plus_1), base_us=100),
            usage_record("jan-local-feb-utc", created_at=datetime(2026, 1, 31, 20, 0, tzinfo=minus_5), base_us=1_000),
        ]
    )
    january = build_invoice(engine, "acme", "2026-01", CONFIG)
    february = build_invoice(engine, "acme", "2026-02", CONFIG)
    assert (january.totals.requests, january.totals.base_ms) == (2, Decimal("0.101"))  # 1 + 100 us
    assert (february.totals.requests, february.totals.base_ms) == (2, Decimal("1.010"))  # 10 + 1_000 us


# ---- renderings --------------------------------------------------------------------------------------


def test_render_json_has_exactly_the_contract_keys(march: Ledger, engine: Engine) -> None:
    """The JSON carries tenant, period, status, closed_at, currency, tiers_billed, lines, totals, the KV credit rule and
    nothing else; every decimal is a string."""
    document = json.loads(render_json(build_invoice(engine, "acme", "2026-03", CONFIG)))
    assert list(document) == ["tenant", "period", "status", "closed_at", "currency", "tiers_billed", "lines", "totals",
                              "kv_credit_rule"]
    amount_keys = ["requests", "failed", "input_tokens", "output_tokens", "cached_tokens", "base_ms", "lora_ms",
                   "routing_ms", "kv_saved_ms", "cold_start_ms", "gpu_ms", "cost", "revenue"]  # fmt: skip
    assert all(list(line) == ["adapter", "adjustment_for", "gpu_price_per_hour", *amount_keys] for line in document["lines"])
    assert list(document["totals"]) == [*amount_keys, "unpriced_requests"]
    for amounts in [*document["lines"], document["totals"]]:
        for key, value in amounts.items():
            if key == "adjustment_for":
                assert value is None
                continue
            money_or_text = key.endswith(("_ms", "cost", "revenue", "_per_hour")) or key == "adapter"
            assert isinstance(value, str if money_or_text else int), (key, value)


def test_render_csv(march: Ledger, engine: Engine) -> None:
    """The CSV has a header, one row per line and a TOTAL row, with the same values as the JSON."""
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG)
    rows = list(csv.DictReader(io.StringIO(render_csv(invoice))))
    assert [row["adapter"] for row in rows] == ["base", "summarize@1", "support@2", "TOTAL"]
    assert all((row["tenant"], row["period"], row["status"], row["currency"]) == ("acme", "2026-03", "draft", "USD") for row in rows)
    expected = [*ACME_MARCH_JSON["lines"], {"adapter": "TOTAL", **ACME_MARCH_JSON["totals"]}]  # type: ignore[dict-item]
    for row, want in zip(rows, expected):
        want = {key: "" if value is None else str(value) for key, value in want.items() if key != "unpriced_requests"}
        assert {key: row[key] for key in want} == want
        assert (row["closed_at"], row["tiers_billed"]) == ("", "[]")  # a draft; no tier priced acme's tokens


def test_render_table_is_aligned(march: Ledger, engine: Engine) -> None:
    """The table's rows are equally wide, numbers end in the same column, and the totals row comes last."""
    text = render_table(build_invoice(engine, "acme", "2026-03", CONFIG))
    title, header, *rows, note = text.rstrip("\n").splitlines()
    assert title == "Invoice acme 2026-03 (draft), USD at 7.20 per GPU hour"
    assert note.startswith("note: 3 succeeded requests earned nothing: no tier (tenant not registered)")
    assert len({len(header), *map(len, rows)}) == 1
    assert header.split()[-2:] == ["cost", "revenue"] and rows[-1].endswith(" 0.000738666  0.000000000")
    assert rows[-1].split()[:2] == ["total", "4"] and "369.333" in rows[-1]
    summarize = next(row for row in rows if row.startswith("summarize@1"))
    assert summarize.index("181.833") + len("181.833") == header.index("gpu_ms") + len("gpu_ms")


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("period", ["2026-1", "2026-13", "2026-00", "26-01", "2026/01", "2026-01-01", "", " 2026-01", "2026-01\n", "２０２６-01", None])
def test_bad_period_is_refused(migrated_url: str, engine: Engine, period: str | None) -> None:
    """A period not written YYYY-MM is refused with an error that names the field and the expected form."""
    with pytest.raises(InvalidPeriodError, match=r"period=.*YYYY-MM.*'2026-01'"):
        build_invoice(engine, "acme", period, CONFIG)  # type: ignore[arg-type]


@pytest.mark.parametrize("tenant", ["acme", "", "globex "])
def test_unknown_tenant_is_refused(march: Ledger, engine: Engine, tenant: str) -> None:
    """An id that neither the registry nor the ledger holds gets no invoice, empty or not: the error names it."""
    if tenant == "acme":
        tenant = "acme-typo"
    with pytest.raises(UnknownTenantError, match=f"tenant {tenant!r} is unknown.*lorabatch tenants"):
        build_invoice(engine, tenant, "2026-03", CONFIG)


def test_tenant_known_only_to_the_ledger_is_billed(march: Ledger, engine: Engine) -> None:
    """A tenant the registry does not hold (removed, or never registered) is still billed for its usage, in any month."""
    assert build_invoice(engine, "globex", "2026-03", CONFIG).totals.requests == 2
    assert build_invoice(engine, "globex", "2026-01", CONFIG).lines == ()  # known, nothing used that month


@pytest.mark.parametrize(
    ("period", "hint"),
    [
        ("0000-01", "bills the months 1970-01 to 9998-12"),
        ("1969-12", "bills the months 1970-01 to 9998-12"),
        ("9999-12", "bills the months 1970-01 to 9998-12"),
        ("2062-10", "has not begun .*holds nothing filed to it"),
    ],
)
def test_unbillable_period_is_refused(march: Ledger, engine: Engine, period: str, hint: str) -> None:
    """A well-formed month that cannot be billed (no instant, no end, not begun and empty) is refused, naming the period."""
    with pytest.raises(UnbillablePeriodError, match=f"period {period} cannot be billed.*{hint}"):
        build_invoice(engine, "acme", period, CONFIG, now=datetime(2026, 12, 1, tzinfo=timezone.utc))


def test_a_month_not_begun_is_billed_once_it_holds_usage(ledger: Ledger, engine: Engine) -> None:
    """A worker whose clock runs ahead is billed for what it recorded: a future month with usage is not refused."""
    ledger.record_usage([usage_record("f1", created_at=datetime(2027, 2, 3, tzinfo=timezone.utc), base_us=5)])
    invoice = build_invoice(engine, "acme", "2027-02", CONFIG, now=datetime(2026, 12, 1, tzinfo=timezone.utc))
    assert invoice.totals.base_ms == Decimal("0.005")


# ---- apportionment -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "weights", "shares"),
    [
        (100_000, {"a": 1, "b": 2}, {"a": 33_333, "b": 66_667}),
        (10, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 3, "c": 3}),  # remainder tie: the smaller key
        (7, {"a": 5}, {"a": 7}),
        (0, {"a": 1, "b": 2}, {"a": 0, "b": 0}),
        (5, {"a": 0, "b": 3}, {"a": 0, "b": 5}),
        (5, {}, {}),  # nobody to carry it
    ],
)
def test_apportion_cases(total: int, weights: dict[str, int], shares: dict[str, int]) -> None:
    """Largest-remainder shares: proportional, whole units, ties to the smaller key, and the empty case."""
    assert apportion(total, weights) == shares


@given(
    total=st.integers(min_value=0, max_value=10**12),
    weights=st.dictionaries(st.text(min_size=1, max_size=4), st.integers(min_value=0, max_value=10**9), min_size=1, max_size=8).filter(
        lambda w: sum(w.values()) > 0
    ),
)
def test_apportion_conserves_and_stays_within_one_unit(total: int, weights: dict[str, int]) -> None:
    """Shares add up to the total exactly, each within one unit of its exact proportion, whatever the key order."""
    shares = apportion(total, weights)
    assert sum(shares.values()) == total
    weight_sum = sum(weights.values())
    assert all(abs(shares[k] - Fraction(total * w, weight_sum)) < 1 for k, w in weights.items())
    assert apportion(total, dict(reversed(list(weights.items())))) == shares


def test_invoice_type_is_frozen(march: Ledger, engine: Engine) -> None:
    """An invoice, once built, cannot be changed in place."""
    invoice: Invoice = build_invoice(engine, "acme", "2026-03", CONFIG)
    with pytest.raises(AttributeError):
        invoice.status = "closed"  # type: ignore[misc]
