"""Price lists with effective dates: GPU hours (the cost side) and tenant-tier tokens (the revenue side).

An entry applies from midnight UTC of its day until the next entry of the same GPU kind (or tier). The
price that applies to a usage row is the one in effect at its created_at. GPU time is priced by the kind
the row records (the GPU that ran it; usage.gpu_kind): where no entry of that kind applies and the kind is
LedgerConfig.gpu_kind, LedgerConfig.gpu_price_per_hour does (the fallback, named in the invoice by its
price like any other); any other kind with no entry then is refused (UnpricedGpuKindError), never
priced at another kind's price. Rows written before revision 0009 record no kind and are priced as
LedgerConfig.gpu_kind. A tier with no entry in effect has no token price: its tokens earn nothing and are
counted as unpriced, never priced at a guess.

Setting an entry for a kind (or tier) and day that already has one replaces it. Closed invoices keep
the prices they were closed with; only drafts follow a change. A price that would reach a month closed for some
tenants and not others is refused: a GPU price because its cold-start spread, frozen at its first close with each
share's price, would leave the rest billing usage and cold start at two prices; a token price because a closed tenant's
late usage of its days would be billed at the new price and its closed invoice billed them at the old. So is any price
whose days reach a month closed for everyone: that month's late usage is billed on an open month's adjustment lines
at the prices the month was closed with, and a price set afterwards would reprice those lines alone.

Each entry is in the currency it was set in (revision 0012; the ledger.currency of the process that set it). An
invoice is priced only with entries of its own currency: usage that the entry in effect would price in another one is
refused (PriceCurrencyError), never priced with one currency's numbers and labelled with another's.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

from sqlalchemy import ColumnElement, Engine, case, literal, select
from sqlalchemy.orm import Session

from billing.db import dialect_insert, session_factory
from billing.errors import PriceCurrencyError, PriceError, UnpricedGpuKindError
from billing.filing import lock_price_lists
from billing.models import AdapterLoad, BillingPeriod, GpuPrice, TokenPrice, Usage
from billing.periods import next_period, period_of, period_start

_MAX_PLACES = 9  # prices are stored as Numeric(18, 9)


@dataclass(frozen=True)
class GpuPriceEntry:
    gpu_kind: str
    effective_from: datetime
    price_per_hour: Decimal
    currency: str
    # Only on what set_gpu_price returns: where the entry stops, the first day of a later month already closed (for some
    # tenants or all), at which the price in effect there before was set again so that month keeps it (_stop_before_frozen).
    stops_at: datetime | None = None


@dataclass(frozen=True)
class TokenPriceEntry:
    tier: str
    effective_from: datetime
    input_per_million: Decimal
    output_per_million: Decimal
    currency: str
    stops_at: datetime | None = None  # as GpuPriceEntry.stops_at, for set_token_price


def _midnight(day: date) -> datetime:
    assert isinstance(day, date) and not isinstance(day, datetime), f"pass a date, got {day!r}"
    return datetime.combine(day, time(0), tzinfo=timezone.utc)


def check_price(what: str, value: Decimal) -> Decimal:
    """`value` if it can be stored and billed as a price (finite, 0 or more, at most 9 decimals, under 10^9); else
    PriceError naming `what` and the fix."""
    if not isinstance(value, Decimal) or not value.is_finite():
        raise PriceError(f"{what}={value!r} is not a price; pass a decimal number such as 2.50")
    if value < 0:
        raise PriceError(f"{what}={value} is negative; a price is 0 or more (credits go in as adjustments)")
    # The size first: quantizing a value of 10^19 or more to 9 places passes the context's 28 digits and raises
    # decimal.InvalidOperation (`prices set-gpu h100 1e30` ended in its traceback)
    if value >= 10**9:
        raise PriceError(f"{what}={value} is too large; prices are stored with 9 integer digits, pass less than 1000000000")
    if value != value.quantize(Decimal(1).scaleb(-_MAX_PLACES)):
        raise PriceError(f"{what}={value} has more than {_MAX_PLACES} decimal places; round it to at most {_MAX_PLACES}")
    return value


def _check_name(what: str, value: str, limit: int) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > limit or value != value.strip():
        raise PriceError(f"{what}={value!r} cannot name a price list; pass 1 to {limit} characters without surrounding spaces")
    return value


def set_gpu_price(engine: Engine, gpu_kind: str, price_per_hour: Decimal, effective_from: date, *, currency: str,
                  fallback: tuple[str, Decimal] | None = None) -> GpuPriceEntry:
    """Make `price_per_hour`, in `currency` (the setter's ledger.currency), the price of one hour of `gpu_kind` from
    midnight UTC of `effective_from` on, up to the next entry of the kind or a later month already closed, whichever
    comes first (_stop_before_frozen). `fallback`: (ledger.gpu_kind, ledger.gpu_price_per_hour), the price in effect for
    that kind where it has no entry."""
    entry = GpuPriceEntry(_check_name("gpu_kind", gpu_kind, 64), _midnight(effective_from), check_price("price_per_hour", price_per_hour),
                          _check_currency(currency))
    statement = dialect_insert(engine.dialect.name)(GpuPrice).values(
        gpu_kind=entry.gpu_kind, effective_from=entry.effective_from, price_per_hour=entry.price_per_hour, currency=entry.currency
    )
    statement = statement.on_conflict_do_update(
        index_elements=[GpuPrice.gpu_kind, GpuPrice.effective_from],
        set_={"price_per_hour": statement.excluded.price_per_hour, "currency": statement.excluded.currency},
    )
    with session_factory(engine).begin() as session:
        lock_price_lists(session, exclusive=True)  # no close commits between the checks and the write
        until = session.scalar(select(GpuPrice.effective_from).where(
            GpuPrice.gpu_kind == entry.gpu_kind, GpuPrice.effective_from > entry.effective_from).order_by(GpuPrice.effective_from).limit(1))
        restated: GpuPriceEntry | None = None
        if (stop := _stop_before_frozen(session, entry.effective_from, until)) is not None:
            prior = session.execute(select(GpuPrice.price_per_hour, GpuPrice.currency).where(
                GpuPrice.gpu_kind == entry.gpu_kind, GpuPrice.effective_from <= entry.effective_from)
                .order_by(GpuPrice.effective_from.desc()).limit(1)).first()
            if prior is None and fallback is not None and fallback[0] == entry.gpu_kind:
                prior = (fallback[1], entry.currency)  # the fallback is in ledger.currency, as the entry is
            if prior is not None:
                restated, until = GpuPriceEntry(entry.gpu_kind, stop, prior[0], prior[1]), stop
        # A kind with no price in effect there at all has nothing to keep where no frozen month bills a row or load of it:
        # such a row could not have been closed or frozen unpriced, and one that comes late is refused until priced.
        first_price = stop is not None and restated is None and not _kind_billed(
            session, entry.gpu_kind, entry.effective_from, until, fallback[0] if fallback else None)
        if not first_price:
            _refuse_a_closed_month(session, f"a {entry.gpu_kind} GPU price", entry.effective_from, until,
                                   f"lorabatch prices set-gpu {entry.gpu_kind} PRICE --from DAY")
            _refuse_a_split_month(session, f"a {entry.gpu_kind} GPU price", entry.effective_from, until, _SPREAD_FROZEN,
                                  _late_load(entry, until))
        session.execute(statement)
        if restated is not None:
            session.execute(GpuPrice.__table__.insert().values(
                gpu_kind=restated.gpu_kind, effective_from=restated.effective_from, price_per_hour=restated.price_per_hour, currency=restated.currency))
            return replace(entry, stops_at=restated.effective_from)
    return entry


def _kind_billed(session: Session, gpu_kind: str, effective_from: datetime, until: datetime | None, fallback_kind: str | None) -> bool:
    """Whether a month of the days from `effective_from` to `until` whose spread is frozen bills a usage row or an
    adapter load of `gpu_kind` (or of no recorded kind, priced as ledger.gpu_kind: unless `fallback_kind` says which
    that is, it may be this one)."""
    frozen = select(BillingPeriod.period).where(BillingPeriod.spread_frozen_at.is_not(None), _days_reach(effective_from, until))
    unkind = fallback_kind in (None, gpu_kind)
    of_kind = (Usage.gpu_kind == gpu_kind) | (Usage.gpu_kind.is_(None) if unkind else False)
    loads_of_kind = (AdapterLoad.gpu_kind == gpu_kind) | (AdapterLoad.gpu_kind.is_(None) if unkind else False)
    return bool(session.scalar(select(
        select(Usage.id).where(Usage.invoice_period.in_(frozen), of_kind).exists()
        | select(AdapterLoad.id).where(AdapterLoad.invoice_period.in_(frozen), loads_of_kind).exists())))


def _stop_before_frozen(session: Session, effective_from: datetime, until: datetime | None) -> datetime | None:
    """The first instant of the first month after `effective_from`'s own, among the entry's days (to `until`, the next
    entry), that is closed for some tenants or for all (its cold-start spread frozen); None when there is none.

    An entry stops there: the setter writes the price in effect there before again at that instant, so the closed month
    keeps its prices and the entry prices only the open days before it. Without it, closing months out of order froze
    the earlier one: after March's close, no February price could be set (a February entry ran into March and was
    refused), so February usage on a GPU kind with no price could be neither drafted nor closed, ever.
    """
    first = session.scalar(select(BillingPeriod.period).where(
        BillingPeriod.spread_frozen_at.is_not(None), BillingPeriod.period > period_of(effective_from), _days_reach(effective_from, until))
        .order_by(BillingPeriod.period).limit(1))
    return None if first is None else period_start(first)


def _check_currency(currency: str) -> str:
    assert isinstance(currency, str) and len(currency) == 3 and currency.isascii() and currency.isalpha() and currency.isupper(), currency
    return currency


def _days_reach(effective_from: datetime, until: datetime | None) -> ColumnElement[bool]:
    """SQL: BillingPeriod.period is a month of the days from `effective_from` to `until` (the next entry; None: none)."""
    reached = BillingPeriod.period >= period_of(effective_from)
    if until is not None:
        reached &= BillingPeriod.period <= period_of(until - timedelta(microseconds=1))
    return reached


def _refuse_a_closed_month(session: Session, what: str, effective_from: datetime, until: datetime | None, command: str) -> None:
    """Refuse a price whose days (from its midnight to the next entry of its kind or tier) reach a month closed for every
    tenant. Its invoices keep the prices they were closed with; what the new price would change is only that month's late
    usage (and late adapter loads), billed on the next open month's adjustment lines at the prices of the days it ran:
    measured, a price set for October 10 after October's close left every October invoice as closed and repriced only
    the November line "adjustment for 2026-10". A closed month's prices are final, as its invoices are."""
    closed = session.scalars(select(BillingPeriod.period).where(BillingPeriod.closed_at.is_not(None), _days_reach(effective_from, until))
                             .order_by(BillingPeriod.period)).all()
    if closed:
        raise PriceError(
            f"{what} from {effective_from.date()} would change the prices of {', '.join(closed)}, which "
            f"{'is' if len(closed) == 1 else 'are'} closed (every invoice of it frozen): a closed month's prices are final, and "
            f"its late usage is billed on the next open month's adjustment lines at them. Put a correction in an open month: "
            f"set the price from {period_start(next_period(closed[-1])).date()} or later (`{command}`)")


