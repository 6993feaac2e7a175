"""Checking PEFT adapter folders as the engine would load them, and putting them into the store, many at once.

`lorabatch adapters add` registers adapters through here (consumer.bulk_adapters). Each folder is read once
(engine.store.adapter_files: the two files, no pickles, no links out of the folder, engine.max_adapter_bytes), hashed,
validated as a store read validates it (engine.adapters.parse_adapter: the config, the safetensors, r <=
engine.max_lora_rank, every tensor against the base's shapes and fingerprint), and only then written into the store
(AdapterStore.put_bytes: a temporary folder renamed into place), so a folder that fails leaves nothing behind.

Threads, not processes: on the 2-core machine, 2,000 demo-model adapters of ranks 4 to 64 (896 MB) took 5.1-5.9 s on
4 threads, 5.7 on 8, 9.2 on 2 and 12.9 on one; 6.8 s on 2 forked processes and 8.2-12.2 on 2 spawned ones (each
imports torch first). Reading, sha256, torch's min/max and the fsyncs release the GIL; what holds it (JSON, the
safetensors header, the key checks) is a small part of an adapter.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from engine.adapters import parse_adapter
from engine.api import AdapterError
from engine.model import ModelConfig
from engine.store import AdapterStore, adapter_files, content_sha256, read_file


# The registry keeps lora_alpha as NUMERIC(10, 4) (billing.models.Adapter.alpha): 4 decimals, 6 digits before the
# point. An alpha of 10^6 or more overflowed that column at every try after its content was stored, and one under
# 0.00005 was listed as 0 (the engine scales by the file's value, but the registry and its readers would not).
ALPHA_STEP = Decimal("0.0001")
ALPHA_LIMIT = Decimal(10**6)


def default_threads() -> int:
    """Two threads a core (half of each adapter's time is waiting on the disk), at most 16."""
    return min(16, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class AdapterChecks:
    """What an adapter is checked against: the serving base (None: everything but the base's shapes and fingerprint)
    and the engine's largest rank."""

    model: ModelConfig | None
    base_fingerprint: str | None
    max_lora_rank: int

    @classmethod
    def for_model_dir(cls, model_dir: Path, max_lora_rank: int) -> AdapterChecks:
        """Checks against the model in `model_dir`; without the base when the folder holds no config.json (the caller
        says so: `model` is None)."""
        from engine.checkpoint import base_fingerprint, read_model_config

        if not (Path(model_dir) / "config.json").is_file():
            return cls(None, None, max_lora_rank)
        return cls(read_model_config(model_dir), base_fingerprint(model_dir), max_lora_rank)


@dataclass(frozen=True)
class Imported:
    """An adapter that passed its checks and is in the store."""

    sha256: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    nbytes: int  # its two files
    added: bool  # this import wrote the store's entry (False: that content was stored already)


def import_adapter(path: Path, store: AdapterStore, checks: AdapterChecks) -> Imported:
    """Read, hash, check and store one adapter folder; raises AdapterError (what is wrong and the fix) or OSError."""
    config_path, weights_path = adapter_files(path, store.max_bytes)
    config = bytes(read_file(config_path, store.max_bytes))
    weights = read_file(weights_path, store.max_bytes - len(config))  # the limit is on both files together
    adapter = parse_adapter(config, weights, checks.model, max_lora_rank=checks.max_lora_rank,
                            sha256=content_sha256(config, weights), source=Path(path), base_fingerprint=checks.base_fingerprint)  # fmt: skip
    _check_alpha(adapter.alpha, config_path)  # before the store: a refused adapter leaves nothing behind
    sha, added = store.put_bytes(config, weights)
    assert sha == adapter.sha256, (sha, adapter.sha256)
    return Imported(sha, adapter.rank, adapter.alpha, adapter.target_modules, len(config) + len(weights), added)


def _check_alpha(alpha: float, config_path: Path) -> None:
    """Refuse a lora_alpha the registry cannot hold as it is: not above 0, 10^6 or more, or 0 at 4 decimals (rounded
    half up, as PostgreSQL rounds it into the column). parse_adapter has refused a non-finite one already."""
    fits = 0 < alpha < ALPHA_LIMIT  # first: quantize() of a huge value raises InvalidOperation
    if fits:
        rounded = Decimal(str(alpha)).quantize(ALPHA_STEP, ROUND_HALF_UP)
        fits = 0 < rounded < ALPHA_LIMIT
    if not fits:
        raise AdapterError(f"{config_path}: lora_alpha={alpha!r} is out of range; set lora_alpha from {ALPHA_STEP} to "
                           f"{ALPHA_LIMIT - ALPHA_STEP} (the registry keeps it with 4 decimals)", code="adapter_invalid")  # fmt: skip


def import_adapters(paths: Sequence[Path], store: AdapterStore, checks: AdapterChecks, *, threads: int,
                    done: Callable[[], None] | None = None) -> list[Imported | AdapterError | OSError]:  # fmt: skip
    """`import_adapter` of each path on `threads` threads: what each gave, in order, its failure in its place. `done`
    is called on the caller's thread as each one finishes. An unexpected exception (a bug) cancels what has not started
    and is raised."""
    assert threads >= 1, threads
    results: list[Imported | AdapterError | OSError | None] = [None] * len(paths)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="adapter-import")
    try:
        futures: dict[Future, int] = {pool.submit(_outcome, Path(p), store, checks): i for i, p in enumerate(paths)}
        for f in as_completed(futures):
            results[futures[f]] = f.result()
            if done is not None:
                done()
    finally:  # on an error or an interrupt, the imports not started yet are dropped (each one in flight completes whole)
        pool.shutdown(wait=True, cancel_futures=True)
    return results  # type: ignore[return-value]  # every slot is filled once as_completed is through


def _outcome(path: Path, store: AdapterStore, checks: AdapterChecks) -> Imported | AdapterError | OSError:
    try:
        return import_adapter(path, store, checks)
    except (AdapterError, OSError) as e:
        return e
