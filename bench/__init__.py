"""Every benchmark of kvmosaic, and its commands (`kvmosaic bench ...`, `kvmosaic calibrate`).

Benchmarks print ratios measured in one run. The product (`app/`, `engine/`, `retrieval/`)
imports nothing from here; the commands plug into `kvmosaic` through the `kvmosaic.commands`
entry points of pyproject.toml.

- `fidelity/` — modes against full prefill on the same prompts (`bench fidelity`,
  `fidelity-merge`), its metrics, accuracy intervals, cases, FLOPs; codecs against the yardstick;
  the guard's signals; Cache-Craft's α (`calibrate`).
- `workload/` — the whole server under a RAG trace, every cost charged (`bench workload`,
  `bench ingest`).
- `store/` — KV store tiers against raw I/O, load/compute overlap, capacity (`bench store`).
- `compute/` — the model's kernels: CUDA kernels against their twins (`bench kernels`), linear
  kernels, continuous batching.
- `retrieval.py` — recall and latency of the vector index (`bench retrieval`).
- `cli/` — the command-line front of all of them.
"""
