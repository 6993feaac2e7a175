"""An outside audit's scenarios (a hostile producer, an operator on a bad day) that found something still broken."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from consumer.schemas import parse_job


def _raw(request_id: str, tenant_id: str, tail: str) -> bytes:
    return ('{"request_id": %s, "tenant_id": %s, %s}' % (json.dumps(request_id), json.dumps(tenant_id), tail)).encode()


@pytest.mark.parametrize("request_id, tenant_id", [
    ("r" * 129, "acme"),  # past the 128 characters of a request id
    ("r" * 256, "acme"),
    ("ok", "-acme"),  # a tenant id starts with a letter or digit
    ("ok", "ac:me"),  # ':' is a request id's character, not a tenant id's
    ("ok", "t" * 65),
])
@pytest.mark.parametrize("tail", [
    '"prompt": "a", "prompt": "b"',  # a field given twice
    '"messages": [{"role": "user", "content": "a", "content": "b"}]',  # inside a chat message
])
def test_a_job_with_an_unusable_identity_is_dead_lettered_whatever_else_is_wrong(request_id, tenant_id, tail):
    """A request id or tenant id outside its contract is no usable identity: the message goes to the DLQ. Only the
    validation error's path checked that; a job that also gave a field twice was answered (and billed a row) under a
    200-character request id, or under a tenant id no tenant can have."""
    rej = parse_job(_raw(request_id, tenant_id, tail))
    assert not rej.addressable, rej


def test_a_job_with_a_usable_identity_and_a_field_given_twice_is_answered():
    rej = parse_job(_raw("r" * 128, "acme", '"prompt": "a", "prompt": "b"'))
    assert rej.addressable and rej.error.field == "prompt", rej
    assert (rej.request_id, rej.tenant_id) == ("r" * 128, "acme")


@pytest.mark.parametrize("version", ["2", "true", "1.0", '"1"', "null"])
@pytest.mark.parametrize("tail", [
    '"prompt": "a", "prompt": "b"',
    '"messages": [{"role": "user", "content": "a", "content": "b"}]',
])
def test_a_job_of_another_contract_version_is_dead_lettered_whatever_else_is_wrong(version, tail):
    """A `v` other than the JSON integer 1 goes to the DLQ (README), as a validation error on it does: a job that also
    gave a field twice was answered with a failed result (and a ledger row) under a contract it does not speak."""
    rej = parse_job(_raw("ok", "acme", f'"v": {version}, {tail}'))
    assert not rej.addressable, rej
    assert parse_job(_raw("ok", "acme", f'"v": 1, {tail}')).addressable


@pytest.mark.parametrize("request_id, tenant_id, version", [
    ("r" * 129, "acme", 1), ("ok", "-acme", 1), ("ok", "ac:me", 1), ("ok", "acme", 2), ("ok", "acme", "true")])
def test_an_unusable_identity_is_dead_lettered_when_adapter_and_adapter_ref_differ(request_id, tenant_id, version):
    """adapter_ref against adapter is checked before the fields (a model validator), and its error is then the only one
    pydantic reports: the identity's and the version's went unchecked, and the job was answered under them."""
    tail = '"v": %s, "prompt": "a", "adapter_ref": "a", "adapter": "b"' % version
    rej = parse_job(_raw(request_id, tenant_id, tail))
    assert rej.error.field == "adapter_ref" and not rej.addressable, rej
    assert parse_job(_raw("r" * 128, "acme", tail.replace(f'"v": {version}', '"v": 1'))).addressable


# ---------------------------------------------------------------- a memory-only broker restarted under a worker


def _jobs(tag: str, n: int) -> list[dict]:
    return [{"request_id": f"{tag}-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"{tag} job {i}", "max_new_tokens": 2}
            for i in range(n)]


@pytest.mark.slow
async def test_a_jobs_topic_made_again_with_more_partitions_by_a_producer_is_read_whole(tmp_path, demo_set, caplog):
    """The broker (memory-only) is killed and started again on its port; nobody recreates the topics: the first producer
    makes the jobs topic again with the broker's default partitions (more than the worker had). Every job on the new log
    is answered and billed once, the worker alive: none is lost, on the partitions the worker had known (the old log's
    offsets are no place in the new one) or not. Before, the jobs on the partitions the worker had not known of waited
    for the Kafka client's metadata refresh (5 minutes), unread and unsaid; and one run in four lost one on an old
    partition: a commit of the old log's marks went out unfenced (generation -1) after the new broker refused the old
    member, and the rejoined group read past the new log's first jobs (tests/test_commit_generation.py holds that race).
    A job fetched from the new log at the old position before the worker found the group gone is read again after the
    rejoin: its result is published again with the same body (README: read results by request), never billed twice.
    The line about the partitions the restarted broker took back names the restart as a cause, not only a frozen
    worker."""
    caplog.set_level(logging.WARNING, logger="lorabatch.worker")
    from billing import db
    from consumer.broker import EmbeddedBroker, free_port
    from migrations import SCRIPT_LOCATION
    from tests.adversarial.accounting import account, wait_rows
    from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
    from tests.service_fixtures import open_services

    port = free_port()
    first = EmbeddedBroker(port, log_path=tmp_path / "tansu-1.log")
    await asyncio.to_thread(first.start, [], 1)
    second = EmbeddedBroker(port, log_path=tmp_path / "tansu-2.log")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await adversarial_settings(first, tmp_path, url, demo_set["model"], **{"kafka.metadata_max_age_ms": 1000})
    svc = open_services(s)
    register_two_tenants(svc, demo_set)
    try:
        async with live_worker(s, svc) as lw:
            async with Collector(s) as col:
                sent1 = await produce(s, [job_message(j) for j in _jobs("before", 4)])
                assert await col.until(lambda c: c.answered(sent1), 20)
            first.process.kill()
            first.process.wait(10)
            await asyncio.to_thread(second.start, [], 1)
            sent2 = await produce(s, [job_message(j) for j in _jobs("after", 8)])
            assert {m.partition for m in sent2} - set(range(s.kafka.partitions)), "the new topic has more partitions"
            async with Collector(s) as col2:
                await col2.until(lambda c: c.answered(sent2) or not lw.alive(), 20)
                await col2.settle(0.5)
            acct = account(sent2, col2)
            assert lw.alive(), lw.death()
            assert not acct.lost and not col2.dlq, (acct.lost, col2.dlq)
            assert all(r.status == "succeeded" for rs in acct.results.values() for r in rs)
            assert all(len({r.text for r in rs}) == 1 for rs in acct.results.values()), "a result again has its body"
            rows = await wait_rows(svc.db, [m.identity for m in sent1 + sent2], 10)
            assert all(len(v) == 1 for v in rows.values()), {k: len(v) for k, v in rows.items()}
            lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost partitions")]
            assert all("broker restarted" in line for line in lost), lost
    finally:
        svc.close()
        second.stop()
        first.stop()


# ---------------------------------------------------------------- the ledger's role loses its grants


@pytest.mark.postgres
async def test_a_ledger_role_without_its_grants_spools_says_which_grant_and_bills_once_when_given_back(tmp_path, caplog):
    """The ledger's role loses INSERT on its tables (a permissions change, a role rotated to one without grants): writes
    and the ping fail with a retriable LedgerUnavailableError naming the missing privilege and the GRANT to run, the
    worker spools without a traceback, and once the grant is back each record lands once. It was psycopg's
    InsufficientPrivilege unmapped: 'ledger write ... failed unexpectedly' with a traceback, and 'the ledger is
    unavailable' with nothing on what to do."""
    import secrets

    from sqlalchemy import create_engine

    from billing import db
    from billing.config import LedgerConfig
    from billing.errors import LedgerUnavailableError
    from billing.ledger import Ledger
    from migrations import SCRIPT_LOCATION
    from tests.db_fixtures import PG_ADMIN_URL
    from tests.test_ledger_bad_day import _admin, _deliverer, _outcome, _usage

    name, role = f"lorabatch_fixc_{secrets.token_hex(4)}", f"fixc_{secrets.token_hex(4)}"
    _admin(f'CREATE DATABASE "{name}"', f'CREATE ROLE "{role}" LOGIN')
    owner_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    url = f"postgresql+psycopg://{role}@127.0.0.1:5432/{name}"
    engine = None
    try:
        db.upgrade(owner_url, script_location=SCRIPT_LOCATION)
        grant = (f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"', f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
        _admin(*grant, url=owner_url)
        engine = db.make_engine(url)
        ledger = Ledger(engine, LedgerConfig(url=url))
        assert ledger.record_usage([_usage(0)]) == 1
        _admin(f'REVOKE INSERT ON ALL TABLES IN SCHEMA public FROM "{role}"', url=owner_url)
        for call in (lambda: ledger.record_usage([_usage(1)]), ledger.ping):
            with pytest.raises(LedgerUnavailableError, match=f"permission denied.*GRANT .* TO {role}") as e:
                call()
            assert e.value.retriable

        d, offsets, spool = _deliverer(ledger, tmp_path, 3)
        caplog.set_level(logging.WARNING, logger="lorabatch.worker")
        await d.deliver([_outcome(1), _outcome(2)])
        assert len(spool) == 2
        assert not [r for r in caplog.records if r.exc_info], "no traceback for a missing grant"
        assert any("GRANT" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        _admin(*grant, url=owner_url)
        await d.flush_once()
        assert len(spool) == 0 and ledger.count_usage() == 3
        await d.flush_once()
        assert ledger.count_usage() == 3
    finally:
        if engine is not None:
            engine.dispose()
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'DROP ROLE IF EXISTS "{role}"')
        assert PG_ADMIN_URL
