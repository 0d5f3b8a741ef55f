"""The request path of one question: retrieve → order → plan → load → run layers → decode → store
variants.

`RagService.ask` is the whole sequence in one function; everything it calls lives in
`retrieval/` (search), the catalog (chunk rows), the chunk cache (KV from the store, new
variants back into it) and the engine (plan + layer-by-layer prefill, decode). It runs on a
worker thread of the work queue, never on the event loop, and knows nothing about HTTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace

from app.catalog import Catalog
from app.kvcache.chunk_cache import ServiceChunkCache
from app.kvcache.order import OrderedChunks
from app.queue import raise_if_abandoned
from app.retrieve import Retrieved, retrieve_chunks
from app.settings import Settings
from app.variants.order import ChunkOrder
from app.variants.served import ServedTokens
from engine.config import Fidelity
from engine.decoding import Decoded
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.model.decode import SamplingParams
from engine.planners import Mode, base_reader_names
from engine.result import PrefillResult
from retrieval import Retriever
from retrieval.text import text_problem

OnPiece = Callable[[str], None]


@dataclass(frozen=True)
class Query:
    """A validated question (see `RagService.query`): its settings resolved from their names
    here, once, and passed down as typed values."""

    question: str
    top_k: int
    mode: Mode
    ratio: float | None
    sampling: SamplingParams
    fidelity: Fidelity  # the fidelity guard's level (engine/serving/guard.py)
    order: ChunkOrder  # the chunk order rule (KVMOSAIC_CHUNK_ORDER, app/kvcache/order.py)
    packets: bool = False  # chunks read between the engine's learned packets (`with_packets`)
    conditioned: bool = False  # chunks read from their conditioned bases (`with_conditioned`)
    ape: bool = False  # the question and the answer read the chunks by APE (`with_ape`)


@dataclass(frozen=True)
class Answer:
    """What `ask` produced: the text, why it ended, the chunks (in prompt order), the prefill and
    the decode's record, per-stage seconds, the order they were given and how their tokens were
    served."""

    text: str
    finish_reason: str
    retrieved: list[Retrieved]
    result: PrefillResult
    decoded: Decoded
    variants: list[str]
    stages: dict[str, float] = field(default_factory=dict)
    order: OrderedChunks | None = None
    served: ServedTokens = field(default_factory=ServedTokens)
    packets: bool = False  # its chunks were read between learned packets
    conditioned: bool = False  # it asked for its chunks' neighbour-conditioned bases
    ape: bool = False  # its chunks were read by APE's attention


class StageClock:
    """Seconds per named stage; `total` runs from construction."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stages: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - start

    def finish(self) -> dict[str, float]:
        return {**self.stages, "total": time.perf_counter() - self.started}


