"""Routing: which adapter serves a job, why, and how long deciding took.

Order: the job's adapter_ref -> L1 user map -> L2 session map -> L3 per-tenant rules
-> tenant default -> base model where the job allows it. A tenant may use only its own adapters and
public ones. Decisions are written back to L1/L2 so that users and sessions stick to their adapter.
An unversioned name picks among its live versions by traffic weight (canary), deterministically per
request id so that a redelivered job routes the same way. An adapter whose circuit is open fails fast.

The caches are read for a whole fetched batch in one round trip; each decision's measured duration is
its own resolution time plus an equal share of that round trip.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from consumer.breaker import BreakerBoard
from consumer.registry import AdapterView, RegistrySnapshot
from consumer.route_cache import CacheKey, RouteCache
from consumer.rules import Classifier
from consumer.schemas import ErrorInfo, Job

log = logging.getLogger(__name__)

# Reasons are a closed set, so they can label metrics.
REASONS = ("explicit", "l1_user", "l2_session", "l3_rule", "tenant_default", "base_fallback")
# An adapter reference: a name, then optionally @ and a version (a whole number of at most 9 digits). Jobs are checked by
# their schema; this checks what comes from elsewhere too (the route caches, rules written before `routes add` checked).
REF_RE = re.compile(r"([^@\s]{1,160})(?:@([0-9]{1,9}))?")


class RouteError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None, retriable: bool = False):
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, field=field, retriable=retriable)


@dataclass(frozen=True)
class Route:
    view: AdapterView | None  # the registry's view of the chosen adapter; None: the base model
    reason: str  # one of REASONS
    routing_us: int  # the decision alone
    detail: str = ""  # e.g. the rule that matched, "cache unavailable", "circuit open"

    @property
    def label(self) -> str:
        """The reason as results and the ledger show it: `reason` or `reason (detail)`."""
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


def pick_version(versions: Sequence[AdapterView], request_id: str) -> AdapterView:
    """Among live versions (traffic_weight > 0), by weight; deterministic per request id."""
    live = [v for v in versions if v.traffic_weight > 0]
    if len(live) <= 1:
        return live[0] if live else versions[-1]
    total = sum(v.traffic_weight for v in live)
    point = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") % total
    for v in live:
        point -= v.traffic_weight
        if point < 0:
            return v
    raise AssertionError("unreachable: point < total")


def resolve_ref(snapshot: RegistrySnapshot, tenant_id: str, ref: str, request_id: str) -> AdapterView:
    """`name` or `name@version` among the tenant's own and public adapters; RouteError otherwise."""
    parsed = REF_RE.fullmatch(ref) if isinstance(ref, str) else None
    if parsed is None:
        raise RouteError("unknown_adapter", f"adapter reference {str(ref)[:80]!r} is not `name` or `name@version` (a version is "
                         "a whole number of at most 9 digits); fix `adapter_ref`", "adapter_ref")  # fmt: skip
    name, version = parsed.group(1), parsed.group(2)
    versions = snapshot.versions(tenant_id, name)
    if not versions:
        owners = snapshot.public_owners(tenant_id, name)
        if len(owners) > 1:
            raise RouteError(
                "adapter_forbidden",
                f"adapter {name!r} is public under several tenants ({', '.join(sorted(owners))}), so the name does not say "
                f"which; register an adapter of that name for tenant {tenant_id!r}, or ask its owners to rename theirs",
                "adapter_ref",
            )
        if snapshot.owned_elsewhere(tenant_id, name):
            raise RouteError(
                "adapter_forbidden",
                f"adapter {name!r} belongs to another tenant and is not public; use one of tenant "
                f"{tenant_id!r}'s adapters (`lorabatch adapters list --tenant {tenant_id}`)",
                "adapter_ref",
            )
        raise RouteError(
            "unknown_adapter",
            f"tenant {tenant_id!r} has no adapter {name!r}; register it with "
            f"`lorabatch adapters add --tenant {tenant_id} {name} DIR` or fix `adapter_ref`",
            "adapter_ref",
        )
    if not version:
        return pick_version(versions, request_id)
    for v in versions:
        if v.version == int(version):
            return v
    raise RouteError(
        "unknown_adapter",
        f"adapter {name!r} has no version {version} (versions: {', '.join(str(v.version) for v in versions)}); fix `adapter_ref`",
        "adapter_ref",
    )


def job_text(job: Job) -> str | None:
    """What the rules read: the prompt, or the last user message."""
    if job.prompt is not None:
        return job.prompt
    if job.messages:
        users = [m.content for m in job.messages if m.role == "user"]
        return users[-1] if users else job.messages[-1].content
    return None


