"""Benchmarks of the Triton kernels: `lorabatch bench kernels` and config sweeps (roofline), one-off probes.

Not part of the library: only the CLI's bench commands and tests import this package.
"""
