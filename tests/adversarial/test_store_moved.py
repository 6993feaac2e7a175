"""The adapter store moved away under a running worker (an operator's `mv store store.bak`): every job for its adapters
failed as `engine_error`, "the worker failed on this job", retriable, with the real cause (adapter_missing) only in the
log, and that failure was kept as the request's answer. Now each fails with the adapter's own code and message, naming
`adapter_ref`, and the worker goes on serving; /readyz, which answered all well, names the store missing under
`degraded`."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from billing import db
from migrations import SCRIPT_LOCATION
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


async def test_jobs_on_a_moved_store_fail_with_the_adapters_code(broker, tmp_path, demo_set, pg_database):
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"])
        svc = open_services(s)
        register_two_tenants(svc, demo_set)
        store = s.store.adapter_dir
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                # moved once the worker serves: a worker starting takes its id's lock in <store>/.workers and so makes the
                # store's folder again (as it makes a store that is not there yet), which /readyz then finds in place
                for _ in range(600):
                    if lw.worker.metrics.health.phase == "serving" or not lw.alive():
                        break
                    await asyncio.sleep(0.05)
                shutil.move(str(store), str(store) + ".bak")
                jobs = [{"request_id": f"m-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": "hi", "max_new_tokens": 2}
                        for i in range(4)]  # fmt: skip
                sent = await produce(s, [job_message(j) for j in jobs])
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
                alive = lw.alive()
                ready, body = lw.worker.metrics.health.ready()  # what /readyz answers meanwhile
        finally:
            svc.close()
    assert ready and body["degraded"] == ["adapter_store"] and f"{store} is missing" in body["adapter_store"], body
    assert alive
    results = [r for r in col.results if r.request_id.startswith("m-")]
    assert len(results) == 4, results
    for r in results:
        assert r.status == "failed" and r.error.code != "engine_error", (r.request_id, r.error)
        assert r.error.code.startswith("adapter_") and r.error.field == "adapter_ref", r.error
