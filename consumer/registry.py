"""The tenant and adapter registry, kept in the SQL database beside the ledger.

Adapters are stored by content (sha256) in the adapter store; the registry maps
(tenant, name, version) to that content. Re-adding the same content under a name is a no-op; new
content under an existing name becomes its next version. Workers read an immutable snapshot and
refresh it on an interval, so registry changes need no restart.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.models import Adapter, RouteRuleRow, Tenant
from consumer.rules import RouteRule, compile_rule
from consumer.tenants import TenantView
from engine.store import AdapterStore, StoreEntry

if TYPE_CHECKING:
    from engine.adapter_import import AdapterChecks

# \Z, not $: `$` also matches before a final newline, which let `acme\n` through as a tenant, adapter or rule's ADAPTER
# (no job can name it: the job contract's ids end at their last character).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z")
# A rule's ADAPTER: `name` or `name@N`. Routing reads N with int(); 9 digits keep it an INTEGER like adapters.version.
ADAPTER_REF_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})(?:@(?P<version>[1-9][0-9]{0,8}))?\Z")
POSITION_RANGE = (-(2**31), 2**31 - 1)  # route_rules.position is INTEGER (32-bit on PostgreSQL)
WEIGHT_MAX = 2**31 - 1  # adapters.traffic_weight is INTEGER (32-bit on PostgreSQL)
TIER_CHARS = 32  # tenants.tier and token_prices.tier are String(32)


class RegistryError(Exception):
    retriable = False


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (or a tenant), or None."""
    return None if NAME_RE.match(name) else f"{name!r} is invalid; use 1-64 letters, digits, '.', '_' or '-'"


def canary_problem(canary: int | None) -> str | None:
    """Why `canary` is no canary percentage, or None."""
    if canary is None or (isinstance(canary, int) and not isinstance(canary, bool) and 1 <= canary <= 99):
        return None
    return f"canary={canary!r}: give a percentage from 1 to 99"


def public_name_problem(tenant_id: str, name: str, public_owners: Iterable[str]) -> str | None:
    """Why tenant `tenant_id` cannot make its adapter `name` public while `public_owners` have a public adapter of that
    name, or None. A job names an adapter by name alone: with two public `name`s, a third tenant asking for it could
    be given neither (RegistrySnapshot.versions finds no single one), so the first owner's users would be cut off."""
    others = sorted(set(public_owners) - {tenant_id})
    if not others:
        return None
    return (f"adapter name {name!r} is already public as tenant {others[0]}'s adapter, and a name can be public for "
            f"one tenant only; choose another name, or keep {tenant_id}'s {name!r} private (no --public; \"public\": false "
            "on a manifest line)")


@dataclass(frozen=True)
class Registration:
    """One adapter to register: content already in the store under `sha256`, what its config holds, and the flags
    of `Registry.add_adapter`."""

    tenant_id: str
    name: str
    sha256: str
    rank: int
    alpha: Decimal
    target_modules: tuple[str, ...]
    nbytes: int
    default: bool = False
    public: bool = False
    canary: int | None = None


@dataclass(frozen=True)
class AdapterView:
    tenant_id: str
    name: str
    version: int
    sha256: str
    rank: int
    alpha: Decimal
    target_modules: tuple[str, ...]
    nbytes: int
    is_public: bool
    is_default: bool
    traffic_weight: int = 100  # share of an unversioned name's traffic (canary); 0: only by explicit version

    @property
    def adapter(self) -> str:
        """`name@version`: how results, the ledger and invoices name it."""
        return f"{self.name}@{self.version}"

    @property
    def adapter_key(self) -> str:
        """The engine's key, `tenant_id/name@version`: unique across tenants."""
        return f"{self.tenant_id}/{self.name}@{self.version}"


def _view(a: Adapter) -> AdapterView:
    return AdapterView(
        tenant_id=a.tenant_id, name=a.name, version=a.version, sha256=a.sha256, rank=a.rank,
        alpha=Decimal(a.alpha), target_modules=tuple(a.target_modules),
        nbytes=a.nbytes, is_public=a.is_public, is_default=a.is_default, traffic_weight=a.traffic_weight,
    )


