"""The scale-out script's mechanics on one machine: two worker processes in one group against one,
every job one result and one ledger row, and keying by adapter loads each adapter on fewer workers."""

import pytest

from consumer.bench_scaleout import bench_scaleout

pytestmark = pytest.mark.slow


def test_two_workers_against_one_on_the_cpu(capsys):
    figures = bench_scaleout(shape="tiny", workers=2, adapters=12, rank=8, jobs=240, new_tokens=2, json_only=True)
    assert figures["all_results_and_rows"], figures
    one, by_adapter, by_request = figures["scenarios"]
    assert one["workers"] == 1 and by_adapter["workers"] == by_request["workers"] == 2
    assert by_adapter["adapter_loads"] < by_request["adapter_loads"], figures
