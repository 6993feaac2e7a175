"""Benchmarks of the ledger: `lorabatch bench ledger`.

Not part of the library: only the CLI's bench commands and tests import this package.
"""
