"""Routing: the decision order, its reasons, ACLs, write-back, canary splits and the circuit breaker."""

from __future__ import annotations

import asyncio
from collections import Counter
from decimal import Decimal

import pytest

from consumer.breaker import BreakerBoard
from consumer.registry import AdapterView, RegistrySnapshot, TenantView
from consumer.route_cache import CacheKey, LruRouteCache
from consumer.routing import REASONS, Route, RouteError, Router, pick_version
from consumer.rules import RouteRule, RuleClassifier, RuleError, compile_rule
from consumer.schemas import Job


def _a(tenant, name, version=1, public=False, default=False, weight=100):
    return AdapterView(tenant, name, version, "0" * 64, 8, Decimal(16), ("q_proj",), 1000, public, default, weight)


def snapshot() -> RegistrySnapshot:
    adapters = {
        ("acme", "support"): (_a("acme", "support", 1, weight=0), _a("acme", "support", 2, default=True)),
        ("acme", "legal"): (_a("acme", "legal"),),
        ("acme", "billing"): (_a("acme", "billing"),),
        ("globex", "chat"): (_a("globex", "chat", default=True),),
        ("globex", "shared"): (_a("globex", "shared", public=True),),
        ("globex", "secret"): (_a("globex", "secret"),),
    }
    tenants = {t: TenantView(t, t, "standard", 1) for t in ("acme", "globex", "hooli")}
    defaults = {"acme": adapters[("acme", "support")][1], "globex": adapters[("globex", "chat")][0]}
    rules = (
        RouteRule(1, "acme", "keyword", "lawsuit", "legal", 0),
        RouteRule(2, "acme", "prefix", "INVOICE", "billing", 1),
        RouteRule(3, "acme", "regex", r"contract\s+#\d+", "legal@1", 2),
        RouteRule(4, "acme", "keyword", "gone", "removed-adapter", 3),
    )
    return RegistrySnapshot(tenants, adapters, defaults, rules)


def job(**kw) -> Job:
    d = {"request_id": "r1", "tenant_id": "acme", "prompt": "hello there"}
    d.update(kw)
    return Job.model_validate(d)


async def route_one(router, snap, j) -> Route | RouteError:
    return (await router.route_batch(snap, RuleClassifier(snap.rules), [j]))[0]


@pytest.mark.parametrize(
    ("fields", "reason", "adapter"),
    [
        ({"adapter": "legal"}, "explicit", "legal@1"),
        ({"adapter": "support@1"}, "explicit", "support@1"),
        ({"adapter": "shared"}, "explicit", "shared@1"),  # another tenant's public adapter
        ({"prompt": "about the LAWSUIT, please"}, "l3_rule", "legal@1"),
        ({"prompt": "  invoice 42 is late"}, "l3_rule", "billing@1"),
        ({"prompt": "see contract #12"}, "l3_rule", "legal@1"),
        ({"prompt": "lawsuits are not a keyword match"}, "tenant_default", "support@2"),
        ({"prompt": "this rule's adapter is gone"}, "tenant_default", "support@2"),
        ({"prompt": None, "messages": [{"role": "user", "content": "a lawsuit"}]}, "l3_rule", "legal@1"),
        ({"prompt": None, "input_ids": [1, 2]}, "tenant_default", "support@2"),
        ({"tenant_id": "hooli", "allow_base_fallback": True}, "base_fallback", None),
    ],
)
async def test_decision_order_and_reasons(fields, reason, adapter):
    r = await route_one(Router(LruRouteCache(100, 60)), snapshot(), job(**fields))
    assert isinstance(r, Route), r
    assert r.reason == reason and r.reason in REASONS
    assert (r.view.adapter if r.view else None) == adapter
    assert r.routing_us >= 0


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"adapter": "secret"}, "adapter_forbidden", "adapter_ref"),
        ({"adapter": "nope"}, "unknown_adapter", "adapter_ref"),
        ({"adapter": "legal@7"}, "unknown_adapter", "adapter_ref"),
        ({"tenant_id": "ghost"}, "unknown_tenant", "tenant_id"),
        ({"tenant_id": "hooli"}, "no_adapter", "adapter_ref"),
    ],
)
async def test_refusals_name_the_field(fields, code, field):
    r = await route_one(Router(LruRouteCache(100, 60)), snapshot(), job(**fields))
    assert isinstance(r, RouteError)
    assert (r.info.code, r.info.field) == (code, field)
    assert "`" in r.info.message  # says what to run or set