def _tenant(t: Tenant) -> TenantView:
    return TenantView(t.id, t.display_name, t.tier, t.weight, t.requests_per_minute, t.tokens_per_minute)


def _rule(r: RouteRuleRow) -> RouteRule:
    return RouteRule(r.id, r.tenant_id, r.kind, r.pattern, r.adapter, r.position)


@dataclass(frozen=True)
class RegistrySnapshot:
    tenants: dict[str, TenantView]
    adapters: dict[tuple[str, str], tuple[AdapterView, ...]]  # (owner, name) -> versions, ascending
    defaults: dict[str, AdapterView]
    rules: tuple[RouteRule, ...] = ()

    def versions(self, tenant_id: str, name: str) -> tuple[AdapterView, ...]:
        """The tenant's own adapter of that name (every version), else another tenant's public one: its public versions
        only (a version registered private stays its owner's, also where a later one is public), and none where the name
        is public under several tenants (`public_owners`)."""
        own = self.adapters.get((tenant_id, name))
        if own:
            return own
        public = [shown for vs in self._by_name.get(name, ()) if (shown := tuple(v for v in vs if v.is_public))]
        return public[0] if len(public) == 1 else ()

    def public_owners(self, tenant_id: str, name: str) -> set[str]:
        """The other tenants with a public version of adapter `name`."""
        return {vs[0].tenant_id for vs in self._by_name.get(name, ()) if vs[0].tenant_id != tenant_id and any(v.is_public for v in vs)}

    def owned_elsewhere(self, tenant_id: str, name: str) -> bool:
        return any(vs[0].tenant_id != tenant_id for vs in self._by_name.get(name, ()))

    @cached_property
    def _by_name(self) -> dict[str, list[tuple[AdapterView, ...]]]:
        """name -> each owner's versions of it: what a job's name is looked up in (scanning every tenant's adapters
        cost 6 ms a job over 100,000 of them), built at the first lookup (the snapshot is immutable)."""
        index: dict[str, list[tuple[AdapterView, ...]]] = {}
        for (_owner, name), vs in self.adapters.items():
            if vs:
                index.setdefault(name, []).append(vs)
        return index


def _public_owners(s: Session, names: set[str]) -> dict[str, set[str]]:
    """Registry.public_owners in session `s`. A (tenant, name) is public when any of its versions is, as
    RegistrySnapshot.versions reads it (other tenants are served its public versions)."""
    owners: dict[str, set[str]] = {}
    if names:
        q = select(Adapter.tenant_id, Adapter.name).where(Adapter.name.in_(sorted(names)), Adapter.is_public).distinct()
        for tenant_id, name in s.execute(q):
            owners.setdefault(name, set()).add(tenant_id)
    return owners


def _check_usable(s: Session, tenant_id: str, name: str, version: int | None) -> None:
    """Raise RegistryError unless tenant `tenant_id` may use adapter `name` (at `version`): its own, else the one
    public adapter of that name (RegistrySnapshot.versions' rule), as routing will resolve it."""
    rows = s.execute(select(Adapter.tenant_id, Adapter.version, Adapter.is_public).where(Adapter.name == name)
                     .order_by(Adapter.version)).all()  # fmt: skip
    by_owner: dict[str, list[tuple[int, bool]]] = {}
    for owner, v, is_public in rows:
        by_owner.setdefault(owner, []).append((v, is_public))
    usable = by_owner.get(tenant_id)
    if usable is None:
        public = sorted(o for o, vs in by_owner.items() if any(p for _, p in vs))
        if len(public) > 1:  # registered before a name could be public for one tenant only
            raise RegistryError(f"ADAPTER {name!r} is public for tenants {', '.join(public)}, so routing cannot pick one; "
                                f"route to another adapter, or register {tenant_id}'s own {name!r}")  # fmt: skip
        if not public:
            owned = " belongs to another tenant and is not public" if by_owner else " does not exist"
            raise RegistryError(f"ADAPTER {name!r}{owned}; route tenant {tenant_id}'s jobs to one of its own adapters or a "
                                f"public one (`lorabatch adapters list`), or register it first (`lorabatch adapters add "
                                f"--tenant {tenant_id} {name} DIR`)")  # fmt: skip
        usable = [(v, p) for v, p in by_owner[public[0]] if p]  # another tenant's public versions only
    versions = [v for v, _ in usable]
    if version is not None and version not in versions:
        raise RegistryError(f"ADAPTER {name}@{version}: {name!r} has no version {version} (its versions: "
                            f"{', '.join(map(str, versions))}); name one of them, or {name!r} alone for its live versions")  # fmt: skip