_SPREAD_FROZEN = "its cold-start spread was frozen with its GPU prices at its first close"
_TOKENS_CLOSED = "its closed invoices billed its days at the old prices, and their tenants' late usage would be billed at the new"


def _late_load(entry: GpuPriceEntry, until: datetime | None) -> ColumnElement[bool]:
    """SQL: the month (BillingPeriod) bills an adapter load of `entry`'s kind (or of none recorded) made in its days, to
    `until`: a late load that the month's cold-start spread took, priced by this entry."""
    return (select(AdapterLoad.id).where(
        AdapterLoad.invoice_period == BillingPeriod.period, AdapterLoad.created_at >= entry.effective_from,
        (AdapterLoad.gpu_kind == entry.gpu_kind) | AdapterLoad.gpu_kind.is_(None),
        *([AdapterLoad.created_at < until] if until is not None else [])).exists())


def _refuse_a_split_month(session: Session, what: str, effective_from: datetime, until: datetime | None, why: str,
                          late_load: ColumnElement[bool] | None = None) -> None:
    """Refuse a price (GPU or token) whose days would reach a month that is closed for some tenants and not for others.

    A GPU price: the month's cold-start spread was frozen, with each share's price, at its first close; the other
    tenants' drafts would bill their usage at the new price and their cold-start shares at the old one, and close so
    (measured: after acme's close, 3.60 set for October left globex's draft with usage at 3.60 and its cold-start share
    at 7.20). Such a month is reached also through `late_load` (_late_load), a load of the price's days that it bills.
    A token price: a closed tenant's late usage of those days is billed on its next open month's adjustment line at the
    new price, while its closed invoice billed the same days at the old one (measured: acme's October closed at 0.20,
    0.50 set from October 1 billed its late October usage at 0.50 on November's "adjustment for 2026-10" line). Any tier:
    whether a closed invoice billed the tier in that month is not asked (the way out, closing the rest, is cheap).
    The days an entry prices run from its midnight to `until`, the next entry of its kind or tier (None: none)."""
    split = BillingPeriod.spread_frozen_at.is_not(None) & BillingPeriod.closed_at.is_(None)
    reach = _days_reach(effective_from, until)
    if late_load is not None:
        reach |= late_load
    reached = session.scalars(select(BillingPeriod.period).where(split & reach).order_by(BillingPeriod.period)).all()
    if reached:
        later = max(period_of(effective_from), *reached)
        raise PriceError(
            f"{what} from {effective_from.date()} would change {', '.join(reached)}, whose invoices are closed for some "
            f"tenants and not yet for others ({why}): close the rest of {', '.join(reached)} first "
            f"(`lorabatch invoice --close-period`), or set the price from {period_start(next_period(later)).date()}")