async def test_l1_and_l2_hits_and_write_back():
    """An explicit choice sticks to the user (L1) and the session (L2); later jobs hit them, with reasons."""
    cache = LruRouteCache(100, 60)
    router, snap = Router(cache), snapshot()
    first = await route_one(router, snap, job(adapter="legal", user_id="u1", session_id="s1"))
    assert first.reason == "explicit"
    assert await cache.get_many([CacheKey("l1", "acme", "u1"), CacheKey("l2", "acme", "s1")]) == {
        CacheKey("l1", "acme", "u1"): "legal@1", CacheKey("l2", "acme", "s1"): "legal@1"}
    by_user = await route_one(router, snap, job(request_id="r2", user_id="u1"))
    assert (by_user.reason, by_user.view.adapter) == ("l1_user", "legal@1")
    by_session = await route_one(router, snap, job(request_id="r3", user_id="u2", session_id="s1"))
    assert (by_session.reason, by_session.view.adapter) == ("l2_session", "legal@1")
    miss = await route_one(router, snap, job(request_id="r4", user_id="u3", session_id="s9"))
    assert miss.reason == "tenant_default"
    # the default decision was written back to the session, so the session sticks even if the default moves
    assert (await cache.get_many([CacheKey("l2", "acme", "s9")])) == {CacheKey("l2", "acme", "s9"): "support@2"}


async def test_stale_cache_entry_falls_through():
    """A cached adapter the tenant may no longer use is skipped, never served."""
    cache = LruRouteCache(100, 60)
    await cache.set_many({CacheKey("l1", "acme", "u1"): "secret@1"})
    r = await route_one(Router(cache), snapshot(), job(user_id="u1"))
    assert r.reason == "tenant_default"


class _Away(LruRouteCache):
    """A route cache whose store is away: reads answer None, as RedisRouteCache's do while Redis is down."""

    async def get_many(self, keys):
        return None


async def test_only_jobs_the_cache_had_a_say_in_are_routed_cache_unavailable():
    """With the cache away, a job with a user or session id routed without it says so; one naming its adapter, or with
    neither id, lost nothing to the outage, and its route said "cache unavailable" all the same (on its result and its
    ledger row), which made an outage look wider than it was."""
    snap = snapshot()
    jobs = [job(request_id="r1", user_id="u1"), job(request_id="r2", adapter="legal", user_id="u1"), job(request_id="r3"),
            job(request_id="r4", session_id="s1", prompt="a lawsuit")]
    routes = await Router(_Away(100, 60)).route_batch(snap, RuleClassifier(snap.rules), jobs)
    assert [(r.reason, r.detail) for r in routes] == [("tenant_default", "cache unavailable"), ("explicit", ""),
                                                     ("tenant_default", ""), ("l3_rule", "rule 1 keyword, cache unavailable")]


async def test_lru_cache_is_bounded_and_expires():
    now = [0.0]
    cache = LruRouteCache(2, 10, clock=lambda: now[0])
    keys = [CacheKey("l1", "t", str(i)) for i in range(3)]
    for k in keys:
        await cache.set_many({k: "a@1"})
    assert len(cache) == 2 and keys[0] not in await cache.get_many(keys)
    now[0] = 11.0
    assert await cache.get_many(keys) == {}


