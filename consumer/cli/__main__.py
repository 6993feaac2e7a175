"""`python -m consumer.cli ...`, as `lorabatch ...` (the demo and benches start workers this way)."""

from consumer.cli import main

main()
