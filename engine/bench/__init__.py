"""Benchmarks and profiles of the engine: `lorabatch bench engine` (serving), issue 4's suite, step profiles.

Not part of the library: only the CLI's bench commands and tests import this package.
"""
