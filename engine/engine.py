"""The Engine facade: load once, encode chunks, prefill by mode, decode.

engine = Engine.load(EngineConfig())
kv = engine.encode_chunk(engine.chunk_ids("Some passage ..."))
result = engine.prefill([ChunkInput(1, kv.token_ids, kv)], "Question?", Mode.named("naive"))
text = "".join(engine.generate(result, SamplingParams(max_new_tokens=32)))
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import torch

from engine.adapt.packets import packets_fingerprint, packets_for
from engine.ape import ApeKnobs, ContextReading
from engine.config import EngineConfig, Fidelity
from engine.decoding import Decoding
from engine.errors import InvalidRequest, PromptTooLong
from engine.kv import ChunkId, ChunkKV, KVCache
from engine.model.cpu import cpu_has_amx_bf16
from engine.model.decode import (
    SamplingParams,
    StepCheck,
    TokenIds,
    generate_ids,
    native_step,
    new_generator,
)
from engine.model.decode_attention import resolve_decode_attention
from engine.model.encode_dtype import model_in, resolve_encode_dtype
from engine.model.encoder import DEFAULT_BATCH_TOKENS, ChunkEncoder
from engine.model.known import rounded_decode_weights
from engine.model.layers import DecoderStack
from engine.model.linear import linear_kernel_of
from engine.model.loader import LoadedModel, load_model
from engine.model.prefill_attention import kernel_for
from engine.model.runner import LayerRunner
from engine.model.selfcheck import rope_shift_selfcheck, tokenization_selfcheck
from engine.model.work import counted_as, is_background_thread
from engine.plan import CachedSpan, ChunkInput, Plan, PlanRequest
from engine.planners import Mode, reference_mode
from engine.prompt import PromptBuilder
from engine.result import PrefillResult, chunk_reports
from engine.serving.busy import BusyGate
from engine.serving.guard import Guarded, default_ratio
from engine.serving.guarded import GuardedRequest
from engine.serving.profile import ReuseProfile, load_profile
from engine.serving.row_bits import rows_change_bits
from engine.serving.scheduler import DecodeScheduler
from engine.serving.thread_bits import thread_fingerprint, threads_change_bits
from engine.serving.threads import DEFAULT_THREADS, in_own_thread

log = logging.getLogger(__name__)

T = TypeVar("T")


class Engine:
    """Thread-safe for concurrent prefill/generate calls (the model is read-only)."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, profile: ReuseProfile | None = None
    ):
        """`profile` None: the loaded model's reuse profile in force (engine/serving/profile.py)."""
        self.config = config
        # the model as given, before the fingerprint names packets or threads: what another
        # engine on the same model is built from (built from `self.loaded`, it would name
        # them twice and refuse this engine's KV)
        self.model_loaded = loaded
        # learned packets (config.packets): their digest joins the fingerprint of every cache
        self.packets = packets_for(config, loaded)
        if self.packets is not None:
            loaded = dataclasses.replace(
                loaded, fingerprint=packets_fingerprint(loaded.fingerprint, self.packets)
            )
        # a prefill whose bits depend on the thread count: the count joins the fingerprint, and
        # exact variants are built on it (engine/serving/thread_bits.py)
        self.threads_change_bits = threads_change_bits(loaded.model, self.threads)
        if self.threads_change_bits:
            loaded = dataclasses.replace(
                loaded, fingerprint=thread_fingerprint(loaded.fingerprint, self.threads)
            )
        self.loaded = loaded
        spec = loaded.spec
        self.profile = profile or load_profile(
            config.data_dir, loaded.fingerprint, loaded.known_name
        )
        # resolved on a passing thread: its probe computes, and this thread keeps no OpenMP pool
        self.stack = DecoderStack(
            loaded,
            in_own_thread(
                partial(
                    resolve_decode_attention,
                    config.decode_attention,
                    loaded.device,
                    loaded.dtype,
                    spec.num_heads,
                    spec.num_kv_heads,
                    spec.head_dim,
                )
            ),
            config.decode_weights,
            rounded_decode_weights(
                config.model, config.model_path, str(loaded.dtype).removeprefix("torch.")
            ),
        )
        if self.packets is not None:
            self.stack.install_soft_rows(self.packets.rows)
        # products that give a row its own bits in a call of any row count: prefills run them
        # unpadded (engine/serving/row_bits.py)
        if not rows_change_bits(loaded.model, self.threads):
            self.stack.free_rows()
        self.prompts = PromptBuilder(loaded.tokenizer, config.system_prompt, config.instruction)
        self.scheduler = (
            DecodeScheduler(
                self.stack,
                config.max_batch,
                config.max_batch_tokens,
                config.prefill_slots,
                config.batch_invariant,
                config.num_threads,
                config.decode_gap_ms / 1000,
            )
            if config.batching
            else None
        )
        # a prefill lets decode steps run between its layers (`DecodeScheduler.interleave`)
        self.runner = LayerRunner(
            self.stack, pause_point=self.scheduler.interleave if self.scheduler else None
        )
        # requests' prefills and repairs in flight, and how often blends needed a full prefill
        self.busy = BusyGate()
        self.prefix_kv = self.compute(lambda: self._encode(self.prompts.prefix_ids, start=0))
        self._encoder: ChunkEncoder | None = None  # built on first use: it may hold a model copy
        self._encoder_lock = threading.Lock()
        self.selfcheck = (
            self.compute(lambda: rope_shift_selfcheck(self.stack)) if config.selfcheck else None
        )
        if self.selfcheck is not None:
            (log.info if self.selfcheck.ok else log.error)(self.selfcheck.message)
        # the decode step's weights (a quantized copy under `auto`) are built now, charged to
        # start-up, not to the first request that decodes
        self.compute(lambda: native_step(self.stack))
        # reports only (engine/model/selfcheck.py)
        self.tokenization = tokenization_selfcheck(self.prompts)
        (log.info if self.tokenization.ok else log.warning)(self.tokenization.message)

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        # Loaded on a passing thread with the engine's thread count, so that the caller's thread
        # keeps no OpenMP pool of its own (see `compute`); the engine's own compute runs on the
        # scheduler's thread, which pins that count itself (engine/serving/threads.py).
        loaded = in_own_thread(
            partial(
                load_model,
                config.data_dir,
                config.model_path,
                config.device,
                config.dtype,
                config.linear_kernel,
                config.model,
            ),
            threads=config.num_threads or DEFAULT_THREADS,
        )
        engine = cls(config, loaded)
        log.info("engine: %s", engine.summary)
        log.info("reuse profile: %s", engine.profile.summary)
        if engine.dtype_hint:
            log.info("%s", engine.dtype_hint)
        return engine

    # -- facts ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def threads(self) -> int:
        """The compute thread's CPU thread count."""
        return self.config.num_threads or DEFAULT_THREADS

    @property
    def build_threads(self) -> int:
        """The CPU threads whose prefill gives this engine's bits: 1, or its own count where
        the bits depend on the count (engine/serving/thread_bits.py)."""
        return self.threads if self.threads_change_bits else 1

    @property
    def summary(self) -> str:
        """What computes: dtype, device, kernels and threads, for the start-up line."""
        bits = (
            ""
            if self.threads == 1
            else " (bits depend on the count: it is in the fingerprint)"
            if self.threads_change_bits
            else " (bits as on one thread)"
        )
        return (
            f"{str(self.loaded.dtype).removeprefix('torch.')} on {self.loaded.device}, "
            f"linear kernel {linear_kernel_of(self.loaded.model)}, "
            f"prefill attention {kernel_for(self.loaded.dtype, self.loaded.device)}, "
            f"decode attention {self.stack.decode_attention}, "
            f"{self.threads} thread{'' if self.threads == 1 else 's'}{bits}, "
            f"prefill rows {self.stack.prefill_calls}"
        )

    @property
    def dtype_hint(self) -> str | None:
        """The bfloat16 hint of a float32 engine on AMX-BF16 (docs/benchmarks/bfloat16.md)."""
        if (
            self.loaded.device.type == "cpu"
            and self.loaded.dtype == torch.float32
            and cpu_has_amx_bf16()
        ):
            return (
                "this CPU has AMX-BF16: KVMOSAIC_DTYPE=auto (bfloat16) prefills several times "
                "faster, its exact reuse still bit for bit its own full prefill's, its answers "
                "those of a model rounded to bfloat16; with it, KVMOSAIC_BATCH_INVARIANT=true "
                "costs nothing measurable (docs/benchmarks/bfloat16.md)"
            )
        return None

    @property
    def reuse_available(self) -> bool:
        return self.selfcheck is None or self.selfcheck.ok

    @property
    def computes_on_scheduler(self) -> bool:
        """Whether this engine's compute runs on its scheduler's thread (see `compute`): the
        threads that call it then need no cores of their own."""
        return self.scheduler is not None and self.config.prefill_slots == 1

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # -- chunks --------------------------------------------------------------------------------

    def chunk_ids(self, text: str, title: str = "") -> tuple[int, ...]:
        return self.prompts.chunk_ids(text, title)

    def packeted(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """A chunk's ids between the engine's packets (config.packets): encoded by
        `encode_chunk` and read as any chunk's, each packet token a soft row. InvalidRequest
        without packets."""
        if self.packets is None:
            raise InvalidRequest("this engine has no packets (KVMOSAIC_PACKETS, kvmosaic adapt)")
        return self.packets.around(token_ids, self.stack.embed_tokens.weight.shape[0])

    def encode_chunk(self, token_ids: Sequence[int]) -> ChunkKV:
        """KV of one chunk computed alone right after the system prefix (its base variant)."""
        if not token_ids:
            raise InvalidRequest("cannot encode an empty chunk")
        if self.prompts.prefix_len + len(token_ids) > self.loaded.spec.max_positions:
            raise PromptTooLong("the chunk does not fit in the model's context")
        return self.compute(lambda: self._encode(tuple(token_ids), start=self.prompts.prefix_len))

    def encode_after(
        self, token_ids: Sequence[int], lead_ids: Sequence[int], lead: tuple[ChunkId, ...]
    ) -> ChunkKV:
        """KV of one chunk computed after the system prefix and `lead_ids` (the cut openings of
        the chunks `lead`): a neighbour-conditioned base (FusionRAG's offline step). Its rows
        sit at their positions after the lead; `ChunkKV.lead` marks it exact in no prompt."""
        self._check_after(token_ids, lead_ids)
        start = self.prompts.prefix_len
        ids = tuple(lead_ids) + tuple(token_ids)
        kv = self.compute(lambda: self._encode(ids, start=start, keep_from=start + len(lead_ids)))
        return dataclasses.replace(kv, token_ids=tuple(token_ids), lead=tuple(lead))

    def encode_many_after(
        self,
        items: Sequence[tuple[Sequence[int], Sequence[int], tuple[ChunkId, ...]]],
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> list[ChunkKV]:
        """`encode_after` of many (token ids, lead ids, lead), packed as `encode_chunks` packs
        (each lead and its chunk one sequence after the system prefix, the lead's rows dropped):
        the same KV to float rounding, in `config.encode_dtype`, several times fewer passes."""
        for token_ids, lead_ids, _ in items:
            self._check_after(token_ids, lead_ids)
        whole = self.encode_chunks(
            [tuple(lead_ids) + tuple(token_ids) for token_ids, lead_ids, _ in items], batch_tokens
        )
        return [
            dataclasses.replace(
                kv,
                token_ids=tuple(token_ids),
                kv=kv.kv[:, :, :, len(lead_ids) :].contiguous(),
                base_position=kv.base_position + len(lead_ids),
                lead=tuple(lead),
            )
            for kv, (token_ids, lead_ids, lead) in zip(whole, items)
        ]

    def fits_after(self, num_tokens: int, num_lead: int) -> bool:
        """Whether a chunk of `num_tokens` after a lead of `num_lead` ids fits the model's
        context behind the system prefix (`encode_after`)."""
        return self.prompts.prefix_len + num_lead + num_tokens <= self.loaded.spec.max_positions

    def _check_after(self, token_ids: Sequence[int], lead_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequest("cannot encode an empty chunk")
        if not self.fits_after(len(token_ids), len(lead_ids)):
            raise PromptTooLong("the chunk and its lead do not fit in the model's context")

    def encode_chunks(
        self, chunks: Sequence[Sequence[int]], batch_tokens: int = DEFAULT_BATCH_TOKENS
    ) -> list[ChunkKV]:
        """Base variants of many chunks, packed up to `batch_tokens` rows per pass (one matrix
        product per projection for all of them; attention per chunk): the same KV as
        `encode_chunk` of each, to float rounding, several times fewer passes."""
        for token_ids in chunks:
            if not token_ids:
                raise InvalidRequest("cannot encode an empty chunk")
            if self.prompts.prefix_len + len(token_ids) > self.loaded.spec.max_positions:
                raise PromptTooLong("the chunk does not fit in the model's context")
        encoded = [
            kv
            if kv.kv.dtype == self.loaded.dtype
            else dataclasses.replace(kv, kv=kv.kv.to(self.loaded.dtype))
            for kv in self.compute(
                lambda: self.encoder.encode([tuple(c) for c in chunks], batch_tokens)
            )
        ]
        # metered as if each chunk ran alone after the cached prefix, as encode_chunk does
        for kv in encoded:
            rows = torch.zeros(self.prompts.prefix_len + kv.num_tokens, dtype=torch.long)
            rows[self.prompts.prefix_len :] = self.loaded.spec.num_layers
            self.runner.meter.add(rows)
        return encoded

    @property
    def encoder(self) -> ChunkEncoder:
        """The packed encoder of base KV, in `config.encode_dtype`
        (engine/model/encode_dtype.py)."""
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = self._build_encoder()
            return self._encoder

    def _build_encoder(self) -> ChunkEncoder:
        loaded = model_in(self.loaded, resolve_encode_dtype(self.config.encode_dtype, self.loaded))
        stack, prefix_kv = self.stack, self.prefix_kv
        if loaded is not self.loaded:
            log.info("base KV is computed in %s by a copy of the model", loaded.dtype)
            stack = DecoderStack(loaded)
            if self.packets is not None:
                stack.install_soft_rows(self.packets.rows)
            with torch.inference_mode():  # the copy's own prefix: its chunks attend to it
                prefix_kv = self._encode(
                    self.prompts.prefix_ids, start=0, runner=LayerRunner(stack)
                )
        return ChunkEncoder(
            stack,
            prefix_kv,
            self.loaded.fingerprint,
            self.prompts.prefix_digest,
            self.runner.pause_point,
        )

    def _encode(
        self,
        token_ids: tuple[int, ...],
        start: int,
        runner: LayerRunner | None = None,
        keep_from: int | None = None,
    ) -> ChunkKV:
        """Run prefix[:start] + token_ids with the prefix cached; keep rows [keep_from, end)
        (keep_from None: start)."""
        ids = torch.tensor(self.prompts.prefix_ids[:start] + token_ids, device=self.device)
        total = ids.numel()
        spans = [CachedSpan(0, self.prefix_kv)] if start else []
        plan = Plan(spans, torch.arange(start, total), pinned=torch.ones(total, dtype=torch.bool))
        out = (runner or self.runner).run(ids, plan, capacity=total, want_logits=False)
        keep = start if keep_from is None else keep_from
        return ChunkKV(
            token_ids=token_ids,
            kv=out.cache.rows(keep, total),
            base_position=keep,
            fingerprint=self.fingerprint,
            prefix_digest=self.prompts.prefix_digest,
        )

    # -- requests ------------------------------------------------------------------------------

    def prefill(
        self,
        chunks: Sequence[ChunkInput],
        question: str,
        mode: Mode,
        fidelity: Fidelity | None = None,
        ratio: float | None = None,
        max_new_tokens: int = 64,
        config: EngineConfig | None = None,
        ape: bool = False,
    ) -> PrefillResult:
        """Prefill [prefix][chunks...][question] by `mode`; TTFT ends at the first logits.

        `fidelity` (None: the config's) is the fidelity guard's level (engine/serving/guard.py);
        `result.guard` says what it estimated and spent. `ratio` None: the level's
        (`guard.default_ratio`). `config` (None: `self.config`) plans this call only; the
        engine's own config, shared with other threads, is never replaced. Raises
        InvalidRequest (or a subclass) for bad input. If the RoPE self-check failed, reuse
        modes fall back to `full` and the result says why. `ape`: the question's and the
        answer's rows read the chunks by APE's knobs (`config.ape_temperature`, `ape_scale`;
        engine/ape.py), at fidelity `fast` in a mode that reads base variants only.
        """
        started = time.perf_counter()
        config = self.config if config is None else config
        if config.reuse_profile == "auto":
            config = self.profile.guarded_config(config)
        fidelity = config.fidelity if fidelity is None else fidelity
        if ape:
            _check_ape(mode, fidelity)
        request, mode, fallback = self._plan_request(
            chunks, question, mode, fidelity, ratio, max_new_tokens, config
        )
        if ape and fallback is None:
            request = _read_by_ape(request)
        guarded = GuardedRequest(self)
        planner = mode.create_planner(config)
        capacity = request.layout.total_len + max_new_tokens
        with self.busy.in_flight():  # first attempt → judge → (re-run), on the compute thread
            kept = self.compute(partial(guarded.prefill, request, planner, capacity))
        ttft = time.perf_counter() - started
        return self._prefill_result(request, mode, kept, guarded, fallback, ttft)

    def _plan_request(
        self,
        chunks: Sequence[ChunkInput],
        question: str,
        mode: Mode,
        fidelity: Fidelity,
        ratio: float | None,
        max_new_tokens: int,
        config: EngineConfig,
    ) -> tuple[PlanRequest, Mode, str | None]:
        """The validated request, the mode it runs by (the reference's when reuse is off) and why
        it fell back to `full` (None: it did not)."""
        ratio = default_ratio(fidelity, config) if ratio is None else float(ratio)
        if not 0.0 <= ratio <= 1.0:
            raise InvalidRequest(f"ratio must lie in [0, 1], got {ratio}")
        fallback = None
        if mode.reuses_cache and self.selfcheck is not None and not self.selfcheck.ok:
            mode, fallback = reference_mode(), self.selfcheck.message
        layout = self.prompts.layout([tuple(c.token_ids) for c in chunks], question)
        self._check_fits(layout.total_len, max_new_tokens)
        self._check_sources(chunks)
        request = PlanRequest(
            layout,
            tuple(chunks),
            self.prefix_kv,
            ratio,
            config,
            self.loaded.spec.num_layers,
            fidelity,
        )
        return request, mode, fallback

    def _prefill_result(
        self,
        request: PlanRequest,
        mode: Mode,
        kept: Guarded,
        guarded: GuardedRequest,
        fallback: str | None,
        ttft: float,
    ) -> PrefillResult:
        """The result of a prefill: its state, reports and what the guard watches while it
        decodes (with the rows a repair may keep)."""
        out = kept.out
        if out.logits is None:  # `_run` always asks the runner for them
            raise RuntimeError("a prefill ran without its first logits")
        layout, num_layers = request.layout, self.loaded.spec.num_layers
        reports = chunk_reports(
            request.chunks, layout, out, num_layers, kept.planner_name, kept.plan.decisions
        )
        watch, exact_rows = guarded.watch(request, kept)
        return PrefillResult(
            mode,
            layout,
            out.cache,
            out.logits,
            ttft,
            reports,
            kept.report,
            fallback,
            layers_computed=out.layers_computed,
            watch=watch,
            exact_rows=exact_rows,
        )

    def num_decoding(self) -> int:
        """Requests decoding in the batch or waiting to join it (0 without batching, where each
        decodes on its own thread)."""
        return (
            0 if self.scheduler is None else self.scheduler.num_active + self.scheduler.num_waiting
        )

    def generate(self, result: PrefillResult, params: SamplingParams | None = None) -> Decoding:
        """Stream the answer as text pieces; `decoded()` on the stream, once it has ended, says
        what the decode did (engine/decoding.py).

        While batching, the request joins the decode batch at once; closing the stream before
        its end cancels the request's decoding. A watched prefill (`result.watch`: balanced,
        blended) is checked while it decodes (engine/serving/guarded.py); when the watch stops
        it, the prompt and the answer so far are prefilled by the reference plan and decoding
        goes on from there in the same stream, recorded as the decode's `Repair`.
        """
        result.cache.claim_for_decode()
        params = params or SamplingParams()
        generator = new_generator(params.seed, result.logits.device)  # one for the whole answer
        # decode → (repair)
        ids = GuardedRequest(self).answer(result, params, generator)
        return Decoding(self.loaded.tokenizer, ids, result)

    def decode_ids(
        self,
        cache: KVCache,
        logits: torch.Tensor,
        params: SamplingParams,
        check: StepCheck | None,
        generator: torch.Generator | None,
    ) -> TokenIds:
        """The answer's ids decoded from `cache` after `logits`, batched with the others while
        batching; the stream's end carries `check`'s verdict (`engine.model.decode.ended_by`)."""
        eos = self.loaded.eos_token_ids
        if self.scheduler is None:
            return generate_ids(self.stack, cache, logits, params, eos, check, generator)
        return self.scheduler.submit(
            cache, logits, params, eos, check, generator
        )  # batched with the others

    def compute(self, fn: Callable[[], T]) -> T:
        """Run the model work `fn` (a prefill, a repair, an encoding, a benchmark's forced
        pass) under inference mode, and return its result.

        While batching with one prefill slot (the default) it runs on the scheduler's thread,
        before the next decode step, so one thread computes everything: on a CPU each thread
        that computes keeps its own OpenMP pool, and once the pools outnumber the cores they
        stop spinning between operations and every small one pays a wake-up (measured on 2
        vCPUs, see engine/serving/scheduler.py). With more prefill slots it runs on the caller's
        thread
        holding a slot (decode steps pause meanwhile); without batching, on the caller's thread.
        """
        background = is_background_thread()

        def inference() -> T:
            with torch.inference_mode(), counted_as(background):
                return fn()

        if self.scheduler is None:
            return inference()
        if not self.computes_on_scheduler:
            with self.scheduler.prefill_turn():
                return inference()
        return self.scheduler.call(inference)

    def close(self) -> None:
        """Stop the decode scheduler; requests still decoding end with EngineClosed."""
        if self.scheduler is not None:
            self.scheduler.close()

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        limit = self.loaded.spec.max_positions
        if prompt_len + max_new_tokens > limit:
            raise PromptTooLong(
                f"prompt of {prompt_len} tokens plus {max_new_tokens} new tokens "
                f"exceeds the model's context of {limit}"
            )

    def _check_sources(self, chunks: Sequence[ChunkInput]) -> None:
        for chunk in chunks:
            kv = chunk.kv
            if kv is None:
                continue
            if kv.fingerprint != self.fingerprint or kv.prefix_digest != self.prompts.prefix_digest:
                raise InvalidRequest(
                    f"cached KV of chunk {chunk.chunk_id} belongs to another model or prefix"
                )
            if kv.num_tokens != len(chunk.token_ids):
                raise InvalidRequest(
                    f"cached KV of chunk {chunk.chunk_id} has {kv.num_tokens} rows "
                    f"for {len(chunk.token_ids)} tokens"
                )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_ape(mode: Mode, fidelity: Fidelity) -> None:
    """InvalidRequest unless a request in `mode` at `fidelity` may read its chunks by APE: APE
    changes what every row after the chunks computes, so no level that promises full prefill's
    answer runs it, and a mode that stores or plans with exact variants would be exact nowhere
    (learned packets' rule)."""
    if fidelity is not Fidelity.FAST:
        raise InvalidRequest(
            f"ape: served at fidelity 'fast' only (this request: {fidelity.value!r}); it has not "
            "passed the fidelity yardstick"
        )
    if not mode.reads_bases_only:
        raise InvalidRequest(f"ape: needs a mode that reads base variants only, not {mode}")


def _read_by_ape(request: PlanRequest) -> PlanRequest:
    """`request` with its question's and answer's rows reading the chunks by APE's knobs."""
    knobs = ApeKnobs(request.config.ape_temperature, request.config.ape_scale)
    contexts = ContextReading(knobs, request.layout.prefix_len, request.layout.question_span[0])
    return dataclasses.replace(request, reading=contexts)
