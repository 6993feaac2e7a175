"""The registry in SQL (both backends): content-addressed adapters, versions, defaults, canary traffic,
rate limits and routing rules, and the snapshot workers route on."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest

from billing.db import make_engine, session_factory
from consumer.registry import Registry, RegistryError
from consumer.routing import pick_version
from consumer.rules import RuleError
from engine.store import AdapterStore


@pytest.fixture
def registry(ledger_url, tmp_path) -> Registry:
    engine = make_engine(ledger_url)
    yield Registry(session_factory(engine), AdapterStore(tmp_path / "store", max_bytes=10**8))
    engine.dispose()


def test_versions_dedupe_and_default(registry, demo_set):
    """Same content under a name is one version; new content is the next version and takes the traffic."""
    a = demo_set["adapters"]
    names = sorted(a)
    registry.add_tenant("acme")
    v1, created = registry.add_adapter("acme", "support", a[names[0]], default=True)
    assert created and v1.adapter == "support@1" and v1.is_default and v1.traffic_weight == 100
    again, created = registry.add_adapter("acme", "support", a[names[0]])
    assert not created and again.version == 1
    v2, created = registry.add_adapter("acme", "support", a[names[1]])
    assert created and v2.version == 2 and v2.is_default, "a new version of the default stays the default"
    snap = registry.snapshot()
    versions = snap.versions("acme", "support")
    assert [(v.version, v.traffic_weight) for v in versions] == [(1, 0), (2, 100)]
    assert snap.defaults["acme"].name == "support"
    assert registry.store.path(v1.sha256).is_dir() and v1.sha256 != v2.sha256


def test_canary_then_promote(registry, demo_set):
    """A 10% canary takes 10 +/- 3% of 1,000 request ids; promoting moves all traffic."""
    a = demo_set["adapters"]
    names = sorted(a)
    registry.add_tenant("acme")
    registry.add_adapter("acme", "support", a[names[0]])
    canary, _ = registry.add_adapter("acme", "support", a[names[1]], canary=10)
    versions = registry.snapshot().versions("acme", "support")
    assert [(v.version, v.traffic_weight) for v in versions] == [(1, 90), (2, 10)]
    share = Counter(pick_version(versions, f"job-{i}").version for i in range(1000))[2]
    assert 70 <= share <= 130, share
    registry.set_traffic("acme", "support", {2: 100})
    versions = registry.snapshot().versions("acme", "support")
    assert all(pick_version(versions, f"job-{i}").version == 2 for i in range(100))
    with pytest.raises(RegistryError, match="no version"):
        registry.set_traffic("acme", "support", {7: 1})
    with pytest.raises(RegistryError, match="1 to 99"):
        registry.add_adapter("acme", "support", a[names[2]], canary=0)


def test_public_and_acl(registry, demo_set):
    a = demo_set["adapters"]
    names = sorted(a)
    registry.add_tenant("acme")
    registry.add_tenant("globex")
    registry.add_adapter("globex", "shared", a[names[0]], public=True)
    registry.add_adapter("globex", "secret", a[names[1]])
    snap = registry.snapshot()
    assert snap.versions("acme", "shared")[0].tenant_id == "globex"
    assert snap.versions("acme", "secret") == () and snap.owned_elsewhere("acme", "secret")


def test_limits_and_rules(registry, demo_set):
    a = demo_set["adapters"]
    registry.add_tenant("acme", requests_per_minute=60)
    registry.add_adapter("acme", "billing", a[sorted(a)[0]])
    registry.add_adapter("acme", "sql", a[sorted(a)[1]])
    t = registry.set_limits("acme", tokens_per_minute=5000, weight=3)
    assert (t.requests_per_minute, t.tokens_per_minute, t.weight) == (60, 5000, 3)
    r1 = registry.add_rule("acme", "keyword", "refund", "billing", position=1)
    r0 = registry.add_rule("acme", "regex", r"^/sql", "sql", position=0)
    assert [r.id for r in registry.list_rules("acme")] == [r0.id, r1.id]
    assert {r.id for r in registry.snapshot().rules} == {r0.id, r1.id}
    registry.remove_rule(r0.id)
    assert [r.id for r in registry.list_rules()] == [r1.id]
    with pytest.raises(RuleError, match="does not compile"):
        registry.add_rule("acme", "regex", "(", "x")
    with pytest.raises(RegistryError, match="no route rule"):
        registry.remove_rule(999)
    for beyond in (-1, 0, 2**31, 2**63, 10**20):  # no rule has such an id; SQLite raised OverflowError past 2^63
        with pytest.raises(RegistryError, match="no route rule"):
            registry.remove_rule(beyond)
    with pytest.raises(RegistryError, match="out of range"):
        registry.set_limits("acme", weight=0)


@pytest.mark.parametrize(
    ("adapter", "position", "says"),
    [
        ("globex-private-nonexistent", 0, ["ADAPTER 'globex-private-nonexistent' does not exist", "adapters add --tenant acme"]),
        ("secret", 0, ["'secret' belongs to another tenant and is not public", "lorabatch adapters list"]),
        ("secret@1", 0, ["'secret' belongs to another tenant and is not public"]),
        ("support@3", 0, ["support@3: 'support' has no version 3 (its versions: 1, 2)"]),
        ("shared@2", 0, ["'shared' has no version 2 (its versions: 1)"]),
        ("sup@x", 0, ["ADAPTER 'sup@x' is not an adapter name", "NAME@VERSION"]),
        ("support@0", 0, ["NAME@VERSION"]),
        ("support@01", 0, ["NAME@VERSION"]),
        ("support@1234567890", 0, ["at most 9 digits"]),
        ("support@", 0, ["NAME@VERSION"]),
        ("bad name!", 0, ["NAME@VERSION"]),
        ("support", -999999999999999999999, ["position -999999999999999999999 is out of range", "--position", "-2147483648"]),
        ("support", 2**31, ["out of range", "2147483647"]),
    ],
)  # fmt: skip
def test_a_rule_a_job_would_trip_on_is_refused_when_added(registry, demo_set, adapter, position, says):
    """routes add refuses an ADAPTER that is not name or name@N, one the tenant cannot use (not its own, not public, or a
    version that does not exist) and a position outside the INTEGER column, each naming the argument and the fix;
    nothing is added."""
    a = demo_set["adapters"]
    names = sorted(a)
    for t in ("acme", "globex"):
        registry.add_tenant(t)
    registry.add_adapter("acme", "support", a[names[0]])
    registry.add_adapter("acme", "support", a[names[1]])
    registry.add_adapter("globex", "secret", a[names[2]])
    registry.add_adapter("globex", "shared", a[names[3]], public=True)
    with pytest.raises(RegistryError) as e:
        registry.add_rule("acme", "keyword", "refund", adapter, position)
    for needle in says:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"
    assert registry.list_rules() == []


def test_a_rule_may_name_any_adapter_the_tenant_can_use(registry, demo_set):
    """Its own adapter by name or existing version, another tenant's public one, at both ends of the position range."""
    a = demo_set["adapters"]
    names = sorted(a)
    for t in ("acme", "globex"):
        registry.add_tenant(t)
    registry.add_adapter("acme", "support", a[names[0]])
    registry.add_adapter("acme", "support", a[names[1]])
    registry.add_adapter("globex", "shared", a[names[2]], public=True)
    registry.add_adapter("globex", "support", a[names[3]])  # globex's own, private: acme's rules mean acme's
    for adapter, position in (("support", 0), ("support@2", -(2**31)), ("shared", 2**31 - 1), ("shared@1", 5)):
        registry.add_rule("acme", "keyword", "refund", adapter, position)
    assert [(r.adapter, r.position) for r in registry.list_rules("acme")] == [
        ("support@2", -(2**31)), ("support", 0), ("shared@1", 5), ("shared", 2**31 - 1)]  # fmt: skip


