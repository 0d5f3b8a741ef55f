"""`kvmosaic bench fidelity`: every mode on the same prompts, measured against `full`.

For each record: its first `chunks` passages become chunks, each with its base-variant KV
computed beforehand (as ingest would; not timed). Every mode prefills the same token
sequence; TTFT ratios are per record against `full` in the same run. A warm-up pass over the
first record runs before timing so that one-time allocation does not count.

Each mode gets its chunks through a per-record `VariantBook`, i.e. the server's variant
policy. By default every mode runs cold (base variants only), as a request whose chunks were
never seen together does. With `warmup_orders` > 0, each mode whose requests leave variants
also gets a warm row (`cachecraft+warm3`): first the record's chunks go through that many
untimed requests of the mode in other (seeded random) orders, whose variants (harvested, or
built where the policy builds) land in the book; the row's `warm-up` column is what that cost,
in full prefills of the record (the requests' and the builds' arithmetic over full's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from app.variants.book import VariantBook
from app.variants.policy import VariantPolicy
from bench.fidelity import decode_rows
from bench.fidelity.accuracy import (
    Interval,
    Score,
    bootstrap,
    paired_difference,
    per_case_means,
    score_answer,
)
from bench.fidelity.decode_rows import checked_weights, decoding_with
from bench.fidelity.flops import FlopCounter
from bench.fidelity.metrics import (
    best_f1,
    forced_logits,
    kl_divergence,
    rouge_l,
    same_top1,
    teacher_forced,
)
from bench.fidelity.neighbours import KEYS as NEIGHBOUR_KEYS
from bench.fidelity.neighbours import Conditioning, Neighbourhood
from bench.fidelity.storage import (
    RowStorage,
    format_ingest,
    format_kib,
    row_storage,
    summarize_storage,
)
from engine.config import EngineConfig, Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkId, ChunkKV, KVCache
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode, reference_mode
from engine.planners.base import VariantYield
from engine.result import PrefillResult

REFERENCE = reference_mode().name  # the row every other row is measured against
FLOOR = "floor"  # the row of full prefill in another chunk order against full in the first
CRAFT = "cachecraft"  # the mode whose α `kvmosaic calibrate` fits
WARM = "+warm"
AT = "@"  # `mode@fidelity`: the row runs at that guard level (engine/serving/guard.py)
SETTINGS = "["  # `mode[key=value;...]`: the row plans with these engine settings (`row_config`)
PACKETS = "packets"  # `mode[packets=1]`: the row reads its chunks between learned packets
APE = "ape"  # `mode[ape=1]`: the row's question and answer read the chunks by APE's knobs
CODEC = "codec"  # `mode[codec=NAME]`: the row's chunk KV goes through a store codec first
KVTransform = Callable[[ChunkKV], ChunkKV]
# fixed when the model loads: one engine serves every row
LOAD_FIELDS = frozenset(
    {
        "model",
        "model_path",
        "device",
        "dtype",
        "linear_kernel",
        "decode_attention",
        "data_dir",
        "num_threads",
        "encode_dtype",
    }
)
MAX_PASSAGES = 1000  # passages per record, for distinct chunk ids across records (MuSiQue has 10)


@dataclass(frozen=True)
class DatasetSlice:
    """Records [start, start + n) of a dataset, `chunks` passages each, and the Cache-Craft
    warm-up (`warmup_orders` untimed requests in other orders, seeded by `seed`)."""

    dataset: Path
    start: int = 0
    n: int = 20
    chunks: int = 6
    warmup_orders: int = 0
    seed: int = 0
    # chunk orders each record runs in: the dataset's own (the retriever's, one arbitrary choice)
    # then seeded shuffles; full prefill in each order against the first is the stability floor
    orders: int = 3

    def records(self) -> list[Record]:
        """The slice's records; InvalidRequest if the file is unreadable or the slice empty."""
        records = load_dataset(self.dataset)[self.start : self.start + self.n]
        if not records:
            raise InvalidRequest("the dataset slice is empty")
        return records


@dataclass(frozen=True)
class FidelityOptions(DatasetSlice):
    modes: tuple[str, ...] = ("full", "naive", "epic", "cacheblend")
    ratio: float | None = None
    max_new_tokens: int = 32
    fidelity: str | None = None  # guard level of rows that name none (None: the engine's default)