def set_token_price(engine: Engine, tier: str, input_per_million: Decimal, output_per_million: Decimal, effective_from: date, *,
                    currency: str) -> TokenPriceEntry:
    """Make these, in `currency` (the setter's ledger.currency), the prices per million input and output tokens of `tier`
    from midnight UTC of `effective_from` on."""
    entry = TokenPriceEntry(
        _check_name("tier", tier, 32), _midnight(effective_from),
        check_price("input_per_million", input_per_million), check_price("output_per_million", output_per_million), _check_currency(currency),
    )
    statement = dialect_insert(engine.dialect.name)(TokenPrice).values(
        tier=entry.tier, effective_from=entry.effective_from,
        input_per_million=entry.input_per_million, output_per_million=entry.output_per_million, currency=entry.currency,
    )
    statement = statement.on_conflict_do_update(
        index_elements=[TokenPrice.tier, TokenPrice.effective_from],
        set_={"input_per_million": statement.excluded.input_per_million, "output_per_million": statement.excluded.output_per_million,
              "currency": statement.excluded.currency},
    )
    with session_factory(engine).begin() as session:
        lock_price_lists(session, exclusive=True)  # no close commits between the checks and the write
        until = session.scalar(select(TokenPrice.effective_from).where(
            TokenPrice.tier == entry.tier, TokenPrice.effective_from > entry.effective_from).order_by(TokenPrice.effective_from).limit(1))
        restated: TokenPriceEntry | None = None
        if (stop := _stop_before_frozen(session, entry.effective_from, until)) is not None:
            prior = session.execute(select(TokenPrice.input_per_million, TokenPrice.output_per_million, TokenPrice.currency).where(
                TokenPrice.tier == entry.tier, TokenPrice.effective_from <= entry.effective_from)
                .order_by(TokenPrice.effective_from.desc()).limit(1)).first()
            if prior is not None:
                restated, until = TokenPriceEntry(entry.tier, stop, *prior), stop
        _refuse_a_closed_month(session, f"a {entry.tier} token price", entry.effective_from, until,
                               f"lorabatch prices set-tokens {entry.tier} --input P --output P --from DAY")
        _refuse_a_split_month(session, f"a {entry.tier} token price", entry.effective_from, until, _TOKENS_CLOSED)
        session.execute(statement)
        if restated is not None:
            session.execute(TokenPrice.__table__.insert().values(
                tier=restated.tier, effective_from=restated.effective_from, input_per_million=restated.input_per_million,
                output_per_million=restated.output_per_million, currency=restated.currency))
            return replace(entry, stops_at=restated.effective_from)
    return entry


