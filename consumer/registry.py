"""The tenant and adapter registry, kept in the SQL database beside the ledger.

Adapters are stored by content (sha256) in the adapter store; the registry maps
(tenant, name, version) to that content. Re-adding the same content under a name is a no-op; new
content under an existing name becomes its next version. Workers read an immutable snapshot and
refresh it on an interval, so registry changes need no restart.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.models import Adapter, Tenant
from consumer.rules import RouteRule
from engine.store import AdapterStore

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class RegistryError(Exception):
    retriable = False


@dataclass(frozen=True)
class TenantView:
    id: str
    display_name: str
    tier: str
    weight: int
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0


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
    def ref(self) -> str:
        """`name@version`: how results, the ledger and invoices name it."""
        return f"{self.name}@{self.version}"

    @property
    def key(self) -> str:
        """The engine's key: unique across tenants."""
        return f"{self.tenant_id}/{self.name}@{self.version}"


def _view(a: Adapter) -> AdapterView:
    return AdapterView(
        tenant_id=a.tenant_id, name=a.name, version=a.version, sha256=a.sha256, rank=a.rank,
        alpha=Decimal(a.alpha), target_modules=tuple(a.target_modules),
        nbytes=a.nbytes, is_public=a.is_public, is_default=a.is_default,
    )


@dataclass(frozen=True)
class RegistrySnapshot:
    tenants: dict[str, TenantView]
    adapters: dict[tuple[str, str], tuple[AdapterView, ...]]  # (owner, name) -> versions, ascending
    defaults: dict[str, AdapterView]
    rules: tuple[RouteRule, ...] = ()

    def versions(self, tenant_id: str, name: str) -> tuple[AdapterView, ...]:
        """The tenant's own adapter of that name, else a public one of another tenant."""
        own = self.adapters.get((tenant_id, name))
        if own:
            return own
        public = [vs for (owner, n), vs in self.adapters.items() if n == name and vs[-1].is_public]
        return public[0] if len(public) == 1 else ()

    def owned_elsewhere(self, tenant_id: str, name: str) -> bool:
        return any(n == name and owner != tenant_id for owner, n in self.adapters)


class Registry:
    def __init__(self, sessions: sessionmaker[Session], store: AdapterStore):
        self.sessions = sessions
        self.store = store

    def add_tenant(self, tenant_id: str, display_name: str | None = None, tier: str = "standard", weight: int = 1) -> TenantView:
        if not NAME_RE.match(tenant_id):
            raise RegistryError(f"tenant id {tenant_id!r} is invalid; use 1-64 letters, digits, '.', '_' or '-'")
        if weight < 1:
            raise RegistryError(f"weight must be at least 1, got {weight}")
        with self.sessions.begin() as s:
            if s.get(Tenant, tenant_id) is not None:
                raise RegistryError(f"tenant {tenant_id!r} exists already; `lorabatch tenants list` shows it")
            t = Tenant(id=tenant_id, display_name=display_name or tenant_id, tier=tier, weight=weight,
                       created_at=datetime.now(UTC))
            s.add(t)
            return TenantView(t.id, t.display_name, t.tier, t.weight)

    def ensure_tenant(self, tenant_id: str, **kw) -> TenantView:
        with self.sessions() as s:
            t = s.get(Tenant, tenant_id)
            if t is not None:
                return TenantView(t.id, t.display_name, t.tier, t.weight)
        return self.add_tenant(tenant_id, **kw)

    def list_tenants(self) -> list[TenantView]:
        with self.sessions() as s:
            return [TenantView(t.id, t.display_name, t.tier, t.weight) for t in s.scalars(select(Tenant).order_by(Tenant.id))]

    def add_adapter(self, tenant_id: str, name: str, src: Path, *, default: bool = False, public: bool = False) -> tuple[AdapterView, bool]:
        """Store and register; returns (view, created). Same content under the same name is a no-op."""
        if not NAME_RE.match(name):
            raise RegistryError(f"adapter name {name!r} is invalid; use 1-64 letters, digits, '.', '_' or '-'")
        with self.sessions() as s:
            if s.get(Tenant, tenant_id) is None:
                raise RegistryError(f"tenant {tenant_id!r} does not exist; add it with `lorabatch tenants add {tenant_id}`")
        sha = self.store.put(Path(src))
        cfg = json.loads((self.store.path(sha) / "adapter_config.json").read_text())
        targets = cfg.get("target_modules") or []
        if isinstance(targets, str):
            targets = [targets]
        nbytes = sum(f.stat().st_size for f in self.store.path(sha).iterdir())
        for _attempt in range(3):  # two registrations racing for the next version: retry on the unique key
            try:
                with self.sessions.begin() as s:
                    rows = list(s.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name).order_by(Adapter.version)))
                    prev = rows[-1] if rows else None
                    make_default = default or (prev is not None and prev.is_default)
                    if make_default:
                        s.execute(update(Adapter).where(Adapter.tenant_id == tenant_id).values(is_default=False))
                    if prev is not None and prev.sha256 == sha:  # same content: only the flags may change
                        prev.is_default, prev.is_public = make_default, public
                        return _view(prev), False
                    a = Adapter(
                        tenant_id=tenant_id, name=name, version=prev.version + 1 if prev else 1, sha256=sha,
                        rank=int(cfg["r"]), alpha=Decimal(str(cfg.get("lora_alpha", cfg["r"]))),
                        target_modules=sorted(targets), nbytes=nbytes, is_public=public,
                        is_default=make_default, created_at=datetime.now(UTC),
                    )
                    s.add(a)
                    s.flush()
                    return _view(a), True
            except IntegrityError:
                continue
        raise RegistryError(f"could not register {tenant_id}/{name}: concurrent registrations kept colliding; try again")

    def list_adapters(self, tenant_id: str | None = None) -> list[AdapterView]:
        q = select(Adapter).order_by(Adapter.tenant_id, Adapter.name, Adapter.version)
        if tenant_id is not None:
            q = q.where(Adapter.tenant_id == tenant_id)
        with self.sessions() as s:
            return [_view(a) for a in s.scalars(q)]

    def snapshot(self) -> RegistrySnapshot:
        with self.sessions() as s:
            tenants = {t.id: TenantView(t.id, t.display_name, t.tier, t.weight) for t in s.scalars(select(Tenant))}
            adapters: dict[tuple[str, str], list[AdapterView]] = {}
            for a in s.scalars(select(Adapter).order_by(Adapter.version)):
                adapters.setdefault((a.tenant_id, a.name), []).append(_view(a))
        defaults = {}
        for versions in adapters.values():
            for v in versions:
                if v.is_default:
                    defaults[v.tenant_id] = v
        for key, versions in adapters.items():  # until weights are stored: the newest version takes all traffic
            adapters[key] = [replace(v, traffic_weight=100 if v is versions[-1] else 0) for v in versions]
        return RegistrySnapshot(tenants, {k: tuple(v) for k, v in adapters.items()}, defaults)