@dataclass
class ModeSample:
    """One mode on one record."""

    ttft_s: float
    ttft_ratio: float
    compute_ratio: float  # FLOPs of full / FLOPs of this mode's prefill (bench/fidelity/flops.py)
    recompute_share: float
    kl: float
    top1: bool
    rouge_l: float
    f1: float
    answer: str
    warmup_cost: float = 0.0  # untimed warm-up work before this sample, in full prefills
    # full's greedy answer fed to the mode (teacher forcing, metrics.teacher_forced): share of
    # answer positions whose top-1 is full's token, mean KL(full ‖ mode) per position
    answer_top1: float = float("nan")
    answer_kl: float = float("nan")
    escalated: bool = False  # the fidelity guard re-ran the request in full
    repaired: bool = (
        False  # the guard's check while decoding switched the greedy answer to full prefill
    )
    work_share: float = (
        1.0  # FLOPs of this mode's prefills (first-token re-run and repair included) / full's
    )
    # why the guard repaired the greedy answer ("margin", "grounding"; None: it did not) and,
    # for grounding, the span that no passage held
    repair_reason: str | None = None
    repair_span: str | None = None
    case: int = 0  # the record's index in the dataset
    order: int = 0  # 0: the dataset's chunk order; 1..: seeded shuffles (`chunk_orders`)
    identical: bool = False  # the greedy answer is the reference's, word for word
    # what the row's cached KV cost on this record (bench/fidelity/storage.py; 0: not counted)
    chunk_tokens: int = 0
    ingest_tokens: int = 0
    stored_bytes: int = 0
    score: Score = field(default_factory=lambda: Score(float("nan"), float("nan"), float("nan")))


@dataclass
class ModeSummary:
    mode: str
    records: int
    median_ttft_s: float
    median_ttft_ratio: float
    median_compute_ratio: float  # the floor: the speed-up if nothing but the arithmetic cost time
    recompute_share: float
    mean_kl: float
    top1_agreement: float
    rouge_l: float
    f1: float
    warmup_cost: float = 0.0
    answer_top1: float = float("nan")
    answer_kl: float = float("nan")
    escalated: float = 0.0  # share of records the guard re-ran in full
    repaired: float = 0.0  # share of records whose greedy decode the guard repaired
    work_share: float = 1.0  # mean FLOPs of the mode's prefills, repairs included, over full's
    identical: float = 1.0  # share of answers equal to the reference's word for word
    exact_match: float = float("nan")  # mean EM against the gold answers
    # gold containment over cases (each the mean over its orders) and paired against full's
    accuracy: Interval = field(
        default_factory=lambda: Interval(float("nan"), float("nan"), float("nan"))
    )
    accuracy_vs_full: Interval = field(default_factory=lambda: Interval(0.0, 0.0, 0.0))
    # per chunk token: tokens computed at ingest, bytes of KV kept (bench/fidelity/storage.py)
    ingest_per_token: float = float("nan")
    stored_bytes_per_token: float = float("nan")
    samples: list[ModeSample] = field(default_factory=list)


Record = dict[
    str, Any
]  # one benchmark record: {question, answers, ctxs: [{title, text}]}, as JSON gives it
# (engine, record, chunks wanted, record index) → the record's chunk inputs
ChunkProvider = Callable[[Engine, Record, int, int], list[ChunkInput]]


def load_dataset(path: Path) -> list[Record]:
    """A JSON list of {question, answers, ctxs: [{title, text}]}; raises InvalidRequest
    otherwise."""
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"cannot read dataset {path}: {exc}") from exc
    if not isinstance(records, list) or not all(_is_record(r) for r in records):
        raise InvalidRequest(
            f"{path} is not a list of {{question, answers, ctxs: [{{title, text}}]}}"
        )
    return records


def _is_record(record: object) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("question"), str)
        and isinstance(record.get("ctxs"), list)
        and all(isinstance(c, dict) and "text" in c for c in record["ctxs"])
    )


def record_chunk_id(record: int, position: int) -> int:
    """A chunk id for passage `position` of record `record`, distinct across the run's records."""
    if not 0 <= position < MAX_PASSAGES:
        raise ValueError(f"a record has at most {MAX_PASSAGES} passages; got position {position}")
    return record * MAX_PASSAGES + position


