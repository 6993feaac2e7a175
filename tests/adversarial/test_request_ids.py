"""Scenario 2, request ids: identity is (tenant_id, request_id) everywhere (DESIGN.md, "Reliability and
security"); a request that already has its ledger row is answered from what was stored, never run or
billed again. Through the real broker and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from billing import db
from billing.invoice import build_invoice
from consumer.schemas import BatchManifest, Job
from consumer.submit import collect_results, produce_jobs, read_manifest
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import (
    account,
    busy_and_attributed,
    close_scenario,
    fill_tally,
    ledger_problems,
    row_dict,
    usage_rows,
    wait_conserved,
    wait_rows,
)
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _body(r) -> tuple:
    """What two answers to one request must agree on."""
    return r.status, r.text, r.usage.model_dump(), r.finish_reason, r.adapter


async def _setup(broker, tmp_path, demo_set, url, **extra):
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **extra)
    svc = open_services(s)
    refs = register_two_tenants(svc, demo_set)
    return s, svc, refs


async def test_same_request_id_two_tenants_at_once(tally, broker, tmp_path, demo_set, pg_database):
    """Two tenants use the same request ids at the same moment (same partition, one fetch): each job runs
    as its own, answered once with its own prompt's usage and its own adapter, and billed once to its own
    tenant; busy == attributed."""
    with fresh_pg_schema(pg_database) as url:
        s, svc, refs = await _setup(broker, tmp_path, demo_set, url)
        shape = {"acme": (3, 2), "globex": (9, 5)}  # (prompt ids, new tokens): which tenant's job an answer is from
        messages = []
        for i in range(6):
            for tenant, (n_ids, n_new) in shape.items():
                job = {"request_id": f"same-{i}", "tenant_id": tenant, "input_ids": list(range(10, 10 + n_ids + i)),
                       "max_new_tokens": n_new}
                messages.append(job_message(job, f"{tenant}/same-{i}"))  # keyed by request id: one partition for both
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                sent = await produce(s, messages)
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 90)
                await col.settle(1.0)
                end = await close_scenario(tally, sent, col, svc.db, lw)
        finally:
            svc.close()
    acct, rows = end.acct, end.rows
    assert not end.problems(), end.problems()
    assert not col.dlq, [d.error for d, _ in col.dlq]
    wrong = []
    for (tenant, rid), results in acct.results.items():
        n_ids, n_new = shape[tenant]
        want_ids = n_ids + int(rid.split("-")[1])
        r = results[0]
        if r.status != "succeeded":
            wrong.append(f"{tenant}/{rid}: {r.status} {r.error}")
            continue
        if r.usage.input_tokens != want_ids or r.adapter != refs[tenant] or r.usage.output_tokens > n_new:
            wrong.append(f"{tenant}/{rid}: answered with another job's run: input_tokens={r.usage.input_tokens} (want {want_ids}), "
                         f"output_tokens={r.usage.output_tokens} (at most {n_new}), adapter={r.adapter} (want {refs[tenant]})")
        row = rows[(tenant, rid)][0] if rows[(tenant, rid)] else None
        if row is not None and (row.input_tokens != want_ids or row.adapter != refs[tenant]):
            wrong.append(f"{tenant}/{rid}: ledger row of another job: input_tokens={row.input_tokens}, adapter={row.adapter}")
    assert not wrong, "\n".join(wrong)


async def test_duplicate_delivered_while_the_first_runs(tally, broker, tmp_path, demo_set, pg_database):
    """The same (tenant, request_id) delivered twice while its first copy is queued or running (same
    partition, and across partitions): both messages get a result with the same status, text and usage,
    the ledger holds exactly one row, succeeded (a failed row is never written for it, not even for a
    moment), and the copy costs no GPU time of its own (busy == attributed)."""
    with fresh_pg_schema(pg_database) as url:
        s, svc, refs = await _setup(broker, tmp_path, demo_set, url)
        messages = []
        for i in range(4):
            # Sampled without a seed: two runs of the same job would almost surely differ in their text.
            job = {"request_id": f"dup-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"a long story number {i} " * 4,
                   "max_new_tokens": 32, "temperature": 1.0}
            cross = i >= 2  # the copies on two partitions: two fetch positions, possibly in two fetches
            messages.append(job_message(job, f"dup-{i} first", partition=0 if cross else None))
            messages.append(job_message(job, f"dup-{i} copy", partition=1 if cross else None))
        identities = sorted({m.identity for m in messages})
        seen_status: dict = {i: set() for i in identities}
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                sent = await produce(s, messages)

                async def watch_ledger() -> None:
                    while True:
                        for identity, rows in (await asyncio.to_thread(usage_rows, svc.db, identities)).items():
                            seen_status[identity].update(r.status for r in rows)
                        await asyncio.sleep(0.05)

                watcher = asyncio.create_task(watch_ledger())
                try:
                    await col.until(lambda c: c.answered(sent) or not lw.alive(), 90)
                    await col.settle(1.5)
                    await wait_rows(svc.db, identities, 15)
                finally:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                end = await close_scenario(tally, sent, col, svc.db, lw, billed=identities)
                for identity, rs in end.rows.items():
                    seen_status[identity].update(r.status for r in rs)
        finally:
            svc.close()
    acct = end.acct
    assert not end.problems(), end.problems()
    assert not col.dlq, [d.error for d, _ in col.dlq]
    for identity in identities:
        results = acct.results[identity]
        assert len(results) == 2, (identity, len(results))
        assert results[0].status == "succeeded", (identity, [r.error for r in results])
        assert _body(results[0]) == _body(results[1]), f"{identity}: the two answers differ: {[_body(r) for r in results]}"
    never_failed = {i: st for i, st in seen_status.items() if st != {"succeeded"}}
    assert not never_failed, f"ledger statuses seen while the copies ran: {never_failed}"


async def test_resubmitted_after_it_finished_is_answered_from_the_ledger(tally, broker, tmp_path, demo_set, pg_database):
    """The same (tenant, request_id) resubmitted after its first run finished is answered from the stored
    result: the same text (sampled jobs, so a rerun would differ), no new GPU time (the worker's busy
    total does not grow), and its ledger row and the tenants' invoices do not change."""
    period = datetime.now(UTC).strftime("%Y-%m")
    with fresh_pg_schema(pg_database) as url:
        s, svc, refs = await _setup(broker, tmp_path, demo_set, url)
        jobs = [{"request_id": f"again-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"tell me about {i}",
                 "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95} for i in range(6)]
        jobs.append({"request_id": "again-failed", "tenant_id": "acme", "prompt": "x", "adapter": "nope"})  # a failed one too
        identities = [(j["tenant_id"], j["request_id"]) for j in jobs]
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                first = await produce(s, [job_message(j) for j in jobs])
                await col.until(lambda c: c.answered(first) or not lw.alive(), 60)
                rows_before = await wait_rows(svc.db, identities, 15)
                busy_before = await wait_conserved(svc.db, lw.worker_id)
                invoices_before = {t: build_invoice(svc.db, t, period, s.ledger) for t in refs}
                again = await produce(s, [job_message(j, f"{j['request_id']} again") for j in jobs])
                sent = first + again
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
                await col.settle(1.0)
                await asyncio.sleep(5 * s.worker.ledger_flush_ms / 1000)  # any GPU time of a rerun is flushed by now
                busy_after = await asyncio.to_thread(busy_and_attributed, svc.db, lw.worker_id)
                rows_after = await asyncio.to_thread(usage_rows, svc.db, identities)
                invoices_after = {t: build_invoice(svc.db, t, period, s.ledger) for t in refs}
                acct = account(sent, col)
                want = {i: "succeeded" for i in identities}
                want[("acme", "again-failed")] = "failed"
                unbilled, double = ledger_problems(rows_after, want, acct.results)
                changed = [i for i in identities if [row_dict(r) for r in rows_before[i]] != [row_dict(r) for r in rows_after[i]]]
                double += [f"{i}: ledger row changed by the resubmission" for i in changed]
                if busy_after[0] != busy_before[0]:
                    double.append(f"busy grew by {busy_after[0] - busy_before[0]} us on the resubmission")
                fill_tally(tally, sent, acct, col, [lw], unbilled, double, busy_after)
                assert lw.alive(), lw.death()
        finally:
            svc.close()
    assert not acct.lost and not acct.extra and not acct.stray, (acct.lost, acct.extra, acct.stray)
    assert not col.dlq, [d.error for d, _ in col.dlq]
    for identity in identities:
        results = acct.results[identity]
        assert len(results) == 2, (identity, len(results))
        assert _body(results[0]) == _body(results[1]), f"{identity} was run again, not answered from the ledger: {[_body(r) for r in results]}"
    assert busy_before[0] == busy_before[1], f"before: busy {busy_before[0]} us != attributed {busy_before[1]} us"
    assert busy_after[0] == busy_before[0], f"the resubmission ran on the GPU: busy {busy_before[0]} -> {busy_after[0]} us"
    assert busy_after[0] == busy_after[1], f"busy {busy_after[0]} us != attributed {busy_after[1]} us"
    assert not changed, f"ledger rows changed: {changed}"
    assert invoices_after == invoices_before, "a resubmission changed an invoice"
    assert not unbilled and not double, unbilled + double


async def test_same_batch_id_two_tenants(tally, broker, tmp_path, demo_set, pg_database):
    """Two tenants submit batches under the same batch_id with the same request ids: a tenant's manifest
    (consumer.submit.read_manifest) holds only its own ids, and collecting its batch (collect_results with
    its manifest) returns all of its results and only its own."""
    with fresh_pg_schema(pg_database) as url:
        s, svc, refs = await _setup(broker, tmp_path, demo_set, url)
        batch = "shared-batch"
        jobs = {t: [Job(request_id=f"b-{i}", tenant_id=t, batch_id=batch, prompt=f"{t} asks question {i}", max_new_tokens=2 + k)
                    for i in range(4)] for k, t in enumerate(refs)}
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                for tenant, tenant_jobs in jobs.items():
                    await produce_jobs(s.kafka, tenant_jobs, batch, tenant, "adversarial", "request")
                await col.until(lambda c: len(c.results) >= 8 or not lw.alive(), 60)
                collected, manifests = {}, {}
                for tenant, tenant_jobs in jobs.items():
                    manifest = BatchManifest(batch_id=batch, tenant_id=tenant, request_ids=[j.request_id for j in tenant_jobs])
                    collected[tenant] = await collect_results(s.kafka, manifest, timeout_s=20)
                    manifests[tenant] = await read_manifest(s.kafka, tenant, batch)
                identities = [(t, j.request_id) for t, js in jobs.items() for j in js]
                rows = await wait_rows(svc.db, identities, 15)
                busy = await wait_conserved(svc.db, lw.worker_id)
                tally.cases = len(identities)
                tally.dead_workers = int(not lw.alive())
                unbilled, double = ledger_problems(rows, {i: "succeeded" for i in identities}, {})
                tally.unbilled, tally.double_billed, tally.busy_gap_us = len(unbilled), len(double), busy[0] - busy[1]
                foreign = [f"{t}: {rid} answered with {r.tenant_id}'s result" for t, (results, _) in collected.items()
                           for rid, r in results.items() if r.tenant_id != t]
                tally.lost = sum(len({j.request_id for j in jobs[t]} - set(results)) for t, (results, _) in collected.items())
                for text in foreign[:3]:
                    tally.note(text)
                assert lw.alive(), lw.death()
        finally:
            svc.close()
    for tenant, manifest in manifests.items():
        assert manifest is not None and manifest.tenant_id == tenant, (tenant, manifest)
        assert manifest.request_ids == [j.request_id for j in jobs[tenant]], (tenant, manifest.request_ids)
    for tenant, (results, dlq) in collected.items():
        assert set(results) == {j.request_id for j in jobs[tenant]}, (tenant, sorted(results))
        assert not dlq, (tenant, dlq)
    assert not foreign, "\n".join(foreign)
    for tenant, (results, _) in collected.items():
        for r in results.values():
            assert r.status == "succeeded" and r.adapter == refs[tenant], (tenant, r)
    assert not unbilled and not double, unbilled + double
    assert busy[0] == busy[1], f"busy {busy[0]} us != attributed {busy[1]} us"



async def test_a_job_of_an_unknown_tenant_runs_when_resent_after_the_tenant_is_registered(tally, broker, tmp_path, demo_set, pg_database):
    """A job of a tenant not registered yet fails with unknown_tenant and is not billed (no row); once the tenant is
    registered, the same job resent is run and billed once, by this worker as by any other. (Before: this worker kept
    the failure in memory and replayed it to the resend, while the ledger, and so every other worker, had no answer.)"""
    with fresh_pg_schema(pg_database) as url:
        s, svc, _ = await _setup(broker, tmp_path, demo_set, url, **{"worker.registry_refresh_s": 0.5})
        job = {"request_id": "early-1", "tenant_id": "initech", "prompt": "before the tenant", "max_new_tokens": 2}
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                first = await produce(s, [job_message(job)])
                await col.until(lambda c: c.answered(first) or not lw.alive(), 60)
                svc.registry.add_tenant("initech")
                svc.registry.add_adapter("initech", "helper", demo_set["adapters"][sorted(demo_set["adapters"])[1]], default=True)
                await asyncio.sleep(2.0)  # past worker.registry_refresh_s: the worker routes on the new snapshot
                again = await produce(s, [job_message(job)])
                await col.until(lambda c: len(c.results_of(("initech", "early-1"))) >= 2 or not lw.alive(), 60)
                await col.settle(1.0)
                end = await close_scenario(tally, first + again, col, svc.db, lw, billed=[("initech", "early-1")])
        finally:
            svc.close()
    answers = [(r.status, r.error.code if r.error else None) for r in col.results_of(("initech", "early-1"))]
    assert answers == [("failed", "unknown_tenant"), ("succeeded", None)], answers
    assert not end.problems(), end.problems()