def test_canary_split_is_weighted_and_deterministic():
    """A 10% canary gets 10 +/- 3% of 1,000 jobs, and a request id always lands on the same version."""
    versions = (_a("acme", "support", 1, weight=90), _a("acme", "support", 2, weight=10))
    picks = Counter(pick_version(versions, f"req-{i}").version for i in range(1000))
    assert 70 <= picks[2] <= 130, picks
    assert all(pick_version(versions, f"req-{i}") == pick_version(versions, f"req-{i}") for i in range(50))
    assert pick_version((_a("a", "x", 1, weight=0), _a("a", "x", 2, weight=0)), "r").version == 2


async def test_circuit_breaker_fails_fast_then_probes():
    now = [0.0]
    board = BreakerBoard(failure_rate=0.5, min_requests=4, window_s=60, cooldown_s=10, clock=lambda: now[0])
    router, snap = Router(LruRouteCache(10, 60), board), snapshot()
    key = snap.adapters[("acme", "legal")][0].adapter_key
    for ok in (False, False, True, False):
        board.record(key, ok)
    refused = await route_one(router, snap, job(adapter="legal"))
    assert isinstance(refused, RouteError) and refused.info.code == "adapter_circuit_open" and refused.info.retriable
    fallback = await route_one(router, snap, job(adapter="legal", allow_base_fallback=True))
    assert fallback.view is None and "circuit open" in fallback.label
    now[0] = 11.0  # half-open: exactly one probe goes through
    assert isinstance(await route_one(router, snap, job(adapter="legal")), Route)
    assert isinstance(await route_one(router, snap, job(adapter="legal")), RouteError)
    board.record(key, True)
    assert board.state(key) == "closed"
    assert isinstance(await route_one(router, snap, job(adapter="legal")), Route)


async def test_a_probe_that_ends_with_no_verdict_lets_the_next_job_probe():
    """A half-open probe whose job ended saying nothing about the adapter (the engine failed under it) frees the probe,
    where the circuit stayed half-open refusing every job until the worker restarted; failures count in the window."""
    now = [0.0]
    board = BreakerBoard(failure_rate=0.5, min_requests=2, window_s=60, cooldown_s=10, clock=lambda: now[0])
    router, snap = Router(LruRouteCache(10, 60), board), snapshot()
    key = snap.adapters[("acme", "legal")][0].adapter_key
    board.record(key, False)
    board.record(key, False)
    assert board.state(key) == "open" and board.failures(key) == 2
    now[0] = 11.0
    assert isinstance(await route_one(router, snap, job(adapter="legal")), Route)  # the probe
    assert isinstance(await route_one(router, snap, job(adapter="legal")), RouteError)
    board.no_verdict(key)
    assert board.state(key) == "half_open"
    assert isinstance(await route_one(router, snap, job(adapter="legal")), Route)  # another probe
    board.no_verdict("never-seen")  # nothing to free
    now[0] = 100.0
    assert board.failures(key) == 0  # out of the window


@pytest.mark.parametrize(
    ("kind", "pattern", "text", "hit"),
    [
        ("keyword", "refund", "I want a REFUND now", True),
        ("keyword", "refund", "refunds", False),
        ("prefix", "/sql", "  /SQL select 1", True),
        ("prefix", "/sql", "run /sql", False),
        ("regex", r"\border #\d{4}\b", "where is order #1234?", True),
        ("regex", r"^x$", "", False),
    ],
)
def test_rule_kinds(kind, pattern, text, hit):
    rule = RouteRule(1, "t", kind, pattern, "a")
    assert (RuleClassifier([rule]).classify("t", text) is not None) == hit
    assert RuleClassifier([rule]).classify("other-tenant", text) is None


@pytest.mark.parametrize(("kind", "pattern"), [("regex", "(unclosed"), ("keyword", ""), ("fuzzy", "x")])
def test_bad_rules_are_refused(kind, pattern):
    with pytest.raises(RuleError):
        compile_rule(RouteRule(1, "t", kind, pattern, "a"))