def test_a_rule_may_not_name_another_tenants_private_version(registry, demo_set):
    """Of another tenant's adapter, only its public versions are usable (routing serves no other): a rule naming its
    private v1 beside a public v2 is refused, naming the versions there are; v2 and the bare name are fine."""
    a = demo_set["adapters"]
    names = sorted(a)
    for t in ("acme", "globex"):
        registry.add_tenant(t)
    registry.add_adapter("globex", "legal", a[names[0]])
    registry.add_adapter("globex", "legal", a[names[1]], public=True)
    with pytest.raises(RegistryError, match=r"has no version 1 \(its versions: 2\)"):
        registry.add_rule("acme", "keyword", "refund", "legal@1")
    registry.add_rule("acme", "keyword", "refund", "legal@2")
    registry.add_rule("acme", "keyword", "claim", "legal")


def test_a_name_is_public_for_one_tenant_only(registry, demo_set):
    """Once acme's `legal` is public, another tenant cannot make a `legal` public (adding it, or adding the same content
    again with public=True): refused naming the owner and the fix, before anything is stored; a third tenant keeps
    reaching acme's. A private `legal` of its own is fine, and acme may re-register its own as public."""
    a = demo_set["adapters"]
    names = sorted(a)
    for t in ("acme", "globex", "initech"):
        registry.add_tenant(t)
    registry.add_adapter("acme", "legal", a[names[0]], public=True)
    stored = sorted(p.name for p in registry.store.root.iterdir())
    with pytest.raises(RegistryError) as e:
        registry.add_adapter("globex", "legal", a[names[1]], public=True)
    assert "already public as tenant acme's adapter" in str(e.value) and "choose another name" in str(e.value)
    assert "keep globex's 'legal' private" in str(e.value)
    assert sorted(p.name for p in registry.store.root.iterdir()) == stored, "nothing stored"
    registry.add_adapter("globex", "legal", a[names[1]])
    with pytest.raises(RegistryError, match="already public as tenant acme's adapter"):
        registry.add_adapter("globex", "legal", a[names[1]], public=True)  # same content: only the flag would change
    unchanged, created = registry.add_adapter("acme", "legal", a[names[0]], public=True)
    assert not created and unchanged.is_public
    snap = registry.snapshot()
    assert snap.versions("initech", "legal")[-1].tenant_id == "acme"
    assert snap.versions("globex", "legal")[-1].tenant_id == "globex" and not snap.versions("globex", "legal")[-1].is_public