def base_variant_chunks(engine: Engine, record: Record, count: int, index: int) -> list[ChunkInput]:
    """The record's first `count` passages with KV computed alone after the system prefix."""
    chunks: list[ChunkInput] = []
    for i, ctx in enumerate(record["ctxs"][:count]):
        ids = engine.chunk_ids(ctx["text"], ctx.get("title", ""))
        chunks.append(ChunkInput(record_chunk_id(index, i), ids, engine.encode_chunk(ids)))
    return chunks


def run_fidelity(
    engine: Engine,
    options: FidelityOptions,
    provider: ChunkProvider = base_variant_chunks,
    progress: bool = True,
    codecs: Mapping[str, KVTransform] | None = None,
) -> list[ModeSummary]:
    """Every row on every record in each of `options.orders` chunk orders; the summaries start
    with `full`, then the floor (with more than one order), then the modes. A row naming
    `codec=NAME` in its settings reads every chunk's KV through `codecs[NAME]` (the store's
    encode and decode: the app passes them, the engine knows no codec)."""
    _check_codecs(row_labels(options), codecs or {})
    records = options.records()
    modes = row_labels(options)
    neighbourhood = _neighbourhood(options, modes)
    _warm_up(engine, records[0], options, modes, provider)
    samples: dict[str, list[ModeSample]] = {m: [] for m in (REFERENCE, FLOOR) + modes}
    bar = tqdm(records, desc="fidelity", unit="record", file=sys.stderr, disable=not progress)
    for offset, record in enumerate(bar):
        index = options.start + offset
        for label, sample in _run_orders(
            engine, record, options, modes, provider, index, codecs or {}, neighbourhood
        ):
            samples[label].append(sample)
        bar.set_postfix(
            {
                m: f"{statistics.median(s.ttft_ratio for s in samples[m]):.1f}x"
                for m in modes
                if m != REFERENCE
            }
        )
    if neighbourhood is not None:
        for line in neighbourhood.report():
            print(line, file=sys.stderr)
    return summarize_rows(samples, modes)


def _neighbourhood(options: FidelityOptions, labels: Sequence[str]) -> Neighbourhood | None:
    """The dataset's passages and their neighbours, where a row conditions its bases on them
    (bench/fidelity/neighbours.py); None where none does."""
    if not any(Conditioning.of(label, settings_of(label)) for label in labels):
        return None
    return Neighbourhood.of_records(load_dataset(options.dataset), record_chunk_id)


def summarize_rows(
    samples: Mapping[str, list[ModeSample]], modes: Sequence[str]
) -> list[ModeSummary]:
    """One summary per row that has samples: `full` first, then the floor, then the other
    `modes` (each measured against full's samples in `samples[REFERENCE]`)."""
    rows = [m for m in (REFERENCE, FLOOR, *modes[1:]) if samples.get(m)]
    return [_summarize(label, samples[label], samples[REFERENCE]) for label in rows]


def _run_orders(
    engine: Engine,
    record: Record,
    options: FidelityOptions,
    modes: Sequence[str],
    provider: ChunkProvider,
    index: int,
    codecs: Mapping[str, KVTransform],
    neighbourhood: Neighbourhood | None = None,
) -> list[tuple[str, ModeSample]]:
    """(row label, sample) of every row in every chunk order of one record, and the floor's
    samples: full in order k > 0 measured against full in order 0."""
    base = provider(engine, record, options.chunks, index)
    books = mode_books(engine, record["question"], base, options, modes, index, neighbourhood)
    out: list[tuple[str, ModeSample]] = []
    first: Reference | None = None
    for order, ids in enumerate(
        chunk_orders([c.chunk_id for c in base], options.orders, options.seed + index)
    ):
        inputs = {
            label: (_through_codec(row.book.inputs(ids, mode_of(label)), label, codecs), row)
            for label, row in books.items()
        }
        rows, reference = _run_record(engine, record, inputs, modes, options)
        out += [
            (label, dataclasses.replace(sample, case=index, order=order))
            for label, sample in rows.items()
        ]
        if first is None:
            first = reference
        else:
            out.append(
                (
                    FLOOR,
                    dataclasses.replace(
                        _against(engine, reference, first, record), case=index, order=order
                    ),
                )
            )
    return out