def test_reason_labels():
    assert Route(None, "base_fallback", 0, "x@1 circuit open").label == "base_fallback (x@1 circuit open)"
    assert Route(None, "explicit", 0).label == "explicit"


def test_event_loop_not_needed_for_snapshot():
    assert asyncio.iscoroutinefunction(Router.route_batch)


def _snapshot_with(adapters_extra: dict) -> RegistrySnapshot:
    snap = snapshot()
    return RegistrySnapshot(snap.tenants, {**snap.adapters, **adapters_extra}, snap.defaults, snap.rules)


@pytest.mark.parametrize("value", ["support@x", "support@" + "9" * 5000, "@", "", "support@1@2", "support@1.0", " support"])
async def test_cached_values_that_are_no_reference_fall_through(value):
    """What another client left under a cache key is never trusted: a value that is not `name` or `name@version` is a
    miss (it raised out of the router, failing the batch and then the worker)."""
    cache = LruRouteCache(100, 60)
    await cache.set_many({CacheKey("l1", "acme", "u1"): value, CacheKey("l2", "acme", "s1"): value})
    r = await route_one(Router(cache), snapshot(), job(user_id="u1", session_id="s1"))
    assert isinstance(r, Route) and (r.reason, r.view.adapter) == ("tenant_default", "support@2")


async def test_a_stored_rule_with_no_reference_is_skipped():
    """A rule stored before `routes add` checked its adapter reference falls through to the next decision."""
    snap = snapshot()
    snap = RegistrySnapshot(snap.tenants, snap.adapters, snap.defaults, (RouteRule(9, "acme", "keyword", "refund", "legal@x", 0),))
    r = await route_one(Router(LruRouteCache(10, 60)), snap, job(prompt="a refund please"))
    assert (r.reason, r.view.adapter) == ("tenant_default", "support@2")


async def test_a_bug_while_deciding_fails_that_job_alone(monkeypatch):
    """An unexpected error deciding one job fails it (routing_failed, retriable) and routes the batch's others."""
    real = Router._decide

    def flaky(self, snapshot, classifier, j, *rest):
        if j.request_id == "bad":
            raise ValueError("boom")
        return real(self, snapshot, classifier, j, *rest)

    monkeypatch.setattr(Router, "_decide", flaky)
    snap = snapshot()
    out = await Router(LruRouteCache(10, 60)).route_batch(snap, RuleClassifier(snap.rules), [job(request_id="bad"), job(request_id="ok")])
    assert isinstance(out[0], RouteError) and (out[0].info.code, out[0].info.retriable) == ("routing_failed", True)
    assert isinstance(out[1], Route) and out[1].reason == "tenant_default"


async def test_another_tenants_private_versions_are_never_served():
    """Only a public version of another tenant's adapter serves: a private v1 beside a public v2 (even with most of the
    traffic weight) is refused by version and never picked for the unversioned name."""
    snap = _snapshot_with({("globex", "legalx"): (_a("globex", "legalx", 1, weight=90), _a("globex", "legalx", 2, public=True, weight=10))})
    router = Router(LruRouteCache(10, 60))
    refused = await route_one(router, snap, job(adapter="legalx@1"))
    assert isinstance(refused, RouteError) and refused.info.code == "unknown_adapter" and "versions: 2" in refused.info.message
    for i in range(20):
        r = await route_one(router, snap, job(request_id=f"r{i}", adapter="legalx"))
        assert r.view.adapter == "legalx@2"
    own = await route_one(router, snap, job(tenant_id="globex", adapter="legalx@1"))
    assert own.view.adapter == "legalx@1"  # the owner uses every version


async def test_a_name_public_under_two_tenants_is_refused_as_ambiguous():
    snap = _snapshot_with({("hooli", "shared"): (_a("hooli", "shared", public=True),)})
    r = await route_one(Router(LruRouteCache(10, 60)), snap, job(adapter="shared"))
    assert isinstance(r, RouteError) and r.info.code == "adapter_forbidden" and "public under several tenants (globex, hooli)" in r.info.message


