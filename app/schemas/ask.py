"""`POST /ask`: the question, and the answer with its per-chunk report, timings and usage."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from app.schemas.common import Ratio, Seed, Temperature, Text, TokenBudget, TopK, TopP

# The fidelity guard's levels (engine.config.FIDELITIES, spelled out for the OpenAPI schema).
Fidelity = Literal["fast", "balanced", "exact"]
FIDELITY_DOC = (
    "fast: the mode as is; balanced: a request whose first token is uncertain is prefilled "
    "again in full; exact: full prefill (default: the server's)"
)

PACKETS_DOC = (
    "read each chunk between the server's learned packets (KVMOSAIC_PACKETS): fidelity 'fast' "
    "and a mode that reads base variants only (GET /modes: packet_modes)"
)


APE_DOC = (
    "read the chunks by APE's attention (the question's and the answer's logits on the chunks "
    "divided by a temperature, their total attention scaled; GET /modes: ape): fidelity 'fast' "
    "and a mode that reads base variants only, not with packets or conditioned bases"
)


CONDITIONED_DOC = (
    "read each chunk's neighbour-conditioned base, its KV computed after the openings of its "
    "nearest chunks (KVMOSAIC_CONDITIONED_NEIGHBOURS), where one is stored: fidelity 'fast' and "
    "a mode that reads base variants only (GET /modes: conditioned)"
)


class AskRequest(BaseModel):
    """Defaults (top_k, mode, max_tokens, ratio) come from the server settings when omitted."""

    model_config = ConfigDict(extra="forbid")

    question: Text = Field(min_length=1, description="the question; its length limit is a setting")
    top_k: TopK | None = Field(default=None, description="chunks to retrieve (1-20)")
    mode: str | None = Field(default=None, description="recompute mode (see GET /modes)")
    ratio: Ratio | None = Field(default=None, description="cacheblend recompute ratio")
    fidelity: Fidelity | None = Field(default=None, description=FIDELITY_DOC)
    packets: StrictBool = Field(default=False, description=PACKETS_DOC)
    conditioned: StrictBool = Field(default=False, description=CONDITIONED_DOC)
    ape: StrictBool = Field(default=False, description=APE_DOC)
    max_tokens: TokenBudget | None = Field(
        default=None, description="answer token budget; its limit is a setting"
    )
    temperature: Temperature = Field(default=0.0, description="0 = greedy")
    top_p: TopP = 1.0
    seed: Seed | None = None
    stream: StrictBool = Field(default=False, description="Server-Sent Events: piece*, then report")
    explain: StrictBool = Field(
        default=False, description="add each chunk's tokens and recomputed offsets"
    )


class ChunkOut(BaseModel):
    chunk_id: int
    document_id: int
    document: str = Field(description="the document's title")
    source: str
    ordinal: int
    score: float = Field(description="cosine similarity to the question")
    text: str
    strategy: str = Field(
        description="how the chunk was handled: the mode's name, or cachecraft's "
        "reuse / partial / full / deviation / computed"
    )
    cfo: float | None = Field(
        default=None, description="cachecraft's Cache Fix Overhead for the chunk"
    )
    tokens: int
    reused: int = Field(description="tokens whose cached KV was kept")
    recomputed: int
    compute_share: float = Field(description="layer-rows computed / (tokens x layers)")
    cached: bool = Field(
        description="the chunk's KV came from the store (false: computed for this request, "
        "because it was not stored or its stored entry was corrupt)"
    )
    variant: str = Field(
        description="'base', 'conditioned base' or the context (chunk ids) the KV was computed "
        "under"
    )
    stopped_layer: int | None = Field(
        default=None, description="layer where recompute stopped early"
    )
    rank: int | None = Field(
        default=None,
        description="the chunk's place in retrieval order (0 = best match); "
        "the list is in prompt order",
    )
    exact: bool = Field(
        default=False,
        description="its KV came from a variant computed after exactly the "
        "chunks before it in this prompt (exact reuse, no blending)",
    )
    token_texts: list[str] | None = None
    recomputed_offsets: list[int] | None = None


class Timings(BaseModel):
    """Milliseconds. ttft = load + prefill: from after retrieval to the first token's logits."""

    retrieve_ms: float
    load_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    store_ms: float
    total_ms: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    context_tokens: int
    recomputed_tokens: int
    recompute_share: float


