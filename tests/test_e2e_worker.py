"""End to end through the real broker process: jobs in, results out, ledger rows, DLQ, redelivery."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from collections import Counter
from datetime import UTC, datetime

import pytest

from billing.conservation import period_conservation
from consumer.broker import free_port
from consumer.schemas import DlqRecord, Job, Result
from consumer.submit import produce_jobs
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import (committed_vs_end, ledger_rows, open_services, produce_raw, read_all, running_worker,
                                   service_settings)

pytestmark = pytest.mark.slow


def _register(svc, demo_set):
    names = sorted(demo_set["adapters"])
    svc.registry.add_tenant("acme")
    svc.registry.add_tenant("globex", tier="premium")
    svc.registry.add_tenant("hooli")  # no adapters at all: its jobs run on the base where they allow it
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][names[0]], default=True)
    svc.registry.add_adapter("acme", "legal", demo_set["adapters"][names[1]])
    svc.registry.add_adapter("globex", "chat", demo_set["adapters"][names[2]], default=True)
    svc.registry.add_adapter("globex", "shared", demo_set["adapters"][names[3]], public=True)
    svc.registry.add_adapter("globex", "secret", demo_set["adapters"][names[4]])


def _jobs() -> tuple[list[Job], dict[str, str]]:
    """Valid jobs of both tenants, and answerable invalid ones with the error code each must get."""
    jobs = []
    for i in range(24):
        tenant = ("acme", "globex")[i % 2]
        kind = i % 6
        d = {"request_id": f"r{i}", "tenant_id": tenant, "batch_id": "b1", "max_new_tokens": 4 + i % 5}
        if kind == 0:
            d["adapter"] = "legal" if tenant == "acme" else "chat@1"
        elif kind == 1:
            d["adapter"] = "shared"  # globex's public adapter, open to acme too
        elif kind == 2:
            d["tenant_id"] = "hooli"
            d["allow_base_fallback"] = True
        if i % 4 == 0:
            d["messages"] = [{"role": "user", "content": f"question {i}"}]
        elif i % 4 == 1:
            d["input_ids"] = [1, 5, 9, 13 + i]
        else:
            d["prompt"] = f"prompt number {i} for {tenant}"
        if i % 5 == 0:
            d.update(temperature=0.7, top_p=0.9, seed=i)
        jobs.append(Job.model_validate(d))
    bad = {
        "bad-adapter": ({"adapter": "nope"}, "unknown_adapter"),
        "forbidden": ({"adapter": "secret"}, "adapter_forbidden"),
        "too-many-tokens": ({"max_new_tokens": 33}, "max_new_tokens_too_large"),
        "too-long": ({"prompt": "word " * 400}, "prompt_too_long"),
    }
    codes = {}
    for rid, (fields, code) in bad.items():
        d = {"request_id": rid, "tenant_id": "acme", "batch_id": "b1", "prompt": "hello", **fields}
        jobs.append(Job.model_validate(d))
        codes[rid] = code
    return jobs, codes


async def test_jobs_results_ledger_dlq_and_redelivery(broker, tmp_path, demo_set, cpu_engine, ledger_url):
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"])
    svc = open_services(s)
    _register(svc, demo_set)
    jobs, codes = _jobs()
    raw_bad = [
        b"{not json",  # DLQ: malformed
        json.dumps({"request_id": "x1", "prompt": "no tenant"}).encode(),  # DLQ: cannot be answered
        json.dumps({"request_id": "ghost-1", "tenant_id": "ghost", "prompt": "hi"}).encode(),  # failed: unknown tenant
        json.dumps({"request_id": "typo-1", "tenant_id": "acme", "prompt": "hi", "max_tokens": 3}).encode(),  # failed: field
    ]
    n_answerable = len(jobs) + 2
    async with running_worker(s, svc, cpu_engine) as rw:
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        await produce_raw(s, raw_bad)
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= n_answerable)
        dlq = await read_all(s, s.kafka.dlq_topic, DlqRecord, lambda got: len(got) >= 2)

        by_id = {r.request_id: r for r in results}
        assert len(results) == n_answerable and len(by_id) == n_answerable
        for job in jobs:
            r = by_id[job.request_id]
            if job.request_id in codes:
                assert r.status == "failed", r
                assert r.error.code == codes[job.request_id], r.error
                assert r.error.message
            else:
                assert r.status == "succeeded", r.error
                assert r.finish_reason in ("stop", "length", "eos")
                assert 1 <= r.usage.output_tokens <= job.max_new_tokens
                assert r.usage.input_tokens > 0 and r.cost.base_ms > 0
                assert (r.adapter is None) == (r.route == "base_fallback")
        assert by_id["r2"].route == "base_fallback" and by_id["r3"].route == "tenant_default"
        assert by_id["r0"].adapter == "legal@1" and by_id["r1"].adapter == "shared@1"
        assert by_id["ghost-1"].error.code == "unknown_tenant"
        assert by_id["typo-1"].error.field == "max_tokens" and "remove" in by_id["typo-1"].error.message

        assert sorted(d.error.code for d in dlq) == ["invalid_job", "malformed_json"]
        assert {d.source_topic for d in dlq} == {s.kafka.jobs_topic}
        assert all(d.source_offset >= 0 and d.raw_b64 for d in dlq)
        assert next(d for d in dlq if d.error.code == "invalid_job").error.field == "tenant_id"

        # Every answerable job of a registered tenant has exactly one ledger row (ghost has none).
        assert await ledger_rows(svc, n_answerable - 1) == n_answerable - 1
        row = svc.ledger.usage_for("acme", "r0")
        assert row.adapter == "legal@1" and row.status == "succeeded" and row.base_us > 0
        assert row.gpu_kind == s.ledger.gpu_kind, "the row names the GPU kind that ran it: its price list prices it"
        tiers = (row.tier, svc.ledger.usage_for("globex", "r1").tier)
        assert tiers == ("standard", "premium"), "each row names its tenant's tier as routed: its token price list"

        # Per-period conservation: the requests' base + LoRA time is exactly the engine's measured busy time.
        # Busy time reaches the ledger every worker.ledger_flush_ms (1 s), so the last steps' record may come up to
        # that long after their results: wait for the flush (up to 10 s) rather than for a fixed time.
        period = datetime.now(UTC).strftime("%Y-%m")
        deadline = time.monotonic() + 10
        while ((c := period_conservation(svc.db, period, s.ledger)).busy_us == 0 or c.attributed_us != c.busy_us) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert c.busy_us > 0 and c.attributed_us == c.busy_us, c
        assert c.cold_start_us == c.load_us, c

        # Metrics over HTTP, with bounded label sets.
        port = free_port()
        rw.worker.metrics.serve(port)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        for needle in ('lora_request_total{adapter="legal@1",status="succeeded",tenant="acme"}',
                       'lora_route_decision_total{reason="explicit"}', 'lora_route_decision_total{reason="unknown_tenant"}',
                       'lorabatch_queue_depth{tenant="globex"}', "lorabatch_consumer_lag{", "# TYPE lora_cold_start_duration_ms histogram",
                       'lorabatch_dlq_total{code="malformed_json"} 1.0', "lora_route_decision_seconds_bucket"):
            assert needle in text, needle
        assert 'tenant="ghost"' not in text, "unregistered tenants must not become label values"

        # Redelivery: the same jobs again give duplicate results with the same ids, and no ledger row.
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        again = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= n_answerable + len(jobs))
        counts = Counter(r.request_id for r in again)
        assert all(counts[j.request_id] == 2 for j in jobs)
        assert svc.ledger.count_usage() == n_answerable - 1
        await rw.stop()

    committed, end = await committed_vs_end(s)
    assert committed == end, "every message's offset is committed once its result and row are saved"
    svc.close()


@ONE_LEDGER
async def test_corrupt_adapter_fails_its_jobs_only(broker, tmp_path, demo_set, cpu_engine, ledger_url):
    """A corrupt adapter file fails its own jobs with a clear code (or runs them on the base where the
    job allows it); the worker keeps serving everything else."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"])
    svc = open_services(s)
    names = sorted(demo_set["adapters"])
    svc.registry.add_tenant("initech")
    good, _ = svc.registry.add_adapter("initech", "good", demo_set["adapters"][names[5]], default=True)
    broken, _ = svc.registry.add_adapter("initech", "broken-e2e", demo_set["adapters"][names[6]])
    weights = svc.registry.store.path(broken.sha256) / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[:100])  # truncated on disk after registration
    gone, _ = svc.registry.add_adapter("initech", "gone-e2e", demo_set["adapters"][names[7]])
    folder = svc.registry.store.path(gone.sha256)
    folder.chmod(0o755)
    shutil.rmtree(folder)  # its store folder removed after registration: the worker cannot even register it
    jobs = [
        Job(request_id="ok-1", tenant_id="initech", prompt="hello", max_new_tokens=3),
        Job(request_id="bad-1", tenant_id="initech", adapter="broken-e2e", prompt="hello", max_new_tokens=3),
        Job(request_id="bad-2", tenant_id="initech", adapter="broken-e2e", prompt="hello", max_new_tokens=3,
            allow_base_fallback=True),
        Job(request_id="ok-2", tenant_id="initech", prompt="again", max_new_tokens=3),
        Job(request_id="gone-1", tenant_id="initech", adapter="gone-e2e", prompt="hello", max_new_tokens=3),
        Job(request_id="gone-2", tenant_id="initech", adapter="gone-e2e", prompt="hello", max_new_tokens=3,
            allow_base_fallback=True),
    ]
    async with running_worker(s, svc, cpu_engine) as worker:
        await produce_jobs(s.kafka, jobs, "b2", "initech", "test", "tenant")
        results = {r.request_id: r for r in await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= 6)}
        assert await ledger_rows(svc, 6) == 6
        # both adapters' own failures count against their circuits, wherever they were found
        failures = {key: worker.worker.breakers.failures(key) for key in (broken.adapter_key, gone.adapter_key)}
    assert results["ok-1"].status == results["ok-2"].status == "succeeded"
    assert results["ok-1"].adapter == good.adapter
    assert results["bad-1"].status == "failed" and results["bad-1"].error.code.startswith("adapter_")
    assert "broken-e2e@1" in results["bad-1"].error.message
    assert results["bad-2"].status == "succeeded" and results["bad-2"].adapter is None
    assert results["bad-2"].route.startswith("base_fallback") and "failed to load" in results["bad-2"].route
    # An adapter's own fault bills its failed requests on its invoice line, not the base model's, wherever it is found
    for rid, adapter in (("bad-1", broken), ("gone-1", gone)):
        row = svc.ledger.usage_for("initech", rid)
        assert (results[rid].adapter, row.adapter, row.adapter_sha256) == (adapter.adapter, adapter.adapter, adapter.sha256), rid
        assert (row.status, row.base_us, row.lora_us) == ("failed", 0, 0)
    assert results["gone-1"].error.code == "adapter_missing"
    # found as the worker registers it: a job that allows it runs on the base, as where the engine fails to load one
    assert results["gone-2"].status == "succeeded" and results["gone-2"].adapter is None
    assert results["gone-2"].route == "base_fallback (gone-e2e@1 failed to load)", results["gone-2"].route
    assert svc.ledger.usage_for("initech", "gone-2").adapter is None
    assert failures == {broken.adapter_key: 2, gone.adapter_key: 2}, failures
    svc.close()
