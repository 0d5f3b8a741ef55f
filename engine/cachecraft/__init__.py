"""Cache-Craft (arXiv 2502.15734): the formulas and measurements behind its variant choice.

- `scores`: the pure formulas (CCI, β, γ, β′, CFO, token choice);
- `stats`: attention statistics of a chunk computed in some context (`ChunkStats`);
- `choice`: the variant cheapest to fix for a request's context (CFO against the blend fix).

Building, keeping and choosing variants is the one policy of every mode, in `app/variants/`
(exact variants built from a finished request: `variants/build.py`).
"""
