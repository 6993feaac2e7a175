"""`lorabatch bench ...`: benchmarks are commands that print figures (tests never time things).

Each prints a short table, then one JSON line with the figures, so runs can be compared by machine.
The work lives in each package's bench/ subpackage (`engine.bench`, `kernels.bench`, `billing.bench`,
`consumer.bench`), imported here only inside the commands; these are only the command lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def bench_engine(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b (random weights built on the device)")] = "tiny",
    adapters: Annotated[int, typer.Option(help="distinct adapters in the mixed batch")] = 8,
    rank: Annotated[int, typer.Option(help="adapter rank")] = 16,
    batch: Annotated[int, typer.Option(help="requests in the batch")] = 8,
    prompt: Annotated[int, typer.Option(help="prompt tokens per request")] = 32,
    new: Annotated[int, typer.Option(help="new tokens per request (EOS ignored)")] = 16,
    mixed_ranks: Annotated[Optional[str], typer.Option(help="comma-separated ranks, e.g. 8,16,32,64, cycled over the adapters")] = None,
    peer: Annotated[bool, typer.Option("--peer", help="also run HF transformers + peft on the same model and batch")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """Decode and prefill speed of the engine, base-only and mixed-adapter, against the peer and the roofline."""
    from engine.bench.serving import bench_engine as run

    run(shape=shape, adapters=adapters, rank=rank, batch=batch, prompt=prompt, new=new, mixed_ranks=mixed_ranks,
        peer=peer, device=device, json_only=json_out)


def bench_kernels(
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """The Triton kernels against their torch references and the memory roofline."""
    from kernels.bench.roofline import bench_kernels as run

    run(json_only=json_out)


def bench_ledger(
    db: Annotated[str, typer.Option("--db", help="SQLAlchemy URL of a database the bench may fill")],
    rows: Annotated[int, typer.Option(help="usage rows to insert")] = 1_000_000,
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """Ledger insert rate, one tenant's invoice time, and the month's close time."""
    from billing.bench.ledger import bench_ledger as run
    from migrations import SCRIPT_LOCATION

    run(url=db, rows=rows, script_location=SCRIPT_LOCATION, json_only=json_out)


def bench_pipeline(
    jobs: Annotated[int, typer.Option(help="jobs to run through both paths")] = 400,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    shape: Annotated[str, typer.Option(help="tiny (the demo set unless --adapters), llama-1b or llama-8b (random weights)")] = "tiny",
    adapters: Annotated[Optional[int], typer.Option(help="distinct rank-16 adapters, written for the shape (default: the demo set's, or 8)")] = None,
    prompt_tokens: Annotated[Optional[int], typer.Option(help="prompt token ids per job (default: text prompts on the demo set, else 128)")] = None,
    new_tokens: Annotated[int, typer.Option(help="max_new_tokens of each job")] = 16,
    redis_url: Annotated[Optional[str], typer.Option(help="Redis for the routing caches (default: in-process LRU)")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="runs of each path, taking turns (the GPU's speed drifts between runs)")] = 1,
    profile: Annotated[Optional[Path], typer.Option(help="profile the engine's step loop in the last round's two runs; "
                                                    "stats written to this folder, the functions that grew printed")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """The same jobs through broker and worker against the engine alone: jobs/s and tokens/s, the GPU's idle share,
    p50/p99 of each worker stage."""
    from consumer.bench.pipeline import bench_pipeline as run

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    from engine.bench.build import SHAPES

    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: use one of {', '.join(sorted(SHAPES))}")
    run(jobs=jobs, redis_url=redis_url, json_only=json_out, device=device, shape=shape, adapters=adapters,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds,
        profile=profile)


def bench_scaleout(
    shape: Annotated[str, typer.Option(help="tiny or llama-1b (random weights written to a temp folder)")] = "tiny",
    workers: Annotated[int, typer.Option(help="worker processes in the group")] = 2,
    gpus: Annotated[Optional[str], typer.Option(help="comma-separated GPU ids, one per worker (CUDA_VISIBLE_DEVICES)")] = None,
    adapters: Annotated[int, typer.Option(help="adapters, zipf popularity")] = 64,
    rank: Annotated[int, typer.Option()] = 16,
    jobs: Annotated[int, typer.Option()] = 2000,
    new: Annotated[int, typer.Option(help="new tokens per job")] = 16,
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """Several workers in one group (one per GPU) against one worker: speed-up, adapter loads by partition key."""
    from consumer.bench.scaleout import bench_scaleout as run

    run(shape=shape, workers=workers, gpus=gpus, adapters=adapters, rank=rank, jobs=jobs, new_tokens=new, json_only=json_out)


def bench_registry(
    adapters: Annotated[int, typer.Option(help="demo-model adapters of ranks 4 to 64, registered in one call")] = 2000,
    tenants: Annotated[int, typer.Option(help="tenants registered; the manifest spreads the adapters over them")] = 300,
    form: Annotated[str, typer.Option(help="manifest (one line an adapter, tenants in turn) or dir (--dir, one tenant)")] = "manifest",
    db: Annotated[Optional[str], typer.Option("--db", help="SQLAlchemy URL of a database to work in a fresh schema of (default: a SQLite file)")] = None,
    lists: Annotated[int, typer.Option(help="runs of `tenants list` timed")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """`lorabatch adapters add` of many adapters in one call, the same call again (all unchanged), and `tenants list`
    with them registered: each command's process timed from start to exit."""
    from consumer.bench.registry import bench_registry as run
    from migrations import SCRIPT_LOCATION

    if form not in ("manifest", "dir"):
        raise typer.BadParameter(f"--form {form!r}: use manifest or dir")
    run(adapters=adapters, tenants=tenants, form=form, db_url=db, lists=lists, script_location=SCRIPT_LOCATION, json_only=json_out)


