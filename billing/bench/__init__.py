"""Benchmarks of the ledger: `lorabatch bench ledger`; the scratch database a bench fills (`scratch`, the registry bench's too).

Not part of the library: only the CLI's bench commands and tests import this package.
"""
