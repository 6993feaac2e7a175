"""Every decode graph bucket captures and runs at the real shapes, up to the batch the engine derives on a GPU (issue 20).

At llama-8b with max_batch_size = 64 the engine once raised during capture: the decode GEMM's Triton config for 64 rows
asked more shared memory than an H200 has, although it compiled (kernels.compile_check now checks the budget too). Here
each bucket of graph_batch_sizes(256), with adapters on half the rows and with none, is captured and replayed through
the engine for the llama-1b and llama-8b shapes (random weights). CUDA only: skipped elsewhere. It imports no service
fixture, so it runs with `pytest --noconftest` on a GPU machine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs on a GPU")

MAX_BATCH = 256  # engine.sizing AUTO_MAX_BATCH: what a GPU's derived max_batch_size reaches


@pytest.mark.parametrize("shape", ["llama-1b", "llama-8b"])
def test_every_graph_bucket_captures_and_runs(shape):
    from engine.api import GenerationRequest, SamplingParams
    from engine.backend import graph_batch_sizes
    from engine.bench.build import build_bench_engine, model_config

    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        engine, paths = build_bench_engine(model_config(shape), shape, [8, 16, 32, 64], None, MAX_BATCH, 16, 3, dev,
                                           torch.bfloat16, Path(tmp))  # fmt: skip
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.sizes == graph_batch_sizes(MAX_BATCH)
        gen = torch.Generator().manual_seed(0)
        for b in graphs.sizes:
            for lora in (True, False):
                reqs = [GenerationRequest(request_id=f"{b}-{lora}-{i}", input_ids=tuple(torch.randint(4, 1000, (16,), generator=gen).tolist()),
                                          adapter_key=paths[i % len(paths)].name if lora and i % 2 == 0 else None,
                                          sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
                        for i in range(b)]  # fmt: skip
                results = engine.generate(reqs)
                assert all(r.ok and len(r.output_ids) == 3 for r in results), [r.error for r in results if not r.ok][:3]
                assert (b, lora) in graphs._graphs, (shape, b, lora)
        del engine
        torch.cuda.empty_cache()