def bench_adapters(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b (random weights built on the device)")] = "llama-1b",
    counts: Annotated[str, typer.Option(help="distinct adapter counts, comma-separated; ratios are to the first")] = "5,100,1000,2000",
    ranks: Annotated[str, typer.Option(help="adapter ranks, comma-separated, cycled over the adapters")] = "8,16,32,64",
    targets: Annotated[str, typer.Option(help="target modules of every adapter, comma-separated")] = "q_proj,v_proj",
    requests: Annotated[int, typer.Option(help="requests per pass")] = 1024,
    batch: Annotated[int, typer.Option(help="requests running at once")] = 64,
    prompt: Annotated[int, typer.Option(help="prompt tokens per request")] = 128,
    new: Annotated[int, typer.Option(help="new tokens per request (EOS ignored)")] = 64,
    gpu_bytes: Annotated[Optional[int], typer.Option(help="adapter device budget in bytes (default: 64 max-rank slots' worth)")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda where there is one)")] = None,
    read_threads: Annotated[Optional[int], typer.Option(help="engine.adapter_read_threads: threads reading queued requests' adapters "
                                                        "ahead (default: what the engine derives, half the host's cores, at most 8)")] = None,
    read_processes: Annotated[Optional[int], typer.Option(help="engine.adapter_read_processes: reader processes doing those reads "
                                                          "(0: the threads; default as --read-threads)")] = None,
    timeline: Annotated[Optional[Path], typer.Option(help="a folder for each count's passes step by step (JSON); the cold pass's admissions are printed")] = None,
    gil_switch_ms: Annotated[float, typer.Option(min=0.001, max=1000.0, help="the interpreter's switch interval for the run, "
                                                 "in ms (default: the engine process's; Python's own is 5)")] = 50.0,
    pipelined: Annotated[bool, typer.Option(help="do not synchronise the device after each engine.step() call: a call's wall "
                                            "time is the interval between call returns, as a serving loop sees it")] = False,
    gc_in_rounds: Annotated[bool, typer.Option(help="engine.gc_in_rounds: the garbage collector's passes run while a decode "
                                               "round is in flight, full passes there first where rounds run as CUDA "
                                               "graphs, as in the engine process (--no-gc-in-rounds for an A/B)")] = True,
    load_ahead_share: Annotated[str, typer.Option(help="engine.load_ahead_share: placements ahead of admission stop at this share "
                                                  "of the launched work's device time; none: unbounded")] = "0.5",
    phases: Annotated[bool, typer.Option(help="time the engine's phases in each step() call and give each pass's slowest "
                                         "calls by phase in its row (slowest_calls_phases)")] = False,
) -> None:
    """Many adapters: tokens/s cold and host-warm per adapter count, loads by tier, load time against the copy floor."""
    from engine.bench.adapters import READ_PROCESSES, READ_THREADS, parse_share, run

    read_threads = READ_THREADS if read_threads is None else read_threads
    read_processes = READ_PROCESSES if read_processes is None else read_processes
    if read_threads < 0 or read_processes < 0:
        raise typer.BadParameter(f"--read-threads {read_threads} / --read-processes {read_processes}: use 0 or more")
    try:
        share = parse_share(load_ahead_share)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None

    run(shape, [int(c) for c in counts.split(",")], [int(r) for r in ranks.split(",")], requests, batch, prompt=prompt, new=new,
        targets=tuple(targets.split(",")), gpu_bytes=gpu_bytes, device=device, read_threads=read_threads,
        read_processes=read_processes, timeline=timeline, gil_switch_s=gil_switch_ms / 1000, synced=not pipelined,
        gc_in_rounds="held" if gc_in_rounds else "off", load_ahead_share=share, phases=phases)  # fmt: skip


