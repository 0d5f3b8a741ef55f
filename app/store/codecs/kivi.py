"""KIVI codecs (`int8`, `int4`, `k4v3`; arXiv 2402.02750): keys per channel, values per token.

Keys are quantized per channel (each (head, dim) channel over groups of `key_group` tokens: key
outliers sit in fixed channels, so a channel's range is tight), values per token (each (head,
token) row over its head_dim channels). Both are asymmetric min/max with a float16 scale and
minimum. A layer's payload:

    [K scale][K min][V scale][V min][K codes][V codes]      (float16 sections first: aligned)

| codec  | key bits | key group | value bits |
|--------|----------|-----------|------------|
| `int8` | 8        | 64        | 8          |
| `int4` | 4        | 64        | 4          |
| `k4v3` | 4        | 128       | 3          |

`k4v3` is mixed precision: keys keep 4 bits because their error goes through the softmax
(KIVI's sensitive half); values drop to 3 bits, and the longer key group halves the keys'
scale overhead. Decoding is a few element-wise ops on the device the layer goes to, so entries
travel and sit in every tier at their stored size. Bytes and fidelity:
docs/benchmarks/codecs.md.
"""

from __future__ import annotations

import torch

from app.store.codecs.base import KVCodec, LayerShape
from app.store.codecs.packing import (
    join_payload,
    minmax_range,
    packed_bytes,
    packing,
    quantize,
    split_payload,
    unpack_codes,
)

# Tokens per key quantization group of int8 / int4 (KIVI uses 32-128); a chunk's last group may
# be shorter.
KEY_GROUP = 64


class QuantCodec(KVCodec):
    """KIVI-style asymmetric quantization: keys to `key_bits` per channel over `key_group`
    tokens, values to `value_bits` per token (1 to 8 bits each); see the module docstring."""

    payload_dtype = torch.uint8
    lossy = True

    def __init__(self, name: str, key_bits: int, value_bits: int, key_group: int = KEY_GROUP):
        if key_group < 1:
            raise ValueError("key_group must be >= 1")
        packing(key_bits), packing(value_bits)  # ValueError unless 1-8 bits
        self.name, self.key_bits, self.value_bits, self.key_group = (
            name,
            key_bits,
            value_bits,
            key_group,
        )

    # -- sizes ---------------------------------------------------------------------------------

    def _sections(self, layer_shape: LayerShape) -> list[int]:
        """Byte sizes of [K scale, K min, V scale, V min, K codes, V codes]."""
        _, heads, tokens, dim = layer_shape
        key_params = heads * -(-tokens // self.key_group) * dim * 2
        value_params = heads * tokens * 2
        count = heads * tokens * dim
        return [
            key_params,
            key_params,
            value_params,
            value_params,
            packed_bytes(count, self.key_bits),
            packed_bytes(count, self.value_bits),
        ]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return (sum(self._sections(layer_shape)),)

    # -- encode --------------------------------------------------------------------------------

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        kv = kv.detach().to(device="cpu", dtype=torch.float32)  # [layers, 2, heads, tokens, dim]
        layers, _, heads, tokens, dim = kv.shape
        key_levels, _value_levels = (1 << self.key_bits) - 1, (1 << self.value_bits) - 1
        keys = _token_groups(kv[:, 0], self.key_group)  # [layers, heads, groups, group, dim]
        k_min, k_scale = minmax_range(
            keys.amin(dim=3), keys.amax(dim=3), key_levels
        )  # [layers, heads, groups, dim]
        k_codes = quantize(keys, k_min[:, :, :, None], k_scale[:, :, :, None], key_levels)
        k_codes = k_codes.reshape(layers, heads, -1, dim)[:, :, :tokens]  # drop the padded rows
        v_min, v_scale, v_codes = self._quantize_values(
            kv[:, 1]
        )  # [layers, heads, tokens], codes [..., dim]
        return join_payload(
            layers,
            (k_scale, k_min, v_scale, v_min),
            (k_codes, self.key_bits),
            (v_codes, self.value_bits),
        )

    def _quantize_values(
        self, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float16 minimum and scale [...] and uint8 codes [..., dim] of float32 rows [..., dim]."""
        levels = (1 << self.value_bits) - 1
        v_min, v_scale = minmax_range(values.amin(dim=-1), values.amax(dim=-1), levels)
        return v_min, v_scale, quantize(values, v_min[..., None], v_scale[..., None], levels)

    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        v_min, v_scale, v_codes = self._quantize_values(values.float())
        dtype = values.dtype  # decode_layer's arithmetic, in the dtype it decodes to
        return torch.addcmul(
            v_min.to(dtype)[..., None], v_codes.to(dtype), v_scale.to(dtype)[..., None]
        )

    # -- decode --------------------------------------------------------------------------------

    def decode_layer(
        self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype, layer: int
    ) -> torch.Tensor:
        _, heads, tokens, dim = layer_shape
        parts = split_payload(
            payload, self._sections(layer_shape), f"{self.name} payload", layer_shape
        )
        k_scale, k_min, v_scale, v_min = (p.view(torch.float16).to(dtype) for p in parts[:4])
        count = heads * tokens * dim
        k_codes = unpack_codes(parts[4], self.key_bits, count).view(heads, tokens, dim)
        v_codes = unpack_codes(parts[5], self.value_bits, count).view(heads, tokens, dim)
        groups = -(-tokens // self.key_group)
        k_scale = k_scale.view(heads, groups, 1, dim).expand(heads, groups, self.key_group, dim)
        k_min = k_min.view(heads, groups, 1, dim).expand(heads, groups, self.key_group, dim)
        k_scale = k_scale.reshape(heads, -1, dim)[:, :tokens]
        k_min = k_min.reshape(heads, -1, dim)[:, :tokens]
        keys = torch.addcmul(k_min, k_codes.to(dtype), k_scale)
        values = torch.addcmul(
            v_min.view(heads, tokens, 1), v_codes.to(dtype), v_scale.view(heads, tokens, 1)
        )
        return torch.stack([keys, values])  # [2, heads, tokens, dim]


def _token_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[layers, heads, tokens, dim] -> [layers, heads, groups, group, dim]; the last group is
    padded by repeating its last token (which changes neither its minimum nor its maximum)."""
    layers, heads, tokens, dim = x.shape
    pad = -tokens % group
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(layers, heads, pad, dim)], dim=2)
    return x.view(layers, heads, -1, group, dim)