def _check_codecs(labels: Sequence[str], codecs: Mapping[str, KVTransform]) -> None:
    for label in labels:
        codec = settings_of(label).get(CODEC)
        if codec is not None and codec not in codecs:
            raise InvalidRequest(
                f"row {label!r}: no codec {codec!r} here; known: {', '.join(codecs) or 'none'}"
            )


def _through_codec(
    chunks: list[ChunkInput], label: str, codecs: Mapping[str, KVTransform]
) -> list[ChunkInput]:
    """The row's chunks with their KV as the row's codec stores and loads it (unchanged without
    one)."""
    codec = settings_of(label).get(CODEC)
    if codec is None:
        return chunks
    return [
        dataclasses.replace(c, kv=codecs[codec](computed_kv(c))) if c.kv is not None else c
        for c in chunks
    ]


def chunk_orders(ids: list[ChunkId], count: int, seed: int) -> list[list[ChunkId]]:
    """`ids` itself, then `count` − 1 seeded shuffles of it (distinct from it where possible)."""
    if count < 1:
        raise InvalidRequest(f"a record runs in at least one chunk order; got {count}")
    return [ids] + other_orders(ids, count - 1, seed + 7919)


def row_labels(options: FidelityOptions) -> tuple[str, ...]:
    """The rows of the table: `full` first, every mode cold, then with `warmup_orders` > 0 a
    warm row for each mode whose requests leave variants."""
    modes = (REFERENCE,) + tuple(m for m in options.modes if m != REFERENCE)
    warm = tuple(
        f"{m}{WARM}{options.warmup_orders}"
        for m in modes
        if options.warmup_orders > 0 and mode_of(m).leaves is not VariantYield.NONE
    )
    return modes + warm


def mode_of(label: str) -> Mode:
    """The mode of a row label such as `cachecraft@fast[guard_margin=0.5]+warm3`."""
    return Mode.named(_head(label).split(AT)[0])


def fidelity_of(label: str, options: FidelityOptions) -> Fidelity | None:
    """The guard level of a row label (`mode@fast`), else the options' (None: the engine's)."""
    head = _head(label)
    name = head.split(AT)[1] if AT in head else options.fidelity
    return Fidelity.named(name) if name is not None else None


def _head(label: str) -> str:
    """`mode@level` of a label, without its settings and warm-up."""
    return label.split(WARM)[0].split(SETTINGS)[0]


def settings_of(label: str) -> dict[str, str]:
    """The engine settings a row label names in brackets
    (`cacheblend[guard_margin=0.5;focus_layer=10]`),
    as text; InvalidRequest if malformed."""
    body = label.split(WARM)[0]
    if SETTINGS not in body:
        return {}
    inner = body.split(SETTINGS, 1)[1]
    if not inner.endswith("]"):
        raise InvalidRequest(
            f"row {label!r}: settings go in brackets, e.g. cacheblend[guard_margin=0.5]"
        )
    pairs = [item.split("=", 1) for item in inner[:-1].split(";") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise InvalidRequest(f"row {label!r}: each setting is key=value, separated by ';'")
    return {key.strip(): value.strip() for key, value in pairs}


def decodes_only(label: str) -> bool:
    """Whether a row is `full` with other decode weights and nothing else (`full[decode_weights=
    int8]`): it decodes full's own prefill (bench/fidelity/decode_rows.py)."""
    head = _head(label)
    return (
        AT not in head
        and mode_of(label) == Mode.named(REFERENCE)
        and set(settings_of(label)) == {decode_rows.KEY}
    )


def row_config(label: str, config: EngineConfig) -> EngineConfig:
    """`config` with the row's bracketed settings (`settings_of`) applied; InvalidRequest for an
    unknown field or a value the config refuses. Settings fixed when the model loads (dtype,
    kernels, model) cannot be set per row."""
    changes: dict[str, Any] = {}
    for key, text in settings_of(label).items():
        if key in (CODEC, PACKETS, APE) or key in NEIGHBOUR_KEYS:
            continue  # the chunks' KV or the prefill's call, not the engine's config
        if key in LOAD_FIELDS or key not in {f.name for f in dataclasses.fields(config)}:
            raise InvalidRequest(
                f"row {label!r}: {key!r} is not an engine setting a row may change"
            )
        changes[key] = _typed(text, getattr(config, key))
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"row {label!r}: {exc}") from exc