def bench_mixed_steps(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b (random weights written to a temp folder)")] = "tiny",
    prompt_rows: Annotated[str, typer.Option(help="prompt rows of the measured steps, comma-separated, each at most --batch")] = "4,1",
    batch: Annotated[int, typer.Option(min=1, help="the engine's places: each measured step has them all filled")] = 4,
    prompt: Annotated[int, typer.Option(min=1, help="prompt tokens of each request")] = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """What a step that admits k prompts beside batch - k decode rows costs, with adapters and without: its device and
    wall µs, and a whole-batch decode step's (a probe of the engine's step costs, not a target's bench)."""
    from engine.bench.build import SHAPES
    from engine.bench.mixed_steps import main

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: use one of {', '.join(sorted(SHAPES))}")
    try:
        rows = [int(k) for k in prompt_rows.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--prompt-rows {prompt_rows!r}: use whole numbers separated by commas, e.g. 64,9,1") from None
    if not rows or any(not 0 < k <= batch for k in rows):
        raise typer.BadParameter(f"--prompt-rows {prompt_rows!r}: each must be from 1 to --batch ({batch})")
    main(["--shape", shape, "--prompt-rows", prompt_rows, "--batch", str(batch), "--prompt", str(prompt), "--device", device])


def bench_host_profile(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b (random weights built on the device)")] = "tiny",
    adapters: Annotated[int, typer.Option(min=1, help="adapters of --rank on all seven projections; the mixed run's rows take turns")] = 2,
    rank: Annotated[int, typer.Option(min=1)] = 8,
    batch: Annotated[int, typer.Option(min=1, help="requests decoding together")] = 4,
    prompt: Annotated[int, typer.Option(min=1, help="prompt tokens of each request")] = 8,
    new: Annotated[int, typer.Option(min=2, help="new tokens of each request: a prefill, then new - 1 decode steps")] = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """Where a decode step's host time goes: the decode phase in rounds of decode_steps and one step at a time, each
    under cProfile, their wall and device ms per step (a probe of the engine's host work, not a target's bench)."""
    from engine.bench.build import SHAPES
    from engine.bench.host_profile import main

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: use one of {', '.join(sorted(SHAPES))}")
    main(["--shape", shape, "--adapters", str(adapters), "--rank", str(rank), "--batch", str(batch), "--prompt", str(prompt),
          "--new", str(new), "--device", device])  # fmt: skip


def bench_reads(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b: the adapters' projection sizes")] = "llama-1b",
    ranks: Annotated[str, typer.Option(help="adapter ranks, comma-separated")] = "8,16,32,64",
    per_rank: Annotated[int, typer.Option(min=1, help="adapters written of each rank")] = 2,
    reps: Annotated[int, typer.Option(min=1, help="timed reads of each adapter, after one untimed")] = 5,
) -> None:
    """One store read on this host's CPU, as a reader process does it: the files, sha256 first or beside the validation,
    and the page layout, median ms by rank (a probe of the read path, not a target's bench)."""
    from engine.bench.build import SHAPES
    from engine.bench.reads import main

    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: use one of {', '.join(sorted(SHAPES))}")
    main(["--shape", shape, "--ranks", ranks, "--per-rank", str(per_rank), "--reps", str(reps)])


def bench_batch_sweep(
    shape: Annotated[str, typer.Option(help="tiny, llama-1b or llama-8b (random weights written to a temp folder)")] = "tiny",
    adapters: Annotated[int, typer.Option(min=1, help="rank-16 adapters on all seven projections; the jobs take turns")] = 2,
    jobs: Annotated[int, typer.Option(min=1, help="measured jobs, the same for every engine")] = 8,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="random prompt token ids per job")] = 8,
    new_tokens: Annotated[int, typer.Option(min=1, help="new tokens per job (EOS ignored)")] = 4,
    batch_sizes: Annotated[Optional[str], typer.Option(help="explicit max_batch_size values swept beside the derived default, "
                                                       "comma-separated (default 16,32,64,128,256 on cuda, 2,4,8 on cpu)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json", help="only the JSON line")] = False,
) -> None:
    """The default config (sizes derived from the device) against explicit batch sizes on the same jobs, the engine
    alone: tokens/s and jobs/s of each, ratio to the best, and whether the default reaches 0.90 of it."""
    from engine.bench.batch_sweep import parse_batch_sizes, run_sweep
    from engine.bench.build import SHAPES

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: use one of {', '.join(sorted(SHAPES))}")
    try:
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_sweep(shape=shape, adapters=adapters, jobs=jobs, prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch_sizes=sizes,
              device=device, json_only=json_out)  # fmt: skip


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Benchmarks: each prints a table, then one JSON line.", no_args_is_help=True)
    group.command("adapters")(bench_adapters)
    group.command("batch-sweep")(bench_batch_sweep)
    group.command("mixed-steps")(bench_mixed_steps)
    group.command("host-profile")(bench_host_profile)
    group.command("engine")(bench_engine)
    group.command("kernels")(bench_kernels)
    group.command("ledger")(bench_ledger)
    group.command("pipeline")(bench_pipeline)
    group.command("registry")(bench_registry)
    group.command("reads")(bench_reads)
    group.command("scaleout")(bench_scaleout)
    app.add_typer(group, name="bench")