def test_making_a_name_private_makes_every_version_private(registry, demo_set):
    """Adding the latest version's content again without public=True, where it was public, makes the name private: no
    version of it stays public, so another tenant naming it is refused rather than served an older public version (one
    rolled back, too). Running that call again changes nothing; a version registered private beside a public one
    (new content, no public=True) leaves the older one public as before."""
    a = demo_set["adapters"]
    names = sorted(a)
    registry.add_tenant("acme")
    registry.add_tenant("globex")
    registry.add_adapter("globex", "legal", a[names[0]], public=True)
    registry.add_adapter("globex", "legal", a[names[1]], public=True)
    assert [v.version for v in registry.snapshot().versions("acme", "legal")] == [1, 2]
    registry.add_adapter("globex", "legal", a[names[1]])
    snap = registry.snapshot()
    assert snap.versions("acme", "legal") == () and snap.owned_elsewhere("acme", "legal")
    assert [v.is_public for v in registry.list_adapters("globex")] == [False, False]
    registry.add_adapter("globex", "legal", a[names[1]])
    assert [v.is_public for v in registry.list_adapters("globex")] == [False, False]
    registry.add_adapter("globex", "legal", a[names[1]], public=True)
    registry.add_adapter("globex", "legal", a[names[2]])
    assert [(v.version, v.is_public) for v in registry.snapshot().versions("acme", "legal")] == [(2, True)]


def test_register_refuses_two_public_owners_of_a_name_in_one_transaction(registry, demo_set):
    """Registry.register checks the rule inside its transaction too (its callers check before storing): two tenants
    making one new name public in one call roll the whole transaction back; a private one beside a public one is fine."""
    from consumer.registry import Registration

    registry.add_tenant("acme")
    registry.add_tenant("globex")
    regs = [Registration(t, "legal", f"{i:064x}", 4, Decimal(8), ("q_proj",), 10, public=True) for i, t in enumerate(("acme", "globex"))]
    with pytest.raises(RegistryError, match="globex/legal: adapter name 'legal' is already public as tenant acme's adapter"):
        registry.register(regs)
    assert registry.list_adapters() == []
    done = registry.register([regs[0], Registration("globex", "legal", "f" * 64, 4, Decimal(8), ("q_proj",), 10)])
    assert [(v.tenant_id, v.is_public) for v, _ in done] == [("acme", True), ("globex", False)]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda r, p: r.add_tenant("bad id!"), "invalid"),
        (lambda r, p: r.add_adapter("ghost", "x", p), "tenants add ghost"),
        (lambda r, p: r.add_adapter("acme", "bad name!", p), "invalid"),
    ],
)
def test_bad_registrations_say_how_to_fix(registry, demo_set, call, says):
    registry.add_tenant("acme")
    path = Path(next(iter(demo_set["adapters"].values())))
    with pytest.raises(RegistryError) as e:
        call(registry, path)
    assert says in str(e.value)


