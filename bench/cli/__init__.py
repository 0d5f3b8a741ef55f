"""The benchmarks' commands: `bench.py` registers `kvmosaic bench ...`, `calibrate.py`
`kvmosaic calibrate` (both as `kvmosaic.commands` entry points)."""
