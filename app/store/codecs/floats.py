"""Float codecs (`float16`, `bfloat16`, `float32`): the layer as it is, in that dtype. Exact
only for `float32` and for KV already in the codec's dtype; never marked lossy (their rounding
is below the model's own)."""

from __future__ import annotations

import torch

from app.store.codecs.base import KVCodec, LayerShape

FLOAT_CODECS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class FloatCodec(KVCodec):
    lossy = False

    def __init__(self, name: str):
        self.name, self.payload_dtype = name, FLOAT_CODECS[name]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return tuple(layer_shape)

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.detach().to(device="cpu", dtype=self.payload_dtype).contiguous()

    def decode_layer(
        self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype, layer: int
    ) -> torch.Tensor:
        return payload.to(dtype)

    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        return values.to(self.payload_dtype).to(values.dtype)