class Router:
    def __init__(self, cache: RouteCache, breakers: BreakerBoard | None = None):
        self.cache = cache
        self.breakers = breakers or BreakerBoard()

    async def route_batch(self, snapshot: RegistrySnapshot, classifier: Classifier, jobs: Sequence[Job]) -> list[Route | RouteError]:
        t0 = time.perf_counter_ns()
        keys: list[CacheKey] = []
        for job in jobs:
            if job.adapter_ref is None and job.tenant_id in snapshot.tenants:
                if job.user_id:
                    keys.append(CacheKey("l1", job.tenant_id, job.user_id))
                if job.session_id:
                    keys.append(CacheKey("l2", job.tenant_id, job.session_id))
        cached = await self.cache.get_many(keys) if keys else {}
        cache_ok = cached is not None
        share_us = (time.perf_counter_ns() - t0) // 1000 // max(1, len(keys))
        out: list[Route | RouteError] = []
        write_back: dict[CacheKey, str] = {}
        known = dict(cached or {})  # grows with this batch's own decisions: a session sticks within a batch too
        for job in jobs:
            t1 = time.perf_counter_ns()
            try:
                route = self._decide(snapshot, classifier, job, known, cache_ok, write_back)
            except RouteError as e:
                out.append(e)
                continue
            except Exception as e:  # noqa: BLE001 - a bug on our side fails this job alone, never its batch or the worker
                log.exception("routing request %r of tenant %r failed", job.request_id, job.tenant_id)
                out.append(RouteError("routing_failed", f"routing this job failed ({type(e).__name__}); it was logged, "
                                      "and the same request_id may be sent again", retriable=True))  # fmt: skip
                continue
            spent = (time.perf_counter_ns() - t1) // 1000
            if job.adapter_ref is None and (job.user_id or job.session_id):
                spent += share_us * ((job.user_id is not None) + (job.session_id is not None))
            out.append(Route(route.view, route.reason, spent, route.detail))
        if write_back and cache_ok:
            await self.cache.set_many(write_back)
        return out

    def _decide(self, snapshot: RegistrySnapshot, classifier: Classifier, job: Job, cached: dict[CacheKey, str],
                cache_ok: bool, write_back: dict[CacheKey, str]) -> Route:
        tenant = job.tenant_id
        if tenant not in snapshot.tenants:
            raise RouteError("unknown_tenant", f"tenant {tenant!r} is not registered; add it with "
                                               f"`lorabatch tenants add {tenant}`", "tenant_id")
        # said of the jobs whose routing the cache had a say in: one naming its adapter, or with no user or session, lost nothing
        consulted = job.adapter_ref is None and bool(job.user_id or job.session_id)
        view, reason, detail = None, "", "" if cache_ok or not consulted else "cache unavailable"
        if job.adapter_ref is not None:
            view, reason = resolve_ref(snapshot, tenant, job.adapter_ref, job.request_id), "explicit"
        else:
            for level, subject, why in (("l1", job.user_id, "l1_user"), ("l2", job.session_id, "l2_session")):
                ref = cached.get(CacheKey(level, tenant, subject)) if subject else None
                if ref is None:
                    continue
                try:
                    view = resolve_ref(snapshot, tenant, ref, job.request_id)
                except RouteError:
                    continue  # a stale entry (adapter removed or made private, or not a reference): fall through
                if view.traffic_weight == 0 and any(v.traffic_weight > 0 for v in snapshot.versions(tenant, view.name)):
                    view = None  # a version since taken out of traffic (`adapters traffic`, a rollback): stale too
                    continue
                reason = why
                break
            if view is None and (text := job_text(job)) is not None:
                rule = classifier.classify(tenant, text)
                if rule is not None:
                    try:
                        view, reason = resolve_ref(snapshot, tenant, rule.adapter, job.request_id), "l3_rule"
                        detail = f"rule {rule.id} {rule.kind}" + (f", {detail}" if detail else "")
                    except RouteError:
                        pass  # a rule naming a removed adapter: the default still serves
            if view is None and (default := snapshot.defaults.get(tenant)) is not None:
                view = pick_version(snapshot.versions(tenant, default.name), job.request_id)
                reason = "tenant_default"
        if view is None:
            if job.allow_base_fallback:
                return Route(None, "base_fallback", 0, detail)
            raise RouteError("no_adapter", f"the job names no adapter and tenant {tenant!r} has no default; set "
                             f"`adapter_ref`, register a default (`lorabatch adapters add --default`), or set "
                             f"`allow_base_fallback`", "adapter_ref")
        if not self.breakers.allow(view.adapter_key):
            if job.allow_base_fallback:
                return Route(None, "base_fallback", 0, f"{view.adapter} circuit open")
            raise RouteError("adapter_circuit_open", f"adapter {view.adapter} is failing and its circuit is open; "
                             f"retry later or set `allow_base_fallback`", "adapter_ref", retriable=True)
        if reason in ("explicit", "l3_rule", "tenant_default"):
            ref = view.adapter
            if job.user_id and reason == "explicit":
                write_back[CacheKey("l1", tenant, job.user_id)] = ref
            if job.session_id:
                write_back[CacheKey("l2", tenant, job.session_id)] = ref
            cached.update(write_back)
        return Route(view, reason, 0, detail)
