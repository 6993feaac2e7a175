"""Shared fixtures: the demo model and its adapters, written once per test session."""

from __future__ import annotations

import pytest

pytest_plugins = ("tests.db_fixtures", "tests.service_fixtures")


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"root": Path, "model": model folder, "adapters": {name: PEFT adapter folder}} (engine.demo_model)."""
    from engine.demo_model import write_demo_set

    root = tmp_path_factory.mktemp("demo")
    adapters = write_demo_set(root, seed=0)
    return {"root": root, "model": root / "model", "adapters": adapters}
