"""Shared fixtures: the demo model and its adapters, written once per test session."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ("tests.db_fixtures", "tests.service_fixtures")

# The files that take longest (seconds of test time on this 2-core machine, from `--junitxml`), slowest first.
# pytest-xdist hands whole files to its workers in collection order (pyproject: `--dist loadfile
# --no-loadscope-reorder`), so these start first and the many short files fill in at the end; its own default order
# (most tests first) left the compile check (270 s on a cold Triton cache) to start last and run alone for minutes.
SLOWEST_FIRST = (  # by their time in a full run here (sessions 29-30, three workers); the compile test is slow on a cold Triton cache
    "tests/test_kernels_compile.py",
    "tests/test_cli_errors.py",
    "tests/test_kernel_attention.py",
    "tests/test_cuda_graph.py",
    "tests/test_kernel_lora.py",
    "tests/adversarial/test_broker_outage.py",
    "tests/adversarial/test_ledger_outage.py",
    "tests/test_scaleout.py",
    "tests/test_worker_lease.py",
    "tests/test_chaos.py",
    "tests/adversarial/test_redis_bad_day.py",
    "tests/adversarial/test_request_ids.py",
    "tests/test_zombie_worker.py",
    "tests/test_engine_triton.py",
    "tests/adversarial/test_broker_restart.py",
    "tests/test_worker_engine_process.py",
    "tests/test_cli_adapters_bulk.py",
    "tests/test_engine_process.py",
    "tests/test_kernel_bench_cases.py",
    "tests/test_worker_waits.py",
    "tests/test_kernel_consumer_lora.py",
    "tests/test_stages.py",
    "tests/adversarial/test_fuzz.py",
    "tests/test_audit_property.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in each xdist worker and in the processes it starts (engine processes, CLI workers). The three
    workers share two cores: at torch's default of two intra-op threads each, the threads spin waiting for one another
    and every CPU forward crawls. Measured on this machine, tests/test_engine.py beside two other torch processes
    (as in a suite run): 64 s at two threads each, 9.3 s at one (5.3 s alone on a quiet machine)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"  # read by torch at import, here and in every child process
        import torch

        torch.set_num_threads(1)  # torch may be imported already (plugins, the collection of an earlier file)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"root": Path, "model": model folder, "adapters": {name: PEFT adapter folder}} (engine.demo_model)."""
    from engine.demo_model import write_demo_set

    root = tmp_path_factory.mktemp("demo")
    adapters = write_demo_set(root, seed=0)
    return {"root": root, "model": root / "model", "adapters": adapters}