def _typed(text: str, current: object) -> object:
    """`text` as the type of the field's current value (a None field takes an int, a float or
    none)."""
    if text.lower() == "none":
        return None
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, int) or (current is None and text.lstrip("-").isdigit()):
        return int(text)
    if isinstance(current, float) or current is None:
        return float(text)
    if isinstance(current, tuple):
        return tuple(type(current[0])(v) for v in text.split("/")) if current else ()
    return text


class RowBook(NamedTuple):
    """A row's variant book on one record, its warm-up's cost in full prefills of the record,
    and what the KV it starts from cost (bench/fidelity/storage.py)."""

    book: VariantBook
    warmup_cost: float
    storage: RowStorage


def mode_books(
    engine: Engine,
    question: str,
    base: list[ChunkInput],
    options: FidelityOptions,
    labels: Sequence[str],
    index: int,
    neighbourhood: Neighbourhood | None = None,
) -> dict[str, RowBook]:
    """Per row label: the variant book its mode draws from (cold: base variants only, or the
    row's neighbour-conditioned bases from `neighbourhood`, which only the untimed warm-up
    leaves out; warm: after the warm-up), the warm-up's cost in full prefills of the record
    and what the row's KV cost to make and keep."""
    out: dict[str, RowBook] = {}
    conditioned: dict[Conditioning, list[ChunkInput]] = {}  # rows that share one compute it once
    packeted: list[ChunkInput] = []
    for label in labels:
        orders = options.warmup_orders if WARM in label else 0
        conditioning = Conditioning.of(label, settings_of(label))
        bases, leads = base, None
        if conditioning is not None and neighbourhood is not None:  # None: the untimed warm-up
            if conditioning not in conditioned:
                conditioned[conditioning] = neighbourhood.conditioned(engine, base, conditioning)
            bases, leads = conditioned[conditioning], neighbourhood.lead_tokens[conditioning]
        if reads_packets(label):
            if conditioning is not None:
                raise InvalidRequest(f"row {label!r}: packets or neighbours, not both")
            packeted = packeted or packeted_bases(engine, base)
            bases = packeted
        mode = mode_of(label)
        book, cost = warmed_book(engine, question, bases, orders, options.seed + index, mode)
        storage = row_storage(mode.reuses_cache, base, bases, book.stored_bytes(), leads)
        out[label] = RowBook(book, cost, storage)
    return out


def reads_packets(label: str) -> bool:
    """Whether a row reads its chunks between the engine's learned packets (`packets=1`)."""
    return _flag(label, PACKETS)


def reads_by_ape(label: str) -> bool:
    """Whether a row's question and answer read its chunks by APE's knobs (`ape=1`; the knobs
    are the row's `ape_temperature` and `ape_scale`, else the engine's)."""
    return _flag(label, APE)


def _flag(label: str, key: str) -> bool:
    return settings_of(label).get(key, "0").lower() in ("1", "true", "yes")


def packeted_bases(engine: Engine, base: list[ChunkInput]) -> list[ChunkInput]:
    """`base`'s chunks between the engine's packets (`Engine.packeted`), each encoded alone
    after the system prefix (ingest's work, not timed)."""
    out = []
    for chunk in base:
        ids = engine.packeted(chunk.token_ids)
        out.append(ChunkInput(chunk.chunk_id, ids, engine.encode_chunk(ids)))
    return out


