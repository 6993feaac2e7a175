"""`lorabatch submit` and `lorabatch results`: a JSONL batch produced to Kafka, and its results collected."""

from __future__ import annotations

import errno
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, console, fail, progress_bar, settings_from

if TYPE_CHECKING:
    from consumer.config import Settings


def broker_failed(s: Settings, e: Exception, again: str = "run the command again") -> str:
    """The message for a broker that failed under a command: what failed, how to start one, what to rerun."""
    return (f"the broker at {s.kafka.bootstrap_servers} failed ({e}); start it with `lorabatch broker start` "
            f"or set kafka.bootstrap_servers to a running one, then {again}")


PARTITION_KEYS = ("tenant", "adapter", "adapter-balanced", "request")


def submit(file: Path, tenant: Annotated[str, typer.Option(help="tenant the jobs belong to")],
           batch_id: Annotated[Optional[str], typer.Option("--batch-id")] = None,
           key: Annotated[Optional[str], typer.Option(help="partition key: tenant, adapter, adapter-balanced or request")] = None,
           config: ConfigOpt = None) -> None:
    """Produce jobs from a native or OpenAI Batch API JSONL file."""
    import asyncio

    from aiokafka.errors import KafkaError

    from rich.markup import escape

    from consumer.batch_file import SubmitError, check_ids, read_lines
    from consumer.submit import new_batch_id, produce_lines, read_manifest

    if key is not None and key not in PARTITION_KEYS:
        fail(f"--key {key!r}: use {', '.join(PARTITION_KEYS)}")
    s = settings_from(config, **({"kafka.partition_key": key} if key else {}))
    bid = batch_id or new_batch_id()
    try:
        check_ids(tenant, bid)
    except SubmitError as e:
        fail(str(e))
    seen = {"good": 0, "rejected": 0, "sent": 0}
    try:
        size = file.stat().st_size or None  # a pipe has none: the bar then counts bytes without a total
    except OSError as e:
        fail(f"cannot read {file}: {e}")
    submitted = None
    if batch_id is not None:  # what this batch id holds already: a line whose id it holds for another job is refused
        try:
            submitted = asyncio.run(read_manifest(s.kafka, tenant, bid))
        except KafkaError as e:
            fail(broker_failed(s, e, f"submit again with --batch-id {bid}"))

    def shown(lines):
        """The lines as read: each bad one printed, the bar moved on by its bytes."""
        for line in lines:
            if line.error is not None:
                seen["rejected"] += 1
                console.print(f"[yellow]rejected[/yellow] {escape(str(file))}: {escape(line.error)}", highlight=False, soft_wrap=True)
            elif line.job is not None:
                seen["good"] += 1
            bar.update(task, advance=line.size, rejected=seen["rejected"])
            yield line

    def sent(n: int) -> None:
        seen["sent"] = n
        bar.update(task, sent=n)

    with progress_bar(unit="bytes") as bar:
        task = bar.add_task(f"submitting {file.name}", total=size, sent=0, rejected=0)
        try:
            asyncio.run(produce_lines(s.kafka, shown(read_lines(file, tenant, bid, max_message_bytes=s.kafka.max_message_bytes,
                                                                key_by=s.kafka.partition_key, submitted=submitted)),
                                      bid, tenant, str(file), s.kafka.partition_key, sent=sent))
        except SubmitError as e:
            fail(str(e) + (f"; the {seen['sent']} jobs produced before it are kept: submit again with --batch-id {bid}" if seen["sent"] else ""))
        except KafkaError as e:
            # The same batch id gives the same request ids, so jobs already produced are not run twice.
            fail(broker_failed(s, e, f"submit again with --batch-id {bid}"))
        except KeyboardInterrupt:
            fail(f"interrupted with at least {seen['sent']} jobs of batch {bid} produced; submit the file again with --batch-id {bid} "
                 f"for the rest (the jobs produced are not run twice)", 130)
    if not seen["good"] and not seen["rejected"]:
        fail(f"{file} holds no job: it is empty, or its lines are blank; write one job (a JSON object) a line")
    typer.echo(json.dumps({"batch_id": bid, "submitted": seen["sent"], "rejected": seen["rejected"]}))
    if seen["rejected"]:
        raise typer.Exit(1)


