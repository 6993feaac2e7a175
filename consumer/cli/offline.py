"""Commands that run the engine in this process, no Kafka: `lorabatch make-demo-model` and `lorabatch generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, settings_from


def make_demo_model(out_dir: Path, seed: int = 0) -> None:
    """Write a tiny random-weight Llama (HF format) and 8 PEFT adapters of mixed ranks under OUT_DIR."""
    from engine.demo_model import write_demo_set

    paths = write_demo_set(out_dir, seed=seed)
    typer.echo(f"model: {out_dir / 'model'}")
    for name, p in paths.items():
        typer.echo(f"adapter {name}: {p}")


def generate(jobs: Annotated[Path, typer.Option("--jobs", help="JSONL of jobs (prompt or input_ids)")],
             model: Annotated[Optional[Path], typer.Option("--model", help="HF model folder")] = None,
             adapter: Annotated[Optional[list[str]], typer.Option("--adapter", help="NAME=DIR, repeatable")] = None,
             config: ConfigOpt = None) -> None:
    """Run a JSONL batch on the engine offline (no Kafka); one result line per job, in input order."""
    from consumer.files import FileUnfit
    from consumer.offline import run_offline

    s = settings_from(config, **({"engine.model_dir": str(model)} if model else {}))
    adapters = {}
    for spec in adapter or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            fail(f"--adapter {spec!r}: write it as NAME=DIR")
        adapters[name] = Path(path)
    try:
        for line in run_offline(s.engine, adapters, jobs):
            typer.echo(line)
    except (FileNotFoundError, FileUnfit) as e:
        fail(str(e))


def register(app: typer.Typer) -> None:
    app.command("make-demo-model")(make_demo_model)
    app.command("generate")(generate)
