"""The scale-out script's mechanics on one machine: two worker processes in one group against one,
every job one result and one ledger row, and keying by adapter loads each adapter on fewer workers."""

import math

import pytest

from consumer.bench.scaleout import bench_scaleout

pytestmark = pytest.mark.slow


def test_two_workers_against_one_on_the_cpu(capsys):
    figures = bench_scaleout(shape="tiny", workers=2, adapters=8, rank=8, jobs=96, new_tokens=2, json_only=True)
    assert figures["all_results_and_rows"], figures
    one, by_adapter, by_request, balanced = figures["scenarios"]
    assert one["workers"] == 1 and by_adapter["workers"] == by_request["workers"] == balanced["workers"] == 2
    assert by_adapter["adapter_loads"] < by_request["adapter_loads"], figures
    assert balanced["adapter_loads"] < by_request["adapter_loads"], figures


def test_balanced_partitions_even_out_a_zipf_batch():
    """Placed by balanced_partitions, a zipf batch loads every partition within 5% of the mean (hashed by adapter, the
    same batch puts 68% of its jobs on the even partitions); an adapter stays on one partition unless it alone is
    heavier than a partition's share, and then spans only as many as its weight needs."""
    from collections import defaultdict

    from aiokafka.partitioner import DefaultPartitioner

    from consumer.bench.scaleout import _zipf_jobs
    from consumer.submit import balanced_partitions, job_weight, partition_key

    names = [f"a{i:03d}" for i in range(64)]
    jobs = _zipf_jobs(2000, names, "t", 16)
    parts = list(range(8))
    placed = balanced_partitions(jobs, parts)
    load = [0] * 8
    spread = defaultdict(set)
    for job, p in zip(jobs, placed):
        load[p] += job_weight(job)
        spread[job.adapter_ref].add(p)
    mean = sum(load) / 8
    assert max(load) <= 1.05 * mean and min(load) >= 0.95 * mean, load
    for adapter, ps in spread.items():
        weight = sum(job_weight(j) for j in jobs if j.adapter_ref == adapter)
        assert len(ps) == max(1, math.ceil(weight / mean)), (adapter, weight, sorted(ps))
    hashed = [0] * 8
    partitioner = DefaultPartitioner()
    for job in jobs:
        hashed[partitioner(partition_key(job, "adapter"), parts, parts)] += 1
    assert sum(hashed[0::2]) > 0.6 * len(jobs)  # what the balance fixes, in this very batch


def test_balanced_partitions_of_edge_cases():
    """One job, one partition, and a batch of one adapter: every job placed on a partition that exists."""
    from consumer.schemas import Job
    from consumer.submit import balanced_partitions

    one = [Job(request_id="r", tenant_id="t", adapter="a", input_ids=[1], max_new_tokens=4)]
    assert balanced_partitions(one, [0, 1, 2]) == [0]
    same = [Job(request_id=f"r{i}", tenant_id="t", adapter="a", input_ids=[1], max_new_tokens=4) for i in range(9)]
    placed = balanced_partitions(same, [0, 1, 2])
    assert sorted(placed) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # one hot adapter: spread over all three, evenly
    assert balanced_partitions(same, [5]) == [5] * 9