class RagService:
    """Answers questions; thread-safe (each call has its own prefill result and pins)."""

    def __init__(
        self,
        engine: Engine,
        retriever: Retriever,
        catalog: Catalog,
        chunk_cache: ServiceChunkCache,
        settings: Settings,
        observe: Callable[[Answer], None] | None = None,
    ):
        self.engine = engine
        self.retriever = retriever
        self.catalog = catalog
        self.chunk_cache = chunk_cache
        self.settings = settings
        self.observe = observe  # called with each Answer (metrics, running stats)

    def ask(
        self, query: Query, on_piece: OnPiece | None = None, cancel: threading.Event | None = None
    ) -> Answer:
        """Answer one question; pieces go to `on_piece` as they are decoded.

        `cancel` set (the client went away): Abandoned before the prefill, or the answer so
        far with finish reason `cancelled` once decoding has begun."""
        clock = StageClock()
        with clock("retrieve"):
            retrieved = retrieve_chunks(
                self.retriever, self.catalog, self.engine, query.question, query.top_k
            )
        if query.packets:  # the chunks the prompt reads: each between the packets
            retrieved = [replace(r, token_ids=self.engine.packeted(r.token_ids)) for r in retrieved]
        # a client gone while it waited or retrieved: no prefill
        raise_if_abandoned(cancel, "prefill")
        # order: the prompt's chunk order; plan: each chunk's variant; load: pin its KV
        with clock("load"):
            ordered = self.chunk_cache.order(retrieved, query.mode, query.order)
            conditioning = self.settings.conditioning() if query.conditioned else None
            loaded = self.chunk_cache.load(ordered.retrieved, query.mode, conditioning)
        try:
            with clock("prefill"):  # run layers: reuse cached rows, recompute the selected ones
                result = self.engine.prefill(
                    loaded.inputs,
                    query.question,
                    query.mode,
                    query.fidelity,
                    ratio=query.ratio,
                    max_new_tokens=query.sampling.max_new_tokens,
                    ape=query.ape,
                )
        finally:
            loaded.release()  # the chunks' KV now lives in the request's cache: unpin it
        with clock("decode"):
            text, finish, decoded = self.decode(result, query.sampling, on_piece, cancel)
        with clock("store"):  # the KV this context produced becomes new variants
            self.chunk_cache.store_variants(loaded, result, decoded)
        answer = Answer(
            text,
            finish,
            ordered.retrieved,
            result,
            decoded,
            loaded.variant_labels,
            clock.finish(),
            ordered,
            self.chunk_cache.served(loaded, result),
            query.packets,
            query.conditioned,
            query.ape,
        )
        if self.observe is not None:
            self.observe(answer)
        return answer

    def decode(
        self,
        result: PrefillResult,
        sampling: SamplingParams,
        on_piece: OnPiece | None,
        cancel: threading.Event | None,
    ) -> tuple[str, str, Decoded]:
        """Stream the answer; returns (text, finish reason: stop, length or cancelled, the
        decode's record)."""
        pieces = []
        finish = "stop"
        # closing early cancels decoding
        with closing(self.engine.generate(result, sampling)) as stream:
            for piece in stream:
                pieces.append(piece)
                if on_piece is not None:
                    on_piece(piece)
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        decoded = stream.decoded()
        if finish != "cancelled" and len(decoded.token_ids) >= sampling.max_new_tokens:
            finish = "length"
        return "".join(pieces), finish, decoded

    def query(
        self,
        question: str,
        *,
        top_k: int | None = None,
        mode: str | None = None,
        ratio: float | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        fidelity: str | None = None,
        order: str | None = None,
        packets: bool = False,
        conditioned: bool = False,
        ape: bool = False,
    ) -> Query:
        """Validate a question against the settings; raises InvalidRequest with a clear message.
        `packets`: read the chunks between the engine's learned packets (`with_packets`);
        `conditioned`: read their neighbour-conditioned bases (`with_conditioned`); `ape`: read
        them by APE's attention (`with_ape`)."""
        s = self.settings
        question = question.strip()
        if not question:
            raise InvalidRequest("the question is empty")
        problem = text_problem(question)
        if problem is not None:  # what the tokenizer and the embedder cannot encode
            raise InvalidRequest(f"question: {problem}")
        if len(question) > s.max_question_chars:
            raise InvalidRequest(
                f"the question has {len(question)} characters; the limit is {s.max_question_chars}"
            )
        max_tokens = max_tokens or s.default_max_tokens
        if max_tokens > s.max_tokens_limit:
            raise InvalidRequest(f"max_tokens is {max_tokens}; the limit is {s.max_tokens_limit}")
        sampling = SamplingParams(
            max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        query = Query(
            question,
            top_k or s.default_top_k,
            Mode.named(mode) if mode else s.default_mode,
            ratio,
            sampling,
            Fidelity.named(fidelity) if fidelity else s.fidelity,
            ChunkOrder.named(order) if order else s.chunk_order,
        )
        if packets:
            query = with_packets(query, self.engine)
        if conditioned:
            query = with_conditioned(query, s)
        return with_ape(query) if ape else query


def with_packets(query: Query, engine: Engine) -> Query:
    """`query` reading its chunks between the engine's learned packets; InvalidRequest where
    that cannot keep a promise. The packets change the prompt the model reads, so no repair
    or exact prefill of it is full prefill's: `fast` only. And a mode that stores or plans with
    context variants would mix packeted and plain KV in one catalog path: base readers only."""
    if engine.packets is None:
        raise InvalidRequest(
            "packets: this server has no learned packets (KVMOSAIC_PACKETS, `kvmosaic adapt`)"
        )
    check_fast_base_reader(query, "packets", "no packets have passed")
    return replace(query, packets=True)


def with_conditioned(query: Query, settings: Settings) -> Query:
    """`query` reading each chunk's neighbour-conditioned base where one is stored (its plain
    base where not); InvalidRequest where that cannot keep a promise. Such a base is exact in
    no prompt, so no level that promises full prefill's answer reads it: `fast` only, and a
    mode that reads base variants only (a context variant is exact where it is read).
    Not with packets: the two were never measured together."""
    if settings.conditioning() is None:
        raise InvalidRequest(
            "conditioned: this server computes no conditioned bases "
            "(KVMOSAIC_CONDITIONED_NEIGHBOURS is 0)"
        )
    if query.packets:
        raise InvalidRequest("conditioned and packets cannot be combined (never measured together)")
    check_fast_base_reader(
        query, "conditioned bases", "they are exact in no prompt and have not passed"
    )
    return replace(query, conditioned=True)


def with_ape(query: Query) -> Query:
    """`query` with its question and answer reading the chunks by APE's knobs
    (`KVMOSAIC_APE_TEMPERATURE`, `KVMOSAIC_APE_SCALE`; engine/ape.py); InvalidRequest where
    that cannot keep a promise: APE changes every row after the chunks, so `fast` only, in a mode
    that reads base variants only. Not with packets or conditioned bases: never served together."""
    if query.packets or query.conditioned:
        raise InvalidRequest(
            "ape cannot be combined with packets or conditioned bases (never measured together "
            "in the server)"
        )
    check_fast_base_reader(query, "APE's knobs", "they have not passed")
    return replace(query, ape=True)


def check_fast_base_reader(query: Query, what: str, why: str) -> None:
    """InvalidRequest unless `query` runs at fidelity `fast` in a mode that reads base
    variants only: what a request reading KV that is exact in no prompt needs."""
    if query.fidelity is not Fidelity.FAST:
        raise InvalidRequest(
            f"{what} are served at fidelity 'fast' only (this request: "
            f"{query.fidelity.value!r}); {why} the fidelity yardstick, so 'balanced' and "
            f"'exact' cannot promise full prefill's answer with them"
        )
    if not query.mode.reads_bases_only:
        raise InvalidRequest(
            f"{what} need a mode that reads base variants only "
            f"({', '.join(base_reader_names())}), not {query.mode}"
        )