# The columns' ranges (weight and requests_per_minute are int4 on PostgreSQL, tokens_per_minute int8): a larger value
# ended `tenants add` in the driver's OverflowError traceback.
_LIMIT_RANGES = {"weight": (1, 2**31 - 1), "requests_per_minute": (0, 2**31 - 1), "tokens_per_minute": (0, 2**63 - 1)}


def _check_limits(**values: int | None) -> None:
    """RegistryError naming the first of `values` (None: unchanged) outside its column's range, and the range."""
    for field, value in values.items():
        low, high = _LIMIT_RANGES[field]
        if value is not None and not low <= value <= high:
            raise RegistryError(f"{field}={value} is out of range; use {'1' if low else '0 (unlimited)'} to {high}")


class Registry:
    def __init__(self, sessions: sessionmaker[Session], store: AdapterStore):
        self.sessions = sessions
        self.store = store

    def add_tenant(self, tenant_id: str, display_name: str | None = None, tier: str = "standard", weight: int = 1,
                   requests_per_minute: int = 0, tokens_per_minute: int = 0) -> TenantView:
        if not NAME_RE.match(tenant_id):
            raise RegistryError(f"tenant id {tenant_id!r} is invalid; use 1-64 letters, digits, '.', '_' or '-'")
        _check_limits(requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute, weight=weight)
        if not isinstance(tier, str) or not tier.strip() or tier != tier.strip() or len(tier) > TIER_CHARS:
            raise RegistryError(f"tier {tier!r} is invalid; use 1-{TIER_CHARS} characters without surrounding spaces "
                                "(the name `lorabatch prices set-tokens TIER` prices)")  # fmt: skip
        with self.sessions.begin() as s:
            if s.get(Tenant, tenant_id) is not None:
                raise RegistryError(f"tenant {tenant_id!r} exists already; `lorabatch tenants list` shows it")
            t = Tenant(id=tenant_id, display_name=display_name or tenant_id, tier=tier, weight=weight,
                       requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                       created_at=datetime.now(UTC))
            s.add(t)
            return _tenant(t)

    def ensure_tenant(self, tenant_id: str, **kw) -> TenantView:
        with self.sessions() as s:
            t = s.get(Tenant, tenant_id)
            if t is not None:
                return _tenant(t)
        return self.add_tenant(tenant_id, **kw)

    def list_tenants(self) -> list[TenantView]:
        with self.sessions() as s:
            return [_tenant(t) for t in s.scalars(select(Tenant).order_by(Tenant.id))]

    def existing_tenants(self, tenant_ids: Iterable[str]) -> set[str]:
        """Those of `tenant_ids` that are registered tenants."""
        wanted = set(tenant_ids)
        if not wanted:
            return set()
        with self.sessions() as s:
            return set(s.scalars(select(Tenant.id).where(Tenant.id.in_(wanted))))

    def add_adapter(self, tenant_id: str, name: str, src: Path, *, default: bool = False, public: bool = False,
                    canary: int | None = None, checks: AdapterChecks | None = None) -> tuple[AdapterView, bool]:
        """Check, store and register one adapter folder; returns (view, created). Same content under the same name is a
        no-op.

        The folder gets the checks `lorabatch adapters add` makes (engine.adapter_import): against the serving base
        with `checks` (AdapterChecks.for_model_dir), else everything but the base's shapes and fingerprint, up to the
        engine's default largest rank. A folder that fails raises AdapterError naming the file, the field and the fix,
        and stores nothing. A new version takes all of the name's traffic, or `canary` percent of it with the previous
        live version keeping the rest (`set_traffic` promotes or rolls back)."""
        if (problem := canary_problem(canary)) is not None:
            raise RegistryError(problem)
        if (problem := name_problem(name)) is not None:
            raise RegistryError(f"adapter name {problem}")
        if not self.existing_tenants([tenant_id]):
            raise RegistryError(f"tenant {tenant_id!r} does not exist; add it with `lorabatch tenants add {tenant_id}`")
        if public and (problem := public_name_problem(tenant_id, name, self.public_owners([name]).get(name, ()))):
            raise RegistryError(problem)  # before the store: nothing is written
        from engine.adapter_import import AdapterChecks, import_adapter  # torch: only where an adapter is read
        from engine.config import EngineConfig

        imported = import_adapter(Path(src), self.store, checks or AdapterChecks(None, None, EngineConfig().max_lora_rank))
        reg = Registration(tenant_id, name, imported.sha256, imported.rank, Decimal(str(imported.alpha)), imported.target_modules,
                           imported.nbytes, default=default, public=public, canary=canary)  # fmt: skip
        return self.register([reg])[0]

    def register(self, regs: Sequence[Registration]) -> list[tuple[AdapterView, bool]]:
        """Register adapters already in the store, in one transaction; (view, created) for each, in order.

        Each has the effect `add_adapter` would have, applied in order: same content as the name's latest version only
        sets the flags (created False); new content is the name's next version. One query reads the names' versions and
        the tenants' defaults, where add_adapter alone would read them once per adapter. Tenants must exist and names be
        valid (`existing_tenants`, `name_problem`); a tenant and name appear at most once."""
        keys = [(r.tenant_id, r.name) for r in regs]
        assert len(set(keys)) == len(keys), "a tenant and name registered twice in one transaction"
        if not regs:
            return []
        tenants = sorted({t for t, _ in keys})
        for _attempt in range(3):  # two registrations racing for a name's next version: retry on the unique key
            try:
                with self.sessions.begin() as s:
                    found = s.scalars(select(Adapter).where(Adapter.tenant_id.in_(tenants), Adapter.name.in_(sorted({n for _, n in keys})))
                                      .order_by(Adapter.version))  # fmt: skip
                    versions: dict[tuple[str, str], list[Adapter]] = {}
                    for row in found:
                        versions.setdefault((row.tenant_id, row.name), []).append(row)
                    defaults: dict[str, list[Adapter]] = {t: [] for t in tenants}
                    for row in s.scalars(select(Adapter).where(Adapter.tenant_id.in_(tenants), Adapter.is_default)):
                        defaults[row.tenant_id].append(row)
                    # Checked again here, where it holds for this transaction's reads (callers check before storing).
                    public_names = {r.name for r in regs if r.public}
                    owners = {n: set() for n in public_names} | _public_owners(s, public_names)
                    done = []
                    for r in regs:
                        if r.name in owners:
                            if r.public and (problem := public_name_problem(r.tenant_id, r.name, owners[r.name])):
                                raise RegistryError(f"{r.tenant_id}/{r.name}: {problem}")
                            owners[r.name] = owners[r.name] - {r.tenant_id} | ({r.tenant_id} if r.public else set())
                        done.append(self._register_one(s, r, versions.get((r.tenant_id, r.name), []), defaults[r.tenant_id]))
                    s.flush()
                    return [(_view(a), created) for a, created in done]
            except IntegrityError:
                continue
        names = ", ".join(f"{t}/{n}" for t, n in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        raise RegistryError(f"could not register {names}: concurrent registrations kept colliding; try again")

    @staticmethod
    def _register_one(s: Session, reg: Registration, rows: list[Adapter], defaults: list[Adapter]) -> tuple[Adapter, bool]:
        """`reg` against its name's `rows` (versions, ascending) and its tenant's `defaults`, both kept current."""
        prev = rows[-1] if rows else None
        make_default = reg.default or (prev is not None and prev.is_default)
        if make_default:  # one default per tenant: the rows read, and those this transaction made default
            for row in defaults:
                row.is_default = False
            defaults.clear()
        if prev is not None and prev.sha256 == reg.sha256:  # same content: only the flags may change
            if prev.is_public and not reg.public:
                # Made private: the name is, every version of it. Other tenants are served a name's public versions
                # (RegistrySnapshot.versions), so a public v1 left behind served them v1, rolled back or not.
                for row in rows:
                    row.is_public = False
            prev.is_default, prev.is_public = make_default, reg.public
            if make_default:
                defaults.append(prev)
            return prev, False
        live = [r for r in rows if r.traffic_weight > 0]
        canary = reg.canary
        for r in rows:  # the new version takes over, or shares with the latest live one
            r.traffic_weight = 100 - canary if canary is not None and live and r is live[-1] else 0
        a = Adapter(
            tenant_id=reg.tenant_id, name=reg.name, version=prev.version + 1 if prev else 1, sha256=reg.sha256,
            rank=reg.rank, alpha=reg.alpha, target_modules=sorted(reg.target_modules), nbytes=reg.nbytes,
            is_public=reg.public, is_default=make_default, created_at=datetime.now(UTC),
            traffic_weight=canary if canary is not None and live else 100,
        )
        s.add(a)
        rows.append(a)
        if make_default:
            defaults.append(a)
        return a, True

    def public_owners(self, names: Iterable[str]) -> dict[str, set[str]]:
        """Of `names`, each one some tenant has a public adapter of, with those tenants."""
        with self.sessions() as s:
            return _public_owners(s, set(names))

    def set_traffic(self, tenant_id: str, name: str, weights: dict[int, int]) -> list[AdapterView]:
        """Split a name's traffic among its versions by weight; versions not named get 0."""
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) == 0:
            raise RegistryError("give VERSION=WEIGHT pairs with weights >= 0 and at least one above 0, e.g. 1=90 2=10")
        if (big := max(weights.values())) > WEIGHT_MAX:  # adapters.traffic_weight is INTEGER; the database refused it
            raise RegistryError(f"weight {big} is too large; give weights from 0 to {WEIGHT_MAX} (only their ratio counts, "
                                "e.g. 1=90 2=10)")  # fmt: skip
        with self.sessions.begin() as s:
            rows = list(s.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name).order_by(Adapter.version)))
            if not rows:
                raise RegistryError(f"tenant {tenant_id!r} has no adapter {name!r}; `lorabatch adapters list` shows them")
            unknown = set(weights) - {r.version for r in rows}
            if unknown:
                raise RegistryError(f"{name} has no version {sorted(unknown)}; its versions are {[r.version for r in rows]}")
            for r in rows:
                r.traffic_weight = weights.get(r.version, 0)
            return [_view(r) for r in rows]

    def set_limits(self, tenant_id: str, requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
                   weight: int | None = None) -> TenantView:
        with self.sessions.begin() as s:
            t = s.get(Tenant, tenant_id)
            if t is None:
                raise RegistryError(f"tenant {tenant_id!r} does not exist; add it with `lorabatch tenants add {tenant_id}`")
            limits = {"requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute, "weight": weight}
            _check_limits(**limits)
            for field, value in limits.items():
                if value is not None:
                    setattr(t, field, value)
            return _tenant(t)

    def add_rule(self, tenant_id: str, kind: str, pattern: str, adapter: str, position: int = 0) -> RouteRule:
        """Add a routing rule. Everything a job would trip on is refused now, not per job: a bad pattern, a position
        outside the column, an ADAPTER that is not `name` or `name@N` (one such rule crashed workers), and one the tenant
        cannot use (neither its own nor public, or a version that does not exist). A rule naming an adapter removed or
        made private later is skipped by routing (the tenant's default serves)."""
        compile_rule(RouteRule(0, tenant_id, kind, pattern, adapter, position))
        low, high = POSITION_RANGE
        if not low <= position <= high:
            raise RegistryError(f"position {position} is out of range; give --position a whole number from {low} to {high} "
                                "(rules match in ascending position)")  # fmt: skip
        ref = ADAPTER_REF_RE.match(adapter)
        if ref is None:
            raise RegistryError(f"ADAPTER {adapter!r} is not an adapter name; write NAME or NAME@VERSION (NAME 1-64 letters, "
                                "digits, '.', '_' or '-'; VERSION a positive whole number of at most 9 digits), e.g. "
                                "support or support@2")  # fmt: skip
        with self.sessions.begin() as s:
            if s.get(Tenant, tenant_id) is None:
                raise RegistryError(f"tenant {tenant_id!r} does not exist; add it with `lorabatch tenants add {tenant_id}`")
            _check_usable(s, tenant_id, ref["name"], int(ref["version"]) if ref["version"] else None)
            row = RouteRuleRow(tenant_id=tenant_id, kind=kind, pattern=pattern, adapter=adapter, position=position,
                               created_at=datetime.now(UTC))
            s.add(row)
            s.flush()
            return _rule(row)

    def list_rules(self, tenant_id: str | None = None) -> list[RouteRule]:
        q = select(RouteRuleRow).order_by(RouteRuleRow.tenant_id, RouteRuleRow.position, RouteRuleRow.id)
        if tenant_id is not None:
            q = q.where(RouteRuleRow.tenant_id == tenant_id)
        with self.sessions() as s:
            return [_rule(r) for r in s.scalars(q)]

    def remove_rule(self, rule_id: int) -> None:
        with self.sessions.begin() as s:
            # Rule ids are the table's 32-bit keys: a larger one is no rule (SQLite raised OverflowError past 2^63,
            # PostgreSQL a DataError past 2^31, each a traceback from `routes remove`)
            row = s.get(RouteRuleRow, rule_id) if 1 <= rule_id <= 2**31 - 1 else None
            if row is None:
                raise RegistryError(f"no route rule {rule_id}; `lorabatch routes list` shows their ids")
            s.delete(row)

    def prune_store(self, grace_s: float, *, dry_run: bool = False, now: float | None = None) -> list[StoreEntry]:
        """Remove what the store holds that no registered adapter (any tenant, any version) names, and unfinished writes,
        once older than `grace_s` seconds; return what was (or, with `dry_run`, would be) removed.

        Left behind by a registration that stored its content and then failed (a transaction refused, the database
        down mid-call, the command interrupted) and by a crashed write. The grace keeps a registration under way safe:
        its content was written, or put again (which renews the entry's time), moments before its row."""
        now = time.time() if now is None else now
        with self.sessions() as s:
            named = set(s.scalars(select(Adapter.sha256).distinct()))
        gone = []
        for entry in self.store.entries():
            if (entry.unfinished or entry.name not in named) and now - entry.mtime >= grace_s:
                if dry_run or self.store.remove(entry, unless_newer_than=entry.mtime):
                    gone.append(entry)
        return gone

    def list_adapters(self, tenant_id: str | None = None) -> list[AdapterView]:
        q = select(Adapter).order_by(Adapter.tenant_id, Adapter.name, Adapter.version)
        if tenant_id is not None:
            q = q.where(Adapter.tenant_id == tenant_id)
        with self.sessions() as s:
            return [_view(a) for a in s.scalars(q)]

    def snapshot(self) -> RegistrySnapshot:
        with self.sessions() as s:
            tenants = {t.id: _tenant(t) for t in s.scalars(select(Tenant))}
            rules = tuple(_rule(r) for r in s.scalars(select(RouteRuleRow)))
            adapters: dict[tuple[str, str], list[AdapterView]] = {}
            for a in s.scalars(select(Adapter).order_by(Adapter.version)):
                adapters.setdefault((a.tenant_id, a.name), []).append(_view(a))
        defaults = {}
        for versions in adapters.values():
            for v in versions:
                if v.is_default:
                    defaults[v.tenant_id] = v
        return RegistrySnapshot(tenants, {k: tuple(v) for k, v in adapters.items()}, defaults, rules)