def results(batch_id: Annotated[str, typer.Option("--batch-id")],
            tenant: Annotated[str, typer.Option(help="tenant the batch was submitted for")],
            output: Annotated[Optional[Path], typer.Option("-o", "--output", help="write JSONL here instead of stdout")] = None,
            fmt: Annotated[str, typer.Option("--format", help="native or openai")] = "native",
            timeout: Annotated[float, typer.Option(help="seconds to wait for the batch to complete")] = 600.0,
            config: ConfigOpt = None) -> None:
    """Collect a tenant's batch's results until every job has one, as JSONL in submission order."""
    import asyncio
    import math
    import sys

    from aiokafka.errors import KafkaError

    from consumer.batch_file import SubmitError, check_ids
    from consumer.billed import LEDGER_WAIT_S, prefer_billed
    from consumer.openai_batch import created_of, to_openai_dlq_line, to_openai_line
    from consumer.submit import collect_results, manifest_from_jobs, read_manifest

    try:
        check_ids(tenant, batch_id)  # an id no job can carry: said now, not after reading the whole jobs topic for it
    except SubmitError as e:
        fail(str(e))
    if fmt not in ("native", "openai"):
        fail(f"--format {fmt!r}: use native or openai")
    if not math.isfinite(timeout) or timeout < 0:
        fail(f"--timeout {timeout}: give the seconds to wait for the batch, 0 or more")
    stream = writable(output) if output is not None else None  # before the wait, not after it
    s = settings_from(config)
    try:
        # No manifest: the batch's jobs were produced by another client; the jobs topic says which they are.
        manifest = (asyncio.run(read_manifest(s.kafka, tenant, batch_id))
                    or asyncio.run(manifest_from_jobs(s.kafka, tenant, batch_id, timeout_s=max(60.0, timeout))))
    except KafkaError as e:
        fail(broker_failed(s, e))
    if manifest is None:
        fail(f"no batch {batch_id!r} of tenant {tenant!r} was submitted to {s.kafka.bootstrap_servers}: no manifest, "
             f"and no job in {s.kafka.jobs_topic} has that tenant_id and batch_id; check the id and the --tenant")
    collected = [0]
    contested: set[str] = set()  # request ids whose results topic holds two different copies (two runs at once)

    def advance(n: int) -> None:
        collected[0] += n
        bar.advance(task, n)

    with progress_bar() as bar:
        task = bar.add_task(f"batch {tenant}/{batch_id}", total=len(manifest.request_ids))
        try:
            got, dlq = asyncio.run(collect_results(s.kafka, manifest, timeout, progress=advance, contested=contested))
        except KafkaError as e:
            fail(broker_failed(s, e))
        except KeyboardInterrupt:
            fail(f"interrupted with {collected[0]} of {len(manifest.request_ids)} results collected; nothing was written; "
                 f"the results stay on {s.kafka.results_topic}: run the same command again to collect them", 130)
    # The copy the ledger billed, where it is another than the first published (consumer.billed).
    billed = prefer_billed(s, tenant, got, contested, wait_s=min(LEDGER_WAIT_S, timeout))
    created = created_of(manifest)
    written = 0
    if stream is not None:
        sink = open(stream, "w", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    try:
        with (sink if stream is not None else replacing(output) if output is not None else nullcontext(sys.stdout)) as out:
            for rid in manifest.request_ids:
                asked = manifest.openai.get(rid)
                if rid in got:
                    line = to_openai_line(got[rid], asked, created) if fmt == "openai" else got[rid].model_dump(mode="json")
                elif rid in dlq:
                    line = (to_openai_dlq_line(rid, asked, dlq[rid].error) if fmt == "openai"
                            else {"request_id": rid, "status": "dlq", "error": dlq[rid].error.model_dump()})
                else:
                    continue
                out.write(json.dumps(line) + "\n")
                written += 1
    except OSError as e:  # as `report -o` says it: it was "[Errno 28] ...; check the path and its permissions"
        if output is None:
            raise
        kept = "" if stream is not None else " (the file there is as it was)"
        fail(f"cannot write -o {output}: {e.strerror or e}; the results were not written whole{kept}: free space there, or "
             f"give another path, and run the command again (the results stay on {s.kafka.results_topic})")
    missing = len(manifest.request_ids) - written
    unfinished = manifest.complete is False  # its last `submit` has not closed it
    if billed.replaced:
        console.print(f"{len(billed.replaced)} results written as the ledger billed them (e.g. {billed.replaced[0]!r}): "
                      f"each request ran on two workers at once, and the first copy on {s.kafka.results_topic} was "
                      f"the run not billed", highlight=False, soft_wrap=True, markup=False)
    unsettled = (f"; {len(billed.unsettled)} requests (e.g. {billed.unsettled[0]!r}) have two different results on "
                 f"{s.kafka.results_topic} (they ran on two workers at once) and the ledger could not say which it billed "
                 f"({billed.why}): the file holds the first published; make ledger.url reachable from here (or wait for "
                 f"the workers' spooled rows) and run the command again" if billed.unsettled else "")
    if missing:
        fail(f"{missing} of {len(manifest.request_ids)} jobs have no result after {timeout:.0f}s; is a worker running? "
             f"(the file holds the {written} that have one; run the command again, with a longer --timeout, for the rest)"
             + (f"; {_UNFINISHED.format(batch_id=batch_id)}" if unfinished else "") + unsettled, 1)
    if unfinished:
        fail(f"the file holds the results of the {written} jobs produced so far, but {_UNFINISHED.format(batch_id=batch_id)}"
             + unsettled, 1)
    if unsettled:
        fail(f"the file holds the results of all {written} jobs{unsettled}", 1)


_UNFINISHED = ("the batch's submission has not finished (`lorabatch submit` is still producing it, or was cut short): "
               "once it has, or once the file is submitted again with --batch-id {batch_id}, run this command again for the rest")


@contextmanager
def replacing(path: Path):
    """`path` (a link's target) opened to be written whole: written beside it and moved over it once complete, so a
    write that fails (a full disk, an error) leaves the file there before as it was, never cut short. A stream (a device,
    a FIFO) was opened by `writable`; one put there since is replaced as a file would be, never opened."""
    import os
    import stat

    real = Path(os.path.realpath(path))
    try:
        mode = real.stat().st_mode
    except FileNotFoundError:
        mode = None
    part = real.with_name(f".{real.name}.{os.getpid()}.part")
    try:
        with part.open("w", encoding="utf-8") as out:
            yield out
        if mode is not None and stat.S_ISREG(mode):
            os.chmod(part, stat.S_IMODE(mode))
        os.replace(part, real)
    finally:
        part.unlink(missing_ok=True)


def writable(path: Path) -> int | None:
    """End the command naming `path` when it cannot be written (a folder that does not exist, no permission, a folder,
    a block device, a FIFO with no reader), before anything is waited for. Returns None for a file (written beside and
    moved over it, `replacing`), or a descriptor open on a stream to write the results to (a character device such as
    `/dev/stdout`, a FIFO with its reader, `>(gzip > out.gz)`), kept open: closed now, it would end a FIFO reader's input.

    Nothing is opened in a way that waits: a FIFO is opened without waiting (O_NONBLOCK fails with ENXIO while it has no
    reader; the check's plain open blocked for ever), and the probe of a file checks what it opened (a FIFO swapped in)."""
    import fcntl
    import os
    import stat

    from consumer.files import file_kind

    def cannot(e: OSError) -> None:
        fail(f"cannot write -o {path}: {e.strerror or e}; give a file in a folder that exists and that you may write to")

    def refuse(mode: int, why: str = "") -> None:
        fail(f"cannot write -o {path}: it is a {file_kind(mode)}{why}; give a file path, a FIFO whose reader is running, "
             "or leave -o out to write to stdout")

    try:
        mode = path.stat().st_mode  # a link's target
    except FileNotFoundError:
        mode = None
    except OSError as e:
        cannot(e)
    if mode is not None and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ENXIO:
                refuse(mode, " with no reader (start its reader first)")
            cannot(e)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # the writes wait for the reader
        return fd
    if mode is not None and not stat.S_ISREG(mode):
        refuse(mode)
    existed = mode is not None or path.is_symlink()  # a link to a file yet to be written is the user's: kept
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO with no reader, swapped in since the look above
            refuse(stat.S_IFIFO, " with no reader (start its reader first)")
        cannot(e)
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        refuse(mode)
    if not existed:
        path.unlink(missing_ok=True)
    return None


def register(app: typer.Typer) -> None:
    app.command("submit")(submit)
    app.command("results")(results)
