"""`lorabatch adapters ...`: LoRA adapters in the registry (stored by content, one or many a call: consumer.bulk_adapters)
and their traffic split."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from consumer.cli.common import ConfigOpt, console, fail, one_line, open_services, print_table, progress_bar, settings_from

if TYPE_CHECKING:
    from consumer.bulk_adapters import Done


def add(
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="the adapter's name, for the single form NAME DIR", show_default=False)] = None,
    directory: Annotated[Optional[Path], typer.Argument(metavar="DIR", help="its PEFT folder", show_default=False)] = None,
    tenant: Annotated[Optional[str], typer.Option(help="owner tenant (a manifest line may name its own)")] = None,
    dirs: Annotated[Optional[list[Path]], typer.Option("--dir", help="a folder of adapter folders, each registered under its folder's name")] = None,
    globs: Annotated[Optional[list[str]], typer.Option("--glob", help="a quoted pattern of adapter folders, e.g. 'adapters/*-r16', each under its folder's name")] = None,
    manifests: Annotated[Optional[list[Path]], typer.Option("--manifest", help="a JSON lines file: {\"name\", \"path\", optional \"tenant\", \"default\", \"public\", \"canary\"} a line")] = None,
    default: Annotated[bool, typer.Option("--default", help="the tenant's default adapter (single form)")] = False,
    public: Annotated[bool, typer.Option("--public", help="usable by every tenant")] = False,
    canary: Annotated[Optional[int], typer.Option(help="a new version takes only this percentage of the traffic")] = None,
    threads: Annotated[Optional[int], typer.Option(help="threads checking and storing adapters (default: two a core, at most 16)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the failures and the summary")] = False,
    config: ConfigOpt = None,
) -> None:
    """Store PEFT adapter folders by content and register them for a tenant: NAME DIR, or many at once with --dir, --glob
    and --manifest (each repeatable). Each is checked as the engine loads it (against engine.model_dir's base); a failing
    one is reported by path and the rest go on; the exit status is 1 if any failed."""
    from consumer import bulk_adapters as bulk
    from consumer.registry import canary_problem
    from engine.adapter_import import AdapterChecks, default_threads

    sources = [*(dirs or []), *(globs or []), *(manifests or [])]
    if name is not None and directory is None:
        fail(f"give the adapter's folder after its name: `lorabatch adapters add --tenant T {name} DIR`")
    if name is None and not sources:
        fail("name the adapters: NAME DIR, or --dir ROOT, --glob 'PATTERN' or --manifest FILE")
    if tenant is None and (name is not None or dirs or globs):
        fail("give the owner tenant with --tenant T (only manifest lines can name their own)")
    if default and sources:
        fail("--default marks one adapter: with --dir, --glob or --manifest, mark its manifest line \"default\": true")
    if (problem := canary_problem(canary)) is not None:
        fail(f"--canary: {problem}")
    if threads is not None and threads < 1:
        fail(f"--threads {threads}: give 1 or more")
    s = settings_from(config)
    svc = open_services(s)
    if tenant is not None and not svc.registry.existing_tenants([tenant]):
        fail(f"tenant {tenant!r} does not exist; add it with `lorabatch tenants add {tenant}`")
    flags = bulk.Flags(tenant, public, canary)
    try:
        entries = bulk.from_folder(name, directory, flags, default=default) if name is not None else []
        for d in dirs or []:
            entries += bulk.from_dir(d, flags)
        for g in globs or []:
            entries += bulk.from_glob(g, flags)
        for m in manifests or []:
            entries += bulk.from_manifest(m, flags)
    except bulk.BulkError as e:
        fail(str(e))
    checks = AdapterChecks.for_model_dir(Path(s.engine.model_dir), s.engine.max_lora_rank)
    if checks.model is None:
        console.print(f"[yellow]warning:[/yellow] engine.model_dir {escape(s.engine.model_dir)} holds no config.json: "
                      "adapters are checked without the base model (its shapes and fingerprint); set engine.model_dir "
                      "to the model the workers serve", highlight=False, soft_wrap=True)  # fmt: skip
    entries = bulk.refuse_early(entries, svc.registry)
    if not sources:  # the single form: today's one line, or one error line and status 2
        (result,) = bulk.register_all(svc.registry, entries, checks, threads=1)
        if isinstance(result, bulk.Failure):
            fail(result.reason if result.origin in result.reason else f"{result.origin}: {result.reason}")
        typer.echo(_done_line(result))
        return
    with progress_bar() as bar:
        checking = bar.add_task("checking and storing", total=sum(isinstance(e, bulk.Item) for e in entries))
        registering = bar.add_task("registering", total=0, start=False)  # its total: those that pass their checks

        def on_registered(n: int, total: int) -> None:
            bar.start_task(registering)
            bar.update(registering, advance=n, total=total)

        results = bulk.register_all(svc.registry, entries, checks, threads=threads or default_threads(),
                                    checked=lambda: bar.advance(checking), registered=on_registered)  # fmt: skip
    failed = [r for r in results if isinstance(r, bulk.Failure)]
    for r in results:
        if isinstance(r, bulk.Done) and not quiet:
            typer.echo(_done_line(r))
    for f in failed:
        console.print(f"[red]failed:[/red] {escape(one_line(f'{f.origin}: {f.reason}'))}", highlight=False, soft_wrap=True)
    created = sum(isinstance(r, bulk.Done) and r.created for r in results)
    typer.echo(f"{len(results)} adapters: {created} registered, {len(results) - created - len(failed)} unchanged, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)


def _done_line(done: Done) -> str:
    a = done.view
    what = "registered" if done.created else "unchanged (same content)"
    return f"adapter {a.tenant_id}/{a.adapter} {what}: rank {a.rank}, {', '.join(a.target_modules)}, sha256 {a.sha256[:12]}"


TRAFFIC_PAIR_RE = re.compile(r"(?P<version>[0-9]+)=(?P<weight>[0-9]+)")


def traffic(name: str, weights: Annotated[list[str], typer.Argument(help="VERSION=WEIGHT pairs, e.g. 1=90 2=10")],
            tenant: Annotated[str, typer.Option(help="owner tenant")], config: ConfigOpt = None) -> None:
    """Split an adapter name's traffic among its versions (canary, promote, roll back)."""
    from consumer.registry import WEIGHT_MAX, RegistryError

    parsed: dict[int, int] = {}
    for w in weights:
        pair = TRAFFIC_PAIR_RE.fullmatch(w)  # ASCII digits: str.isdigit() passed '²', which int() refused with a traceback
        if pair is None:
            fail(f"{w!r}: write VERSION=WEIGHT, e.g. 2=10")
        # before int(), which raised ValueError (a traceback) past 4,300 digits; 12 digits are past either limit
        for part, limit in (("version", "a version has at most 9 digits"), ("weight", f"give weights from 0 to {WEIGHT_MAX}")):
            if len(digits := pair[part].lstrip("0")) > 12:
                fail(f"{part} {digits[:20]}... has {len(digits)} digits; {limit}")
        version, weight = int(pair["version"]), int(pair["weight"])
        if version in parsed:  # the last pair won in silence: 1=90 1=0 2=10 sent all the traffic to version 2
            fail(f"version {version} is given twice ({version}={parsed[version]} and {w}); give each version once")
        parsed[version] = weight
    svc = open_services(settings_from(config))
    try:
        views = svc.registry.set_traffic(tenant, name, parsed)
    except RegistryError as e:
        fail(str(e))
    total = sum(v.traffic_weight for v in views)
    typer.echo(", ".join(f"{v.adapter}: {100 * v.traffic_weight / total:.0f}%" for v in views))


def list_(config: ConfigOpt = None, tenant: Optional[str] = None) -> None:
    """List the registered adapters."""
    from rich.table import Table

    svc = open_services(settings_from(config))
    table = Table("tenant", "adapter", "rank", "targets", "public", "default", "traffic", "sha256")
    for a in svc.registry.list_adapters(tenant):
        table.add_row(a.tenant_id, a.adapter, str(a.rank), ",".join(a.target_modules), "yes" if a.is_public else "",
                      "yes" if a.is_default else "", str(a.traffic_weight), a.sha256[:12])
    print_table(table)


def prune(
    grace: Annotated[float, typer.Option(help="keep what was written or put again within this many hours (a registration under way)", min=0)] = 1.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list what would be removed, remove nothing")] = False,
    config: ConfigOpt = None,
) -> None:
    """Remove adapter content no registered adapter names (left by a registration that failed after storing it) and
    unfinished writes from the store, once older than --grace."""
    svc = open_services(settings_from(config))
    gone = svc.registry.prune_store(grace * 3600, dry_run=dry_run)
    for e in gone:
        typer.echo(f"{'would remove' if dry_run else 'removed'} {e.name}{' (unfinished write)' if e.unfinished else ''}: {e.nbytes:,} bytes")
    total = sum(e.nbytes for e in gone)
    typer.echo(f"{len(gone)} store entries, {total:,} bytes {'to remove' if dry_run else 'removed'}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="LoRA adapters in the registry.", no_args_is_help=True)
    group.command("add")(add)
    group.command("traffic")(traffic)
    group.command("list")(list_)
    group.command("prune")(prune)
    app.add_typer(group, name="adapters")
