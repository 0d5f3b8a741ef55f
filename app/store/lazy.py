"""`LazyChunkKV`: a `KVSource` that reads a stored chunk layer by layer, ahead of the compute.

The runner asks for layers in increasing order and may skip some. When it asks for layer
i, this source makes sure layers i .. i + prefetch are being read on the store's background
threads, waits for layer i only, and drops reads of layers it has passed. Right after
construction layers 0 .. prefetch are already on their way, so while the runner computes
layer i of the request, the reads of layer i + 1 of every chunk run in parallel.

Decoding (dequantizing, for quantized entries) happens on those background
threads too, on the engine's device, so it hides behind the compute like the read itself.

A layer that fails its checksum is never returned: the source reports the entry as corrupt
(the store removes it) and, if it was given a `fallback`, switches to the fallback's KV
(the chunk recomputed) for that and every later layer; without one it raises CorruptEntry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from app.store.base import EntryReader
from app.store.entry import CorruptEntry, decode_layer, value_rounding
from engine.kv import ChunkKV, ValueRounding

log = logging.getLogger(__name__)


@dataclass
class LoadStats:
    """Reading time of the layers the caller used, and how long it waited for them.

    `hidden_share(load_s, wait_s)` is the share of load time hidden behind compute. Layers
    read ahead but then skipped by the runner count in `layers_wasted` only.
    """

    load_s: float = 0.0
    wait_s: float = 0.0
    layers_read: int = 0
    layers_wasted: int = 0
    fell_back: bool = False


def hidden_share(load_s: float, wait_s: float) -> float:
    """The share of `load_s` (time spent reading layers) hidden behind compute: 1 - wait_s /
    load_s, clamped to [0, 1]; 0 when nothing was read.

    It is a fraction of the load time, so it is kept one. The raw difference can go below
    0: `wait_s` is timed on the caller's thread and also covers the time a read sits queued
    for a loader thread and the hand-off back, which `load_s` does not, so on a busy machine
    the waiting can exceed the reading itself — none of the load was hidden then: 0. (Timed
    waits are never negative, so only the lower clamp ever acts on measured values.)
    """
    if load_s <= 0.0:
        return 0.0
    return min(max(1.0 - wait_s / load_s, 0.0), 1.0)


class LazyChunkKV:
    """KVSource over an open store entry. Call `close()` when the request is done with it."""

    def __init__(
        self,
        reader: EntryReader,
        executor: ThreadPoolExecutor,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefetch: int = 2,
        fallback: Callable[[], ChunkKV] | None = None,
        on_corrupt: Callable[[str], None] | None = None,
    ):
        meta = reader.meta
        self.num_tokens = meta.num_tokens
        self.base_position = meta.base_position
        self.fingerprint = meta.fingerprint
        self.prefix_digest = meta.prefix_digest
        self.context = meta.context
        self.lead = meta.lead
        self.num_layers = meta.num_layers
        self._meta = meta
        self.stats = LoadStats()
        self._reader, self._executor = reader, executor
        self._dtype, self._device = dtype, torch.device(device)
        self._prefetch = prefetch
        self._fallback, self._on_corrupt = fallback, on_corrupt
        self._fallback_kv: ChunkKV | None = None
        self._futures: dict[int, Future[tuple[torch.Tensor, float]]] = {}
        self._closed = False
        self._schedule(0)

    @property
    def value_rounding(self) -> ValueRounding | None:
        """The codec's rounding of V, until the source falls back to recomputed (exact) KV."""
        return None if self._fallback_kv is not None else value_rounding(self._meta)

    def layer(self, index: int) -> torch.Tensor:
        """Layer `index`: [2, kv_heads, tokens, head_dim] in the engine's dtype and device."""
        if self._closed:
            raise RuntimeError("layer() on a closed LazyChunkKV")
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range for {self.num_layers} layers")
        if self._fallback_kv is not None:
            return self._fallback_kv.layer(index)
        self._schedule(index)
        future = self._futures.pop(index)
        self._drop_before(index)
        started = time.perf_counter()
        try:
            tensor, read_s = future.result()
        except CorruptEntry as exc:
            return self._switch_to_fallback(index, exc)
        finally:
            self.stats.wait_s += time.perf_counter() - started
        self.stats.load_s += read_s
        self.stats.layers_read += 1
        return tensor

    def close(self) -> None:
        """Cancel reads not started, wait for running ones, release the reader. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for future in self._futures.values():
            future.cancel()
        wait(list(self._futures.values()))
        self._futures.clear()
        self._reader.close()

    # -- internals -----------------------------------------------------------------------------

    def _schedule(self, first: int) -> None:
        last = min(first + self._prefetch, self.num_layers - 1)
        for index in range(first, last + 1):
            if index not in self._futures:
                self._futures[index] = self._executor.submit(self._read, index)

    def _drop_before(self, index: int) -> None:
        """Layers below `index` were skipped by the runner: do not read them."""
        for passed in [i for i in self._futures if i < index]:
            if not self._futures.pop(passed).cancel():
                self.stats.layers_wasted += 1  # already read or being read

    def _read(self, index: int) -> tuple[torch.Tensor, float]:
        """Layer `index` decoded for the engine, and the seconds it took (background thread)."""
        started = time.perf_counter()
        stored = self._reader.layer(index)  # verified payload of the entry's codec
        tensor = decode_layer(self._meta, stored, index, self._dtype, self._device)
        return tensor, time.perf_counter() - started

    def _switch_to_fallback(self, index: int, exc: CorruptEntry) -> torch.Tensor:
        log.warning(
            "stored KV layer %d is corrupt (%s); %s",
            index,
            exc,
            "recomputing the chunk" if self._fallback else "no fallback",
        )
        if self._on_corrupt is not None:
            self._on_corrupt(str(exc))
        if self._fallback is None:
            raise exc
        for future in self._futures.values():
            future.cancel()
        self.stats.fell_back = True
        self._fallback_kv = self._fallback()
        return self._fallback_kv.layer(index)
