"""`prefix`: reuse only an exact cached prefix, like automatic prefix caching in vLLM.

The system prefix is always exact. A leading chunk extends the exact prefix when its cached
KV was computed at the same position after exactly the same chunks (for the base variant:
the first chunk, computed alone after the system prefix). Everything after is computed.
A prefix read back through a lossy store codec is reused all the same (as vLLM reuses an
fp8 KV cache), but the state is then not exact: the fidelity guard judges such a request
(`engine.kv.exact_context`), where over float KV it has nothing to check.

Like vLLM's automatic prefix caching, what a request computes is kept: every chunk computed
here is exact in its context, so the request leaves it as an exact-context variant at no
extra compute (`VariantYield.HARVEST`), and the same prompt again reuses all of it.
"""

import torch

from engine.kv import ChunkId, KVSource
from engine.plan import CachedSpan, Plan, PlanRequest
from engine.planners.base import BasePlanner, VariantUse, VariantYield
from engine.planners.registry import register


@register
class PrefixPlanner(BasePlanner):
    name = "prefix"
    variant_use = VariantUse.EXACT
    leaves = VariantYield.HARVEST
    exact_reuse = True

    def plan(self, request: PlanRequest) -> Plan:
        spans = [CachedSpan(0, request.prefix)]
        before: list[ChunkId] = []
        for chunk, (start, _) in zip(request.chunks, request.layout.chunk_spans):
            kv = chunk.kv
            if kv is None or not _is_exact(kv, start, tuple(before)):
                break
            spans.append(CachedSpan(start, kv))
            before.append(chunk.chunk_id)
        first_computed = spans[-1].end
        total = request.layout.total_len
        pinned = torch.zeros(total, dtype=torch.bool)
        pinned[first_computed:] = True
        return Plan(
            cached_spans=spans, initial_active=torch.arange(first_computed, total), pinned=pinned
        )


def _is_exact(kv: KVSource, start: int, before: tuple[ChunkId, ...]) -> bool:
    return kv.base_position == start and tuple(kv.context) == before