class GuardOut(BaseModel):
    """What the fidelity guard estimated and spent for the answer (engine/serving/guard.py)."""

    fidelity: Fidelity
    margin: float | None = Field(
        default=None,
        description="first token's log-probability margin over the "
        "runner-up (nats) in the mode's own prefill",
    )
    threshold: float | None = Field(
        default=None, description="margin below which balanced re-runs in full"
    )
    estimate: str = Field(
        default="",
        description="the guard's estimate against full prefill's own reorder floor, "
        "in words (docs/benchmarks/fidelity.md)",
    )
    escalated: bool = Field(description="the answer comes from a second, full prefill")
    spent_ms: float = Field(description="time of that second prefill, inside ttft_ms")
    repaired_at: int | None = Field(
        default=None,
        description="answer token where balanced switched to full "
        "prefill of the prompt and the answer so far, "
        "because that token's margin was below the "
        "answer threshold or the answer named there a number, date or name that no passage "
        "holds (null: it never did)",
    )
    repair_margin: float | None = Field(
        default=None,
        description="that token's margin (nats) in the mode's state (null for a grounding repair)",
    )
    repair_ms: float = Field(default=0.0, description="time of that prefill, after the first token")
    repair_reason: Literal["margin", "grounding"] | None = Field(
        default=None,
        description="why the answer was repaired: a low margin, or a span that no passage nor "
        "the question contains (KVMOSAIC_GUARD_GROUNDING; null: not repaired)",
    )
    repair_span: str | None = Field(
        default=None,
        description="for a grounding repair, the number, date or name that no passage holds; "
        "for a margin repair, the text the grounding check held back when the margin fell "
        "(the repair started there); never sent",
    )
    skipped_blend: bool = Field(
        default=False,
        description="the engine was busy and its recent blends were "
        "mostly repaired, so this request computed its "
        "context exactly after its exact prefix instead "
        "of blending (KVMOSAIC_GUARD_BUSY_REPAIR_SHARE)",
    )
    exact_first: bool = Field(
        default=False,
        description="no blend of this mode is measured to hold on the loaded model (its reuse "
        "profile, KVMOSAIC_REUSE_PROFILE), so this balanced request computed its context "
        "exactly after its exact prefix instead of blending",
    )


class OrderOut(BaseModel):
    """The prompt order of the chunks and how their context tokens were served \
(docs/chunk-order.md)."""

    rule: str = Field(
        description="'retrieval' (the retriever's order) or 'cache-aware' (the longest path "
        "of stored exact-context variants first, the rest by retrieval rank)"
    )
    planned_exact: int = Field(
        description="leading chunks on a stored exact path when the order was chosen"
    )
    exact_tokens: int = Field(description="context tokens served from exact-context KV")
    blended_tokens: int = Field(
        description="context tokens reused from KV of another context (fixed in part or not)"
    )
    computed_tokens: int = Field(description="context tokens computed through every layer")


class AskResponse(BaseModel):
    answer: str
    mode: str
    finish_reason: str = Field(
        description="'stop' (end of answer), 'length' (token budget) or 'cancelled'"
    )
    fallback_reason: str | None = None
    guard: GuardOut | None = None
    chunks: list[ChunkOut]
    timings: Timings
    usage: Usage
    order: OrderOut | None = None
    packets: bool = Field(
        default=False, description="the chunks were read between the server's learned packets"
    )
    conditioned: bool = Field(
        default=False,
        description="the request asked for conditioned bases (each chunk's `variant` says "
        "whether it had one stored)",
    )
    ape: bool = Field(default=False, description="the chunks were read by APE's attention")


class ConditioningOut(BaseModel):
    neighbours: int = Field(description="nearest chunks whose openings precede each base")
    lead_tokens: int = Field(description="first tokens of each neighbour")


class ApeOut(BaseModel):
    temperature: float = Field(description="T: the logits on the chunks are divided by it")
    scale: float = Field(description="S: the chunks' total attention is scaled by it")


class ModesResponse(BaseModel):
    modes: list[str] = Field(description="every mode the engine has registered")
    default: str
    top_k: int = Field(description="default number of chunks")
    max_tokens: int = Field(description="default answer token budget")
    fidelities: list[str] = Field(description="fidelity guard levels a request may name")
    fidelity: str = Field(description="default fidelity level")
    packets: str | None = Field(
        description="the digest of the learned packets a request may ask for (null: none)"
    )
    packet_modes: list[str] = Field(description="the modes a request with packets may name")
    conditioned: ConditioningOut | None = Field(
        default=None,
        description="how this server conditions bases, which a request may ask for with "
        "`conditioned: true` in one of `packet_modes` (null: it computes none)",
    )
    ape: ApeOut = Field(
        description="APE's knobs a request reads its chunks by with `ape: true` in one of "
        "`packet_modes`"
    )
