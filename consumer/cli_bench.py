"""`lorabatch bench ...`: benchmarks are commands that print figures (tests never time things)."""

from __future__ import annotations


import typer

bench_app = typer.Typer(help="Benchmarks: each prints a table, then one JSON line.", no_args_is_help=True)
