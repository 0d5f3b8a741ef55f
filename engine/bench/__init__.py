"""Benchmarks run from the CLI (`kvmosaic bench ...`); they print ratios measured in one run."""