def test_core_tenant_listing_is_the_registrys(registry, ledger_url):
    """consumer.tenants.list_tenants (Core, what `tenants list` runs) returns what Registry.list_tenants does,
    field for field and in the same order: none, then tenants added out of order with odd names and limits."""
    from billing.models import Tenant
    from consumer.tenants import TENANTS, list_tenants

    assert {c.name for c in TENANTS.columns} <= {c.name for c in Tenant.__table__.columns}
    db = make_engine(ledger_url)
    try:
        assert list_tenants(db) == registry.list_tenants() == []
        registry.add_tenant("zeta", "Zeta GmbH", "premium", 7, 10**6, 2**40)
        registry.add_tenant("Acme", "Ünïcode ☃ name", weight=3)
        registry.add_tenant("acme")
        registry.add_tenant("a" * 64, "x" * 200)
        registry.set_limits("acme", 5, 9, 2)
        assert list_tenants(db) == registry.list_tenants()
        assert len(list_tenants(db)) == 4
        assert list_tenants(db)[-1].tokens_per_minute == 2**40
    finally:
        db.dispose()


def test_add_adapter_checks_the_folder_as_the_cli_does(registry, demo_set, tmp_path):
    """add_adapter makes the command's checks: against the serving base when given (an adapter made for another base is
    refused, naming it, and nothing is stored or registered), and PEFT's lora_alpha default (8) when the config has
    none, as the engine scales it."""
    import json
    import shutil

    from engine.adapter_import import AdapterChecks
    from engine.api import AdapterError
    from engine.demo_model import write_demo_set

    registry.add_tenant("acme")
    checks = AdapterChecks.for_model_dir(demo_set["model"], max_lora_rank=64)
    other = write_demo_set(tmp_path / "other", arch="qwen2")  # another base: another fingerprint
    name = sorted(other)[0]
    with pytest.raises(AdapterError, match="trained for base fingerprint"):
        registry.add_adapter("acme", "foreign", other[name], checks=checks)
    assert registry.snapshot().versions("acme", "foreign") == () and not any(registry.store.root.iterdir())
    no_alpha = tmp_path / "no-alpha"
    shutil.copytree(demo_set["adapters"][name], no_alpha)
    cfg = json.loads((no_alpha / "adapter_config.json").read_text())
    cfg.pop("lora_alpha", None)
    (no_alpha / "adapter_config.json").write_text(json.dumps(cfg))
    view, created = registry.add_adapter("acme", "plain", no_alpha, checks=checks)
    assert created and view.alpha == 8 and view.rank == cfg["r"]
    for alpha in (1e6, 999999.99995, 0.00004, 0, -16):  # the registry's NUMERIC(10, 4) cannot hold them as they are
        (no_alpha / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
        with pytest.raises(AdapterError, match=f"lora_alpha={float(alpha)!r} is out of range; set lora_alpha from 0.0001 to 999999.9999"):
            registry.add_adapter("acme", "huge", no_alpha, checks=checks)
    assert registry.snapshot().versions("acme", "huge") == () and list(registry.store.root.iterdir()) == [registry.store.path(view.sha256)]
    for alpha in (999999.9999, 0.0001):
        (no_alpha / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
        edge, _ = registry.add_adapter("acme", f"edge-{alpha}", no_alpha, checks=checks)
        assert edge.alpha == Decimal(str(alpha))
    broken = tmp_path / "broken"
    shutil.copytree(no_alpha, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        registry.add_adapter("acme", "broken", broken)


def test_prune_removes_only_unnamed_content_past_its_grace(registry, demo_set):
    """Content stored by a registration that then failed, and an unfinished write, go once past the grace; registered
    content (any tenant, any version) stays; content put again renews its time, so a prune racing a registration of
    content already stored leaves it."""
    import os
    import time

    a = demo_set["adapters"]
    first, second, third = sorted(a)[:3]
    registry.add_tenant("acme")
    kept, _ = registry.add_adapter("acme", "support", a[first])
    orphan = registry.store.put(a[second])  # stored, never registered: a failed registration's leftover
    (registry.store.root / ".tmp-crashed").mkdir()
    (registry.store.root / ".tmp-crashed" / "adapter_model.safetensors").write_bytes(b"half")
    (registry.store.root / "notes").mkdir()  # not the store's: never touched
    later = time.time() + 7200
    assert registry.prune_store(3600) == [], "nothing is past the grace yet"
    planned = registry.prune_store(3600, dry_run=True, now=later)
    assert sorted(e.name for e in planned) == sorted([orphan, ".tmp-crashed"])
    assert orphan in registry.store, "a dry run removes nothing"
    past = later - 2 * 3600 - 60
    os.utime(registry.store.root / orphan, (past, past))
    again = registry.store.put(a[second])  # put again (a registration of it under way): its time is renewed
    assert again == orphan and registry.prune_store(3600, now=time.time() + 60) == []
    gone = registry.prune_store(3600, now=later)
    assert sorted(e.name for e in gone) == sorted([orphan, ".tmp-crashed"])
    assert orphan not in registry.store and kept.sha256 in registry.store
    assert (registry.store.root / "notes").is_dir() and not (registry.store.root / ".tmp-crashed").exists()
    registry.store.verify(kept.sha256)
    v, _ = registry.add_adapter("acme", "legal", a[third])
    assert registry.prune_store(0, now=later + 10**6) == [] and v.sha256 in registry.store


def test_adding_an_adapter_again_repairs_its_store_entry(registry, demo_set):
    """A store entry whose files changed on disk under its sha256 (workers fail it with adapter_changed), or whose weights
    file is gone (adapter_missing) or a link, even to the same bytes (adapter_unsafe), is repaired by adding the adapter's
    folder again (the registry unchanged: same content, same version), and by a put of it; an intact entry is left as it
    is."""
    from engine.api import AdapterError

    a = demo_set["adapters"]
    folder = a[sorted(a)[0]]
    registry.add_tenant("acme")
    v1, _ = registry.add_adapter("acme", "support", folder)
    weights = registry.store.path(v1.sha256) / "adapter_model.safetensors"
    for damage in (lambda b: b[:-1] + bytes([b[-1] ^ 0x55]), lambda b: b[: len(b) // 2]):
        weights.write_bytes(damage(weights.read_bytes()))
        with pytest.raises(AdapterError, match="not its name"):
            registry.store.verify(v1.sha256)
        again, created = registry.add_adapter("acme", "support", folder)
        assert not created and again.version == 1 and again.sha256 == v1.sha256
        registry.store.verify(v1.sha256)
    weights.unlink()  # gone: workers fail it with adapter_missing
    registry.add_adapter("acme", "support", folder)
    registry.store.verify(v1.sha256)
    weights.unlink()
    weights.symlink_to(folder / "adapter_model.safetensors")  # a link, to the same bytes: adapter_unsafe
    registry.add_adapter("acme", "support", folder)
    assert weights.is_file() and not weights.is_symlink()
    registry.store.verify(v1.sha256)
    (registry.store.path(v1.sha256) / "adapter_config.json").write_text("{}")
    assert registry.store.put(folder) == v1.sha256
    registry.store.verify(v1.sha256)
    files = [(folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")]
    assert registry.store.put_bytes(*files) == (v1.sha256, False), "an intact entry is not written again"


@pytest.mark.parametrize("ending", ["\n", "@1\n"])
def test_a_trailing_newline_is_no_part_of_a_rules_adapter(registry, demo_set, ending):
    """`$` in Python's re also matches before a final newline, so `routes add ... $'support\\n'` was stored as
    `support\\n`: a rule that routing (like the job contract) reads as no adapter reference and skipped at every job,
    however often it matched. Refused as the other malformed ADAPTERs are, and nothing is added."""
    registry.add_tenant("acme")
    registry.add_adapter("acme", "support", next(iter(demo_set["adapters"].values())))
    with pytest.raises(RegistryError, match="NAME@VERSION"):
        registry.add_rule("acme", "keyword", "refund", "support" + ending)
    assert registry.list_rules() == []


def test_a_trailing_newline_is_no_part_of_a_tenant_or_adapter_name(registry, demo_set):
    """`acme\\n` and `support\\n` were registered (the names' `$` matched before the newline), ids no job can name (the
    job contract refuses them) that list like `acme` and `support`; a manifest line's JSON carries one easily."""
    with pytest.raises(RegistryError, match="invalid"):
        registry.add_tenant("acme\n")
    registry.add_tenant("acme")
    with pytest.raises(RegistryError, match="invalid"):
        registry.add_adapter("acme", "support\n", next(iter(demo_set["adapters"].values())))
    assert [t.id for t in registry.list_tenants()] == ["acme"] and registry.list_adapters() == []
