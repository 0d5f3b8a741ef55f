"""`kvmosaic bench workload`: the whole server under a RAG trace, every cost charged.

- `modes.py` — mode specs with settings (`cacheblend:selection=deviation,check_layers=1`).
- `trace.py` — the trace: read from JSON lines or generated (Zipf popularity + reformulated
  repeats), and its reuse statistics once retrieval has run.
- `corpus.py` — the corpus (a directory or a benchmark JSON), ingested once through the real
  ingest path into a snapshot that every run starts from.
- `load.py` — closed-loop clients or open-loop arrivals through the server's own work queue.
- `cell.py` — one mode at one load level: fresh copy of the snapshot, services, load, figures.
- `summary.py` — percentiles, work, tier hits and fidelity against `full` on the same request.
- `report.py` — the table, JSON and the markdown report with its plots.
- `workload.py` — the whole run.

It drives `app.services.Services` and `RagService`, exactly the
objects the HTTP server runs, without HTTP in between (see `workload.py`).
"""