def gpu_price_list(session: Session, gpu_kind: str | None = None) -> list[GpuPriceEntry]:
    """GPU price entries (of one kind, or all), by kind and date."""
    statement = select(GpuPrice).order_by(GpuPrice.gpu_kind, GpuPrice.effective_from)
    if gpu_kind is not None:
        statement = statement.where(GpuPrice.gpu_kind == gpu_kind)
    return [GpuPriceEntry(p.gpu_kind, p.effective_from, p.price_per_hour, p.currency) for p in session.scalars(statement)]


def token_price_list(session: Session) -> list[TokenPriceEntry]:
    """Token price entries of every tier, by tier and date."""
    statement = select(TokenPrice).order_by(TokenPrice.tier, TokenPrice.effective_from)
    return [TokenPriceEntry(p.tier, p.effective_from, p.input_per_million, p.output_per_million, p.currency) for p in session.scalars(statement)]


def _entry_at(starts: Sequence[datetime], moment: datetime | None) -> int | None:
    """Index of the last entry starting at or before `moment` (None: before every entry, or no moment)."""
    if moment is None:
        return None
    i = bisect.bisect_right(starts, moment) - 1
    return i if i >= 0 else None


class PriceBook:
    """The price lists as read in one transaction, and the time segments over which no price changes.

    Segments: the sorted effective dates of every entry (GPU entries of every kind, token entries of
    every tier) cut time into segments; segment 0 lies before the first date, segment i starts at the
    i-th date. Within one segment every price is constant, so usage can be summed per segment (and
    GPU kind) in SQL and priced once per sum.

    `gpu_kind` is the kind `fallback_per_hour` prices (LedgerConfig.gpu_kind), and the kind of rows that
    record none (written before revision 0009). `currency` is the one every price it gives is in (LedgerConfig.currency,
    the fallback's too): an entry of another currency in effect where a price is asked for is refused, not converted.
    """

    def __init__(self, gpu: Sequence[GpuPriceEntry], tokens: Sequence[TokenPriceEntry], fallback_per_hour: Decimal, gpu_kind: str,
                 currency: str):
        assert isinstance(fallback_per_hour, Decimal), fallback_per_hour
        assert gpu_kind, gpu_kind
        self.currency = _check_currency(currency)
        self._gpu: dict[str, list[GpuPriceEntry]] = defaultdict(list)
        for gpu_entry in sorted(gpu, key=lambda e: (e.gpu_kind, e.effective_from)):
            self._gpu[gpu_entry.gpu_kind].append(gpu_entry)
        self._gpu_starts = {kind: [e.effective_from for e in entries] for kind, entries in self._gpu.items()}
        self._tiers: dict[str, list[TokenPriceEntry]] = defaultdict(list)
        for entry in tokens:
            self._tiers[entry.tier].append(entry)
        self._fallback = fallback_per_hour
        self.gpu_kind = gpu_kind
        self.boundaries: tuple[datetime, ...] = tuple(sorted({e.effective_from for e in (*gpu, *tokens)}))

    @classmethod
    def load(cls, session: Session, gpu_kind: str, fallback_per_hour: Decimal, currency: str, *, tokens: bool = True) -> PriceBook:
        """Every GPU kind's list (and every tier's, unless `tokens` is False); `gpu_kind`: the fallback's kind."""
        return cls(gpu_price_list(session), token_price_list(session) if tokens else (), fallback_per_hour, gpu_kind, currency)

    def _in_currency(self, entry: GpuPriceEntry | TokenPriceEntry, what: str, command: str) -> None:
        if entry.currency != self.currency:
            raise PriceCurrencyError(
                f"the {what} in effect from {entry.effective_from.date()} was set in {entry.currency}, and this invoice is in "
                f"ledger.currency {self.currency}: its usage would be priced in {entry.currency} and labelled {self.currency}. "
                f"Set {self.currency} prices for the days of that usage (`{command}`, DAY on or before its first day, under "
                f"ledger.currency = \"{self.currency}\"), or invoice it with ledger.currency = \"{entry.currency}\"")

    def gpu_price_at(self, moment: datetime | None, kind: str | None = None) -> Decimal:
        """Price per hour of GPU `kind` (None: a row from before revision 0009, priced as self.gpu_kind) in effect at
        `moment` (None: before any entry); the fallback where none of self.gpu_kind is; else UnpricedGpuKindError."""
        kind = kind or self.gpu_kind
        entries = self._gpu.get(kind, [])
        i = _entry_at(self._gpu_starts.get(kind, []), moment)
        if i is not None:
            self._in_currency(entries[i], f"{kind} GPU price", f"lorabatch prices set-gpu {kind} PRICE --from DAY")
            return entries[i].price_per_hour
        if kind == self.gpu_kind:
            return self._fallback
        listed = f"its GPU price list starts on {entries[0].effective_from:%Y-%m-%d}" if entries else "the GPU price list has no entry of it"
        raise UnpricedGpuKindError(
            f"usage ran on gpu_kind {kind!r}, which has no GPU price then ({listed}; ledger.gpu_price_per_hour prices only "
            f"ledger.gpu_kind {self.gpu_kind!r}); add its price with `lorabatch prices set-gpu {kind} PRICE --from DAY`, DAY on "
            f"or before the first day of that usage, then run this again"
        )

    def gpu_price_or_fallback(self, moment: datetime | None, kind: str | None) -> Decimal:
        """gpu_price_at, but the fallback for a kind with no price: only for a row's informational cost at insert, which a
        worker must be able to write whatever the price lists hold (invoices price the sums, and refuse such a row, or one
        whose price is in another currency)."""
        try:
            return self.gpu_price_at(moment, kind)
        except (UnpricedGpuKindError, PriceCurrencyError):
            return self._fallback

    def token_price_at(self, tier: str | None, moment: datetime | None) -> TokenPriceEntry | None:
        """The tier's token prices in effect at `moment`; None when the tier has none then."""
        entries = self._tiers.get(tier or "", [])
        i = _entry_at([e.effective_from for e in entries], moment)
        if i is None:
            return None
        self._in_currency(entries[i], f"{tier} token price", f"lorabatch prices set-tokens {tier} --input P --output P --from DAY")
        return entries[i]

    def segment_start(self, segment: int) -> datetime | None:
        assert 0 <= segment <= len(self.boundaries), segment
        return None if segment == 0 else self.boundaries[segment - 1]

    def segment_of(self, column: ColumnElement[datetime]) -> ColumnElement[int]:
        """SQL: the segment index of `column` (a UTCDateTime), the number of boundaries at or before it."""
        if not self.boundaries:
            return literal(0)
        whens = [(column >= start, i + 1) for i, start in reversed(list(enumerate(self.boundaries)))]
        return case(*whens, else_=0)
