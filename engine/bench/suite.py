"""Issue 4's measurements on one GPU: `python -m engine.bench.suite MODE OUT_DIR`, one process per mode.

- check: the engine on Triton kernels + CUDA graphs against the eager torch path on the demo model (fp32:
  tokens equal; bf16: tokens and first-step logits close).
- llama-1b, llama-1b-mixed-ranks, llama-8b: the issue's command lines: llama-1b (batch 32, prompt 128, 64
  new, 32 adapters of rank 16, with the peer), the same with mixed ranks 8/16/32/64 against a uniform batch
  at their mean rank, and llama-8b (batch 32, prompt 512 for the prefill, 64 new).
- summary: a short table of the JSON files in OUT_DIR.

Each writes OUT_DIR/<mode>.json; engine/PERF.md records the table.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.api import GenerationRequest, SamplingParams
from engine.bench.serving import bench_engine
from engine.config import EngineConfig
from engine.demo_model import write_demo_set
from engine.engine import Engine
from engine.runner import BatchItem

ISSUE_1B = dict(shape="llama-1b", adapters=32, rank=16, batch=32, prompt=128, new=64)
ISSUE_8B = dict(shape="llama-8b", adapters=32, rank=16, batch=32, prompt=512, new=64)


def check_engine(dtype: str, device: str = "cuda", requests: int = 24, new: int = 24) -> dict:
    """Triton + graphs vs torch eager on the demo model: `requests` requests over 8 adapters and none, greedy, one batch."""
    root = Path(tempfile.mkdtemp())
    adapters = write_demo_set(root)
    names = list(adapters)
    gen = torch.Generator().manual_seed(1)
    reqs = [GenerationRequest(request_id=f"c{i}", input_ids=tuple(torch.randint(4, 500, (4 + (7 * i) % 40,), generator=gen).tolist()),
                              adapter_key=[None, *names][i % (len(names) + 1)], sampling=SamplingParams(max_new_tokens=new, ignore_eos=True))
            for i in range(requests)]  # fmt: skip
    out, logits = {}, {}
    for backend in ("torch", "triton"):
        eng = Engine(EngineConfig(model_dir=str(root / "model"), device=device, dtype=dtype, max_prompt_tokens=64, max_new_tokens=new,
                                  kv_block_size=16, max_batch_size=32, max_loras=8, kernel_backend=backend, kv_num_blocks=None,
                                  adapter_gpu_bytes=None, adapter_read_processes=0))  # fmt: skip
        for name, path in adapters.items():
            eng.load_adapter(name, path)
        t0 = time.perf_counter()
        results = eng.generate(reqs)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        out[backend] = [r.output_ids for r in results]
        wall = time.perf_counter() - t0
        items = [BatchItem(("l", i), r.input_ids, 0, -1 if r.adapter_key is None else eng.adapters.acquire(r.adapter_key)[0])
                 for i, r in enumerate(reqs)]  # fmt: skip
        logits[backend] = eng.runner.forward(items)
        print(f"  {dtype} {backend}: generate {wall:.2f}s, graphs {sorted(eng.runner.graphs._graphs) if eng.runner.graphs else None}", flush=True)
    same = sum(a == b for a, b in zip(out["torch"], out["triton"]))
    tokens = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(out["torch"], out["triton"]))
    err = ((logits["triton"] - logits["torch"]).abs().max() / logits["torch"].abs().max()).item()
    return {"dtype": dtype, "requests_equal": same, "requests": len(reqs), "tokens_equal": tokens, "tokens": new * len(reqs),
            "prefill_logits_rel_err": err}  # fmt: skip


RUNS = {
    "llama-1b": dict(ISSUE_1B, peer=True),
    "llama-1b-mixed-ranks": dict(ISSUE_1B, mixed_ranks="8,16,32,64"),
    "llama-8b": ISSUE_8B,
    # issue 22: the FP8 base against the bf16 runs above (same shapes and adapters)
    "llama-1b-fp8": dict(ISSUE_1B, weight_dtype="fp8"),
    "llama-8b-fp8": dict(ISSUE_8B, weight_dtype="fp8"),
}


def main(mode: str, out_dir: str) -> None:
    """mode: check (the engine checks), a name of RUNS (one bench), or summary (the table of what OUT_DIR holds).
    The command runs each in its own process, so that one failure (a device-side assert poisons the process's
    CUDA context) loses nothing else."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mode == "summary":
        results = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
        _summary(results)
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if mode == "check":
        for dtype in ("float32", "bfloat16"):
            result = check_engine(dtype)
            print(json.dumps(result), flush=True)
            (out / f"check_{dtype}.json").write_text(json.dumps(result, indent=1))
        return
    kw = RUNS[mode]
    print(f"== bench_engine({', '.join(f'{k}={v!r}' for k, v in kw.items())}, device='cuda')", flush=True)
    t0 = time.perf_counter()
    result = bench_engine(device="cuda", **kw)
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    (out / f"{mode}.json").write_text(json.dumps(result, indent=1))


def _summary(results: dict[str, dict]) -> None:
    print("\nsummary")
    for name, r in results.items():
        if name.startswith("check"):
            print(f"{name}: {r['requests_equal']}/{r['requests']} requests, {r['tokens_equal']}/{r['tokens']} tokens equal; "
                  f"logits rel err {r['prefill_logits_rel_err']:.1e}")  # fmt: skip
            continue
        print(f"{name}: base {r['base_step_ms']:.3f} ms ({r['base_device_step_ms']:.3f} device) vs roofline {r['base_roofline_ms']:.3f} "
              f"= {r['base_x_roofline']:.2f}x | mixed {r['mixed_step_ms']:.3f} ({r['mixed_device_step_ms']:.3f}) vs "
              f"{r['mixed_roofline_ms']:.3f} = {r['mixed_x_roofline']:.2f}x | tok/s base {r['ours_base_tok_s']:.0f} mixed "
              f"{r['ours_mixed_tok_s']:.0f} peer {r['peer_base_tok_s']} / {r['peer_mixed_tok_s']} | one step per round: base "
              f"{r.get('base_step_ms_one_per_round', 0):.3f} mixed {r.get('mixed_step_ms_one_per_round', 0):.3f} | prefill {r['prefill_ms']:.1f} ms "
              f"({r.get('prefill_device_ms', 0):.1f} device; mixed {r['mixed_prefill_ms']:.1f}, {r.get('mixed_prefill_device_ms', 0):.1f}) "
              f"{r['prefill_tflops']:.1f} TFLOP/s = {r['prefill_matmul_pct']:.1f}% of {r['matmul_tflops']:.0f}, LoRA "
              f"+{r['prefill_lora_overhead_pct']:.1f}% | mixed/uniform {r.get('mixed_ranks_ratio')} (LoRA {r.get('mixed_ranks_lora_ratio')})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
