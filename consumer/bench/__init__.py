"""Benchmarks of the Kafka side: `lorabatch bench pipeline` and `lorabatch bench scaleout`.

Not part of the library: only the CLI's bench commands and tests import this package.
"""
