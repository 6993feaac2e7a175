"""Routing: which adapter serves a job, why, and how long deciding took.

Order (DESIGN.md, "Routing"): explicit adapter -> tenant default -> base model where the job allows it.
The Redis L1 user / L2 session maps and the per-tenant rules slot in between explicit and default.
A tenant may use only its own adapters and public ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from consumer.registry import AdapterView, RegistrySnapshot
from consumer.schemas import ErrorInfo, Job


class RouteError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, field=field)


@dataclass(frozen=True)
class Route:
    adapter: AdapterView | None  # None: the base model
    reason: str  # explicit | tenant_default | base_fallback
    decision_us: int


def _pick(snapshot: RegistrySnapshot, job: Job, ref: str) -> AdapterView:
    name, _, version = ref.partition("@")
    versions = snapshot.versions(job.tenant_id, name)
    if not versions:
        if snapshot.owned_elsewhere(job.tenant_id, name):
            raise RouteError(
                "adapter_forbidden",
                f"adapter {name!r} belongs to another tenant and is not public; use one of tenant "
                f"{job.tenant_id!r}'s adapters (`lorabatch adapters list --tenant {job.tenant_id}`)",
                "adapter",
            )
        raise RouteError(
            "unknown_adapter",
            f"tenant {job.tenant_id!r} has no adapter {name!r}; register it with "
            f"`lorabatch adapters add --tenant {job.tenant_id} {name} DIR` or fix `adapter`",
            "adapter",
        )
    if not version:
        return versions[-1]
    for v in versions:
        if v.version == int(version):
            return v
    raise RouteError(
        "unknown_adapter",
        f"adapter {name!r} has no version {version} (versions: {', '.join(str(v.version) for v in versions)}); fix `adapter`",
        "adapter",
    )


def route(snapshot: RegistrySnapshot, job: Job) -> Route:
    """Decide the adapter for a job; raise RouteError with a code, a fix and the field at fault."""
    t0 = time.perf_counter_ns()
    if job.tenant_id not in snapshot.tenants:
        raise RouteError(
            "unknown_tenant",
            f"tenant {job.tenant_id!r} is not registered; add it with `lorabatch tenants add {job.tenant_id}`",
            "tenant_id",
        )
    if job.adapter is not None:
        adapter, reason = _pick(snapshot, job, job.adapter), "explicit"
    elif (default := snapshot.defaults.get(job.tenant_id)) is not None:
        adapter, reason = snapshot.versions(job.tenant_id, default.name)[-1], "tenant_default"
    elif job.allow_base_fallback:
        adapter, reason = None, "base_fallback"
    else:
        raise RouteError(
            "no_adapter",
            f"the job names no adapter and tenant {job.tenant_id!r} has no default; set `adapter`, register a "
            f"default (`lorabatch adapters add --default`), or set `allow_base_fallback`",
            "adapter",
        )
    return Route(adapter, reason, (time.perf_counter_ns() - t0) // 1000)
