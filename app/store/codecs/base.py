"""The codec contract: how a chunk's KV is kept in the store, and how one layer is decoded back.

A codec turns a layer [2, kv_heads, tokens, head_dim] (K then V) into its stored payload and
back. Float codecs store the layer as it is, in their dtype; quantized ones as one flat uint8
payload per layer. A codec neither serializes nor checksums (`app/store/codec.py` does): it
is pure tensor math, and its bytes per token are printed by `kvmosaic bench store`
(docs/benchmarks/codecs.md).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

LayerShape = tuple[int, int, int, int]  # [2, kv_heads, tokens, head_dim]


class KVCodec(ABC):
    """Encodes whole entries ([layers, 2, kv_heads, tokens, head_dim]) and decodes one layer.

    `encode` accepts any float tensor on any device and returns the payload on the CPU:
    [layers, *payload_shape(layer_shape)] in `payload_dtype`, contiguous. `decode_layer`
    takes one layer's payload (on the device wanted) and returns [2, kv_heads, tokens,
    head_dim] in `dtype` on that device; it never mutates its input.
    """

    name: str
    payload_dtype: torch.dtype
    lossy: bool

    @abstractmethod
    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]: ...

    @abstractmethod
    def encode(self, kv: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode_layer(
        self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype, layer: int
    ) -> torch.Tensor:
        """Layer number `layer`'s payload decoded (a codec may code layers differently)."""

    @abstractmethod
    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        """V rows [..., head_dim] of layer number `layer` as this codec would store and decode
        them (same dtype and device): what a cached V row reads back as, had these values been
        stored. Every codec here codes V per (head, token) row, so rows round independently
        of each other."""

    def layer_bytes(self, layer_shape: LayerShape) -> int:
        return math.prod(self.payload_shape(layer_shape)) * self.payload_dtype.itemsize

    def decode(
        self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype
    ) -> torch.Tensor:
        """Every layer: [layers, 2, kv_heads, tokens, head_dim]."""
        return torch.stack(
            [self.decode_layer(payload[i], layer_shape, dtype, i) for i in range(payload.shape[0])]
        )
