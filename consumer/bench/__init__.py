"""Benchmarks of the Kafka side and the registry: `lorabatch bench pipeline`, `bench scaleout` and `bench registry`.

Not part of the library: only the CLI's bench commands and tests import this package.
"""
