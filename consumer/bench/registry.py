"""`lorabatch bench registry`: many adapters registered in one `lorabatch adapters add`, the same call again, and
`lorabatch tenants list` with them and some hundred tenants registered.

Each command is timed as an operator sees it: its process from start to exit (`python -m consumer.cli`, imports
included). The adapters are the demo model's (engine.demo_model.write_demo_adapter), cycling the demo set's eight kinds,
ranks 4 to 64 over four target sets (29 KB to 1.5 MB of files, 0.45 MB on average), each of its own seed and so its own
content. They are named in one manifest, one line each, over the tenants in turn; `--form dir` registers them all for
one tenant with --dir instead. The ledger is a fresh SQLite file in the bench's temporary folder, or a fresh schema of
the database `--db` names (billing.bench.scratch); the store and the adapters are in the temporary folder, removed after.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.engine import make_url

_SUMMARY = re.compile(r"^(\d+) adapters: (\d+) registered, (\d+) unchanged, (\d+) failed$", re.M)


def bench_registry(*, adapters: int, tenants: int, form: str, db_url: str | None, lists: int, script_location: str,
                   json_only: bool = False) -> dict[str, object]:  # fmt: skip
    """Run the bench (module docstring); print a table (unless json_only) and one JSON line; return the figures."""
    from billing import db
    from billing.bench.scratch import scratch_database
    from consumer.config import load_settings
    from consumer.registry import Registry
    from consumer.services import open_services
    from engine.demo_model import DEMO_ADAPTERS, write_demo_adapter, write_demo_model

    assert adapters >= 1 and tenants >= 1 and lists >= 1 and form in ("manifest", "dir"), (adapters, tenants, lists, form)
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="lorabatch-bench-registry-") as tmp:
        root = Path(tmp)
        write_demo_model(root / "model")
        kinds = list(DEMO_ADAPTERS.values())
        t0 = time.perf_counter()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=json_only) as progress:  # fmt: skip
            task = progress.add_task("writing adapters", total=adapters)
            for i in range(adapters):
                rank, targets, alpha, rslora = kinds[i % len(kinds)]
                write_demo_adapter(root / "adapters" / f"a{i:05d}", root / "model", rank=rank, target_modules=targets,
                                   alpha=alpha, use_rslora=rslora, seed=i + 1)  # fmt: skip
                progress.advance(task)
        write_s = time.perf_counter() - t0
        adapter_bytes = sum(f.stat().st_size for f in (root / "adapters").rglob("*") if f.is_file())
        tenant_ids = [f"t{i:04d}" for i in range(tenants)]
        with scratch_database(db_url or f"sqlite:///{root / 'ledger.db'}") as url:
            db.upgrade(url, script_location=script_location)
            config = root / "lorabatch.toml"
            config.write_text(f'[ledger]\nurl = "{url}"\n[store]\nadapter_dir = "{root / "store"}"\n'
                              f'[engine]\nmodel_dir = "{root / "model"}"\n')  # fmt: skip
            svc = open_services(load_settings(config))
            registry: Registry = svc.registry
            for t in tenant_ids:
                registry.add_tenant(t)
            if form == "manifest":
                manifest = root / "adapters.jsonl"
                manifest.write_text("".join(json.dumps({"name": f"a{i:05d}", "path": f"adapters/a{i:05d}", "tenant": tenant_ids[i % tenants]})
                                            + "\n" for i in range(adapters)))  # fmt: skip
                source = ["--manifest", str(manifest)]
            else:
                source = ["--tenant", tenant_ids[0], "--dir", str(root / "adapters")]
            add = ["adapters", "add", *source, "--quiet", "--config", str(config)]
            first_s, first = _timed(add)
            again_s, again = _timed(add)
            list_times = []
            for _ in range(lists):
                list_s, listing = _timed(["tenants", "list", "--config", str(config)])
                list_times.append(list_s)
            rows = len(registry.list_adapters())
            svc.close()
    assert _counts(first) == (adapters, adapters, 0, 0), first
    assert _counts(again) == (adapters, 0, adapters, 0), again
    assert rows == adapters, (rows, adapters)
    assert all(t in listing for t in tenant_ids), "tenants list left out tenants"
    figures: dict[str, object] = {
        "backend": "sqlite" if db_url is None else make_url(db_url).get_backend_name(),
        "form": form,
        "adapters": adapters,
        "adapter_mb": round(adapter_bytes / 1e6, 1),
        "tenants": tenants,
        "write_adapters_s": round(write_s, 2),
        "add_s": round(first_s, 2),
        "add_adapters_per_s": round(adapters / first_s),
        "add_again_s": round(again_s, 2),
        "tenants_list_s_median": round(statistics.median(list_times), 3),
        "tenants_list_s_max": round(max(list_times), 3),
        "tenants_list_runs": lists,
    }
    if not json_only:
        width = max(map(len, figures))
        for key, value in figures.items():
            print(f"{key:<{width}}  {value}")
    print(json.dumps(figures), flush=True)
    return figures


def _timed(args: list[str]) -> tuple[float, str]:
    """Wall seconds of `lorabatch ARGS` in a process of its own, and its stdout; a failed command ends the bench."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "consumer.cli", *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"`lorabatch {' '.join(args)}` exited with {done.returncode}: {done.stderr[-2000:]}")
    return elapsed, done.stdout


def _counts(out: str) -> tuple[int, int, int, int]:
    m = _SUMMARY.search(out)
    assert m is not None, out
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]