async def test_a_version_taken_out_of_traffic_is_stale_in_the_caches():
    """A rollback (`adapters traffic`: the version's weight to 0) reaches users and sessions already routed to it: their
    cached version is passed over while another version is live; a job naming it explicitly still gets it."""
    cache = LruRouteCache(100, 60)
    await cache.set_many({CacheKey("l2", "acme", "s1"): "support@1"})  # support@1 has weight 0, support@2 100
    router = Router(cache)
    r = await route_one(router, snapshot(), job(session_id="s1"))
    assert (r.reason, r.view.adapter) == ("tenant_default", "support@2")
    assert (await cache.get_many([CacheKey("l2", "acme", "s1")])) == {CacheKey("l2", "acme", "s1"): "support@2"}
    r = await route_one(router, snapshot(), job(adapter="support@1"))
    assert (r.reason, r.view.adapter) == ("explicit", "support@1")


def test_a_backtracking_regex_rule_is_cut_off_and_skipped(caplog):
    """`(a|aa)+$` over a run of a's backtracks exponentially: its match stops at MATCH_TIMEOUT_S, the rule matches
    nothing and is skipped from then on (a warning names it and the command that removes it); the tenant's other rules
    still match."""
    rules = (RouteRule(7, "acme", "regex", "(a|aa)+$", "legal", 0), RouteRule(8, "acme", "keyword", "help", "billing", 1))
    classifier = RuleClassifier(rules)
    text = "a" * 60 + "! help"
    assert classifier.classify("acme", text).id == 8
    assert classifier.slow == {7}
    assert classifier.classify("acme", text).id == 8  # skipped now, not tried again
    said = [r.getMessage() for r in caplog.records if "routing rule 7" in r.getMessage()]
    assert len(said) == 1 and "lorabatch routes remove 7" in said[0]


def test_a_stored_rule_that_does_not_compile_is_skipped(caplog):
    """A classifier over stored rules skips one that does not compile (it stopped the worker from starting)."""
    classifier = RuleClassifier((RouteRule(5, "acme", "regex", "([", "legal", 0), RouteRule(6, "acme", "keyword", "help", "billing", 1)))
    assert classifier.classify("acme", "help me").id == 6
    assert any("routing rule 5" in r.getMessage() for r in caplog.records)


async def test_routing_a_job_reads_the_names_adapters_not_the_whole_registry():
    """Finding another tenant's public adapter (or saying a name is another tenant's) scanned every adapter of every
    tenant, three times for a cache hit: 6 ms a job over 100,000 registered adapters, on the worker's event loop and
    billed as the job's routing_us. The snapshot's adapters are now read once, into an index by name."""
    class Counting(dict):
        scans = 0

        def items(self):
            Counting.scans += 1
            return super().items()

        def __iter__(self):
            Counting.scans += 1
            return super().__iter__()

    snap = snapshot()
    snap = RegistrySnapshot(snap.tenants, Counting(snap.adapters), snap.defaults, snap.rules)
    jobs = [job(request_id=f"r{i}", tenant_id=t, adapter=ref, session_id=f"s{i % 3}") for i, (t, ref) in
            enumerate([("acme", "shared"), ("hooli", "shared@1"), ("acme", "secret"), ("hooli", "chat"), ("hooli", "nothing")] * 20)]
    routes = await Router(LruRouteCache(100, 60)).route_batch(snap, RuleClassifier(snap.rules), jobs)
    assert [r.view.adapter_key if isinstance(r, Route) else r.info.code for r in routes[:5]] == [
        "globex/shared@1", "globex/shared@1", "adapter_forbidden", "adapter_forbidden", "unknown_adapter"]
    assert Counting.scans <= 1, Counting.scans