def warmed_book(
    engine: Engine,
    question: str,
    base: list[ChunkInput],
    orders: int,
    seed: int,
    mode: Mode | None = None,
    policy: VariantPolicy | None = None,
) -> tuple[VariantBook, float]:
    """A book holding the base variants plus what `orders` untimed `mode` requests in other
    orders of the same chunks left (through the book's policy); and what those requests and
    builds cost, in full prefills of the chunks in their own order (0 without warm-up).
    `mode` None: `CRAFT`'s."""
    mode = Mode.named(CRAFT) if mode is None else mode
    book = VariantBook(engine, policy=policy)
    for chunk in base:
        book.add(chunk.chunk_id, computed_kv(chunk))
    if orders <= 0:
        return book, 0.0
    flops = FlopCounter.for_engine(engine)
    work = 0.0
    for order in other_orders([c.chunk_id for c in base], orders, seed):
        inputs = book.inputs(order, mode)
        result = engine.prefill(inputs, question, mode, max_new_tokens=1)
        work += flops.prefill(result.layers_computed)
        book.record(result, inputs)
    work += sum(flops.prefill(layers) for layers in book.build_work)
    full = engine.prefill(base, question, reference_mode(), max_new_tokens=1)
    return book, work / max(flops.prefill(full.layers_computed), 1.0)


def computed_kv(chunk: ChunkInput) -> ChunkKV:
    """The in-memory KV a provider gave the chunk (a book holds ChunkKV, not lazy readers)."""
    if not isinstance(chunk.kv, ChunkKV):
        raise InvalidRequest(f"chunk {chunk.chunk_id}: a provider must give computed KV")
    return chunk.kv


