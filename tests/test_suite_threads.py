"""The suite's own setting (tests/conftest.py, pytest_configure): one torch thread in each xdist worker and its children."""

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="set in xdist workers only (-n 0 keeps torch's default)")
def test_an_xdist_worker_and_its_children_run_one_torch_thread():
    """Three workers on two cores at two threads each spun against one another (tests/test_engine.py took 87 s beside
    two torch processes, 30 s at one thread): the worker and a process it starts both run one."""
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "1", (child.returncode, child.stdout, child.stderr)
