"""Registrations racing for one name: every one ends as a version (each content once, versions 1..N without a gap)
or as a RegistryError saying to try again, never a raw database error."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest

from billing.db import make_engine, session_factory
from consumer.registry import Registration, Registry, RegistryError
from engine.store import AdapterStore


@pytest.fixture
def registries(ledger_url, tmp_path):
    engines = [make_engine(ledger_url) for _ in range(8)]
    store = AdapterStore(tmp_path / "store", max_bytes=10**8)
    yield [Registry(session_factory(e), store) for e in engines]
    for e in engines:
        e.dispose()


def _reg(sha: str) -> Registration:
    return Registration("acme", "support", sha, 8, Decimal(16), ("q_proj",), 1000)


@pytest.mark.parametrize("same", [False, True], ids=["different contents", "same content"])
def test_concurrent_registrations_of_one_name(registries, same):
    """8 threads, each on its own connection, register content under acme/support at once."""
    registries[0].add_tenant("acme")
    shas = [("a" if same else f"{i:x}") * 64 for i in range(len(registries))]
    shas = [s[:64] for s in shas]
    barrier = threading.Barrier(len(registries))
    out: list[object] = [None] * len(registries)

    def go(i: int) -> None:
        barrier.wait()
        try:
            out[i] = registries[i].register([_reg(shas[i])])[0]
        except Exception as e:  # noqa: BLE001 - the test names what came out
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(registries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raw = [o for o in out if isinstance(o, Exception) and not isinstance(o, RegistryError)]
    assert not raw, [f"{type(e).__name__}: {str(e)[:200]}" for e in raw]
    views = registries[0].list_adapters("acme")
    assert [v.version for v in views] == list(range(1, len(views) + 1))
    assert len({v.sha256 for v in views}) == len(views), "one content registered twice under one name"
    done = {o[0].sha256 for o in out if isinstance(o, tuple)}
    assert done <= {v.sha256 for v in views}
    if same:
        assert len(views) == 1
    assert sum(v.traffic_weight > 0 for v in views) == 1, [(v.version, v.traffic_weight) for v in views]