def other_orders(ids: list[ChunkId], count: int, seed: int) -> list[list[ChunkId]]:
    """`count` seeded random orders of `ids`, none equal to `ids` itself (when possible)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(count):
        order = ids[:]
        for _ in range(10):
            rng.shuffle(order)
            if order != ids:
                break
        orders.append(order)
    return orders


def _warm_up(
    engine: Engine,
    record: Record,
    options: FidelityOptions,
    labels: Sequence[str],
    provider: ChunkProvider,
) -> None:
    base = provider(engine, record, options.chunks, -1)
    warm = dataclasses.replace(options, warmup_orders=min(1, options.warmup_orders))
    for label, row in mode_books(engine, record["question"], base, warm, labels, -1).items():
        engine.prefill(
            row.book.inputs([c.chunk_id for c in base], mode_of(label)),
            record["question"],
            mode=mode_of(label),
            ratio=options.ratio,
            max_new_tokens=1,
        )


@dataclass(frozen=True)
class Reference:
    """Full prefill of one record in one chunk order: what every row of that order is measured
    against (its greedy answer, ids and the logits along them, teacher-forced)."""

    result: PrefillResult
    ttft_s: float
    work: float
    logits: torch.Tensor
    answer: str
    ids: list[int]
    forced: torch.Tensor


def _run_record(
    engine: Engine,
    record: Record,
    inputs: dict[str, tuple[list[ChunkInput], RowBook]],
    modes: Sequence[str],
    options: FidelityOptions,
) -> tuple[dict[str, ModeSample], Reference]:
    """Every row on one record in one chunk order (full first: the others are measured against
    it)."""
    params = SamplingParams(max_new_tokens=options.max_new_tokens)
    flops = FlopCounter.for_engine(engine)
    reference: Reference | None = None
    out = {}
    untouched: KVCache | None = None  # full's cache before its decode, for decode-only rows
    for label in modes:
        chunks, row = inputs[label]
        storage = row.storage
        weights = checked_weights(label, settings_of(label).get(decode_rows.KEY))
        if reference is not None and untouched is not None and decodes_only(label):
            result = dataclasses.replace(reference.result, cache=untouched.copy())
        else:
            result = engine.prefill(
                chunks,
                record["question"],
                mode=mode_of(label),
                ratio=options.ratio,
                max_new_tokens=options.max_new_tokens,
                fidelity=fidelity_of(label, options),
                config=row_config(label, engine.config),
                ape=reads_by_ape(label),
            )
        if reference is None and any(decodes_only(m) for m in modes):
            untouched = result.cache.copy()
        logits = result.logits.clone()
        work = flops.prefill(result.layers_computed)
        with decoding_with(engine, weights):
            answer, decoded = read_out(engine.generate(result, params))
        answer = answer.strip()
        repair = decoded.repair
        work_all = work + (
            flops.prefill(repair.layers_computed) if repair is not None else 0.0
        )  # the guard's repair is charged
        if reference is None:
            ids = list(decoded.token_ids)
            reference = Reference(
                result, result.ttft_s, work, logits, answer, ids, forced_logits(engine, result, ids)
            )
        forced = teacher_forced(engine, result, reference.ids, reference.forced)
        out[label] = ModeSample(
            ttft_s=result.ttft_s,
            ttft_ratio=reference.ttft_s / result.ttft_s,
            compute_ratio=reference.work / max(work, 1.0),
            recompute_share=result.recompute_share,
            kl=kl_divergence(reference.logits, logits),
            top1=same_top1(reference.logits, logits),
            rouge_l=rouge_l(answer, reference.answer),
            f1=best_f1(answer, record.get("answers", [])),
            answer=answer,
            warmup_cost=row.warmup_cost,
            answer_top1=forced.top1_share,
            answer_kl=forced.mean_kl,
            escalated=result.guard.escalated,
            repaired=decoded.repaired,
            repair_reason=decoded.guard.repair_reason,
            repair_span=decoded.guard.repair_span,
            work_share=work_all / max(reference.work, 1.0),
            identical=answer == reference.answer,
            score=score_answer(answer, record.get("answers", [])),
            chunk_tokens=storage.chunk_tokens,
            ingest_tokens=storage.ingest_tokens,
            stored_bytes=storage.stored_bytes,
        )
    if reference is None:
        raise InvalidRequest("no rows to run")
    return out, reference


def _against(engine: Engine, other: Reference, first: Reference, record: Record) -> ModeSample:
    """Full prefill in another order (`other`) measured against full in the first (`first`), as
    a mode is against full: a floor sample. Its timing fields are 1: the floor costs nothing."""
    forced = teacher_forced(engine, other.result, first.ids, first.forced)
    return ModeSample(
        ttft_s=other.ttft_s,
        ttft_ratio=1.0,
        compute_ratio=1.0,
        recompute_share=1.0,
        kl=kl_divergence(first.logits, other.logits),
        top1=same_top1(first.logits, other.logits),
        rouge_l=rouge_l(other.answer, first.answer),
        f1=best_f1(other.answer, record.get("answers", [])),
        answer=other.answer,
        answer_top1=forced.top1_share,
        answer_kl=forced.mean_kl,
        identical=other.answer == first.answer,
        score=score_answer(other.answer, record.get("answers", [])),
    )


def _summarize(mode: str, samples: list[ModeSample], reference: list[ModeSample]) -> ModeSummary:
    """The row's means; its accuracy over cases and, paired case by case, against `reference`
    (full's samples; the floor is paired with full's samples of the same orders)."""
    mean = statistics.fmean
    accuracy, versus = _accuracy(samples, reference, first_order=mode == FLOOR)
    storage = summarize_storage(
        RowStorage(s.chunk_tokens, s.ingest_tokens, s.stored_bytes) for s in samples
    )
    return ModeSummary(
        mode=mode,
        records=len({s.case for s in samples}),
        median_ttft_s=statistics.median(s.ttft_s for s in samples),
        median_ttft_ratio=statistics.median(s.ttft_ratio for s in samples),
        median_compute_ratio=statistics.median(s.compute_ratio for s in samples),
        recompute_share=mean(s.recompute_share for s in samples),
        mean_kl=mean(s.kl for s in samples),
        top1_agreement=mean(s.top1 for s in samples),
        rouge_l=mean(s.rouge_l for s in samples),
        f1=mean(s.f1 for s in samples),
        warmup_cost=mean(s.warmup_cost for s in samples),
        answer_top1=_mean_known(s.answer_top1 for s in samples),
        answer_kl=_mean_known(s.answer_kl for s in samples),
        escalated=mean(s.escalated for s in samples),
        repaired=mean(s.repaired for s in samples),
        work_share=mean(s.work_share for s in samples),
        identical=mean(s.identical for s in samples),
        exact_match=_mean_known(s.score.exact for s in samples),
        accuracy=accuracy,
        accuracy_vs_full=versus,
        ingest_per_token=storage.ingest_per_token,
        stored_bytes_per_token=storage.stored_bytes_per_token,
        samples=samples,
    )


def _accuracy(
    samples: list[ModeSample], reference: list[ModeSample], first_order: bool = False
) -> tuple[Interval, Interval]:
    """Gold containment over cases (mean over each case's orders) and the paired difference
    against the reference's samples of the same (case, order)s, or of the same case in the
    first order when `first_order` (the floor: what reordering alone does to accuracy)."""
    own = per_case_means([s.score.contains for s in samples], [s.case for s in samples])
    by_key = {(s.case, s.order): s.score.contains for s in reference}
    paired = [by_key[(s.case, 0 if first_order else s.order)] for s in samples]
    theirs = per_case_means(paired, [s.case for s in samples])
    return bootstrap(own), paired_difference(own, theirs)


def _mean_known(values: Iterable[float]) -> float:
    """Mean over the records that have the figure (an empty reference answer has none)."""
    known = [v for v in values if not math.isnan(v)]
    return statistics.fmean(known) if known else float("nan")


def format_table(summaries: list[ModeSummary]) -> str:
    """Two tables: speed and work against full, then answers against full beside the floor
    (full prefill in another chunk order) and task accuracy with its 95% interval."""
    return _speed_table(summaries) + "\n\n" + _answer_table(summaries)


def _speed_table(summaries: list[ModeSummary]) -> str:
    w = _label_width(summaries)
    header = (
        f"{'mode':<{w}} {'n':>3} {'TTFT s':>8} {'vs full':>8} {'floor':>8} {'recomp':>7} "
        f"{'warm-up':>8} "
        f"{'guard':>6} {'repair':>6} {'work':>6} {'ingest':>7} {'KiB/tok':>8}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        if s.mode == FLOOR:
            continue
        lines.append(
            f"{s.mode:<{w}} {s.records:>3} {s.median_ttft_s:>8.3f} {s.median_ttft_ratio:>7.2f}x "
            f"{s.median_compute_ratio:>7.2f}x {s.recompute_share:>7.3f} {s.warmup_cost:>7.2f}x "
            f"{s.escalated:>6.2f} {s.repaired:>6.2f} {s.work_share:>6.2f} "
            f"{format_ingest(s.ingest_per_token):>7} {format_kib(s.stored_bytes_per_token):>8}"
        )
    return "\n".join(lines)


def _answer_table(summaries: list[ModeSummary]) -> str:
    floor = next((s for s in summaries if s.mode == FLOOR), None)
    floor_kl = None if floor is None else floor.mean_kl
    floor_miss = None if floor is None else 1 - floor.rouge_l
    w = _label_width(summaries)
    header = (
        f"{'mode':<{w}} {'same':>5} {'ROUGE-L':>8} {'KL':>8} {'top1':>5} {'ans top1':>8} "
        f"{'ans KL':>7} "
        f"{'KL/floor':>8} {'1-RL/fl':>7}  {'accuracy [95%]':<22} {'vs full [95%]':<24} {'EM':>5} "
        f"{'F1':>5}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s.mode:<{w}} {s.identical:>5.2f} {s.rouge_l:>8.3f} {s.mean_kl:>8.4f} "
            f"{s.top1_agreement:>5.2f} "
            f"{s.answer_top1:>8.3f} {s.answer_kl:>7.4f} {_ratio(s.mean_kl, floor_kl):>8} "
            f"{_ratio(1 - s.rouge_l, floor_miss):>7}  {str(s.accuracy):<22} "
            f"{_signed(s.accuracy_vs_full):<24} {s.exact_match:>5.2f} {s.f1:>5.2f}"
        )
    return "\n".join(lines)


def _label_width(summaries: list[ModeSummary]) -> int:
    return max([17] + [len(s.mode) for s in summaries])


def _ratio(value: float, floor: float | None) -> str:
    """value / floor as `1.23x`, or `-` without a floor (one chunk order) or when it is zero."""
    return "-" if not floor else f"{value / floor:.2f}x"


def _signed(interval: Interval) -> str:
    return f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]"


def write_json(summaries: list[ModeSummary], options: FidelityOptions, path: Path) -> None:
    write_report({**asdict(options), "dataset": str(options.dataset)}, summaries, path)


def write_report(options: dict[str, Any], summaries: list[ModeSummary], path: Path) -> None:
    """The report as JSON: `options` and every row's summary with its samples (which is what
    lets shards be merged: bench/fidelity/merge.py)."""
    payload = {"options": options, "modes": [asdict(s) for s in summaries]}
    Path(path).write_text(json.dumps(payload, indent=2))
