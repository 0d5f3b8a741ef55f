"""KV codecs: how a chunk's KV is kept in the store, and how one layer is decoded back.

A codec turns a layer [2, kv_heads, tokens, head_dim] (K then V) into its stored payload
and back. Float codecs (`float16`, `bfloat16`, `float32`) store the layer as it is, in that
dtype. Quantized codecs (`int8`, `int4`) follow KIVI (arXiv 2402.02750): keys are quantized
per channel (each (head, dim) channel over groups of `KEY_GROUP` tokens: key outliers sit in
fixed channels, so a channel's range is tight), values per token (each (head, token) row
over its head_dim channels). Both are asymmetric min/max with a float16 scale and minimum.
A quantized layer is one flat uint8 payload:

    [K scale][K min][V scale][V min][K codes][V codes]      (float16 sections first: aligned)

int4 codes are packed two per byte, low nibble first. Decoding is a few element-wise ops on
the device the layer goes to, so entries travel and sit in every tier at their stored size.

Payload bytes per token (SmolLM2: 30 layers, 3 KV heads, head_dim 64; `kvmosaic bench store`
prints the table): float16 23,040; int8 12,240 (0.53×); int4 6,480 (0.28×: 4-bit codes plus
the float16 scales and minimums).

This module neither serializes nor checksums (`codec.py` does); it is pure tensor math.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

# Tokens per key quantization group (KIVI uses 32-128); a chunk's last group may be shorter.
KEY_GROUP = 64
FLOAT_CODECS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

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
    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype) -> torch.Tensor: ...

    def layer_bytes(self, layer_shape: LayerShape) -> int:
        return math.prod(self.payload_shape(layer_shape)) * self.payload_dtype.itemsize

    def decode(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype) -> torch.Tensor:
        """Every layer: [layers, 2, kv_heads, tokens, head_dim]."""
        return torch.stack([self.decode_layer(payload[i], layer_shape, dtype) for i in range(payload.shape[0])])


class FloatCodec(KVCodec):
    lossy = False

    def __init__(self, name: str):
        self.name, self.payload_dtype = name, FLOAT_CODECS[name]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return tuple(layer_shape)

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.detach().to(device="cpu", dtype=self.payload_dtype).contiguous()

    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


class QuantCodec(KVCodec):
    """KIVI-style asymmetric quantization to `bits` (8 or 4) bits; see the module docstring."""

    payload_dtype = torch.uint8
    lossy = True

    def __init__(self, bits: int, key_group: int = KEY_GROUP):
        if bits not in (4, 8) or key_group < 1:
            raise ValueError("bits must be 4 or 8 and key_group >= 1")
        self.name, self.bits, self.key_group = f"int{bits}", bits, key_group
        self.levels = (1 << bits) - 1

    # -- sizes ---------------------------------------------------------------------------------

    def _sections(self, layer_shape: LayerShape) -> list[int]:
        """Byte sizes of [K scale, K min, V scale, V min, K codes, V codes]."""
        _, heads, tokens, dim = layer_shape
        key_params = heads * -(-tokens // self.key_group) * dim * 2
        value_params = heads * tokens * 2
        codes = -(-heads * tokens * dim * self.bits // 8)
        return [key_params, key_params, value_params, value_params, codes, codes]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return (sum(self._sections(layer_shape)),)

    # -- encode --------------------------------------------------------------------------------

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        kv = kv.detach().to(device="cpu", dtype=torch.float32)  # [layers, 2, heads, tokens, dim]
        layers, _, heads, tokens, dim = kv.shape
        keys = _token_groups(kv[:, 0], self.key_group)  # [layers, heads, groups, group, dim]
        k_min, k_scale = self._range(keys.amin(dim=3), keys.amax(dim=3))  # [layers, heads, groups, dim]
        k_codes = self._codes(keys, k_min[:, :, :, None], k_scale[:, :, :, None])
        k_codes = k_codes.reshape(layers, heads, -1, dim)[:, :, :tokens]  # drop the padded rows
        values = kv[:, 1]  # [layers, heads, tokens, dim]
        v_min, v_scale = self._range(values.amin(dim=3), values.amax(dim=3))  # [layers, heads, tokens]
        v_codes = self._codes(values, v_min[..., None], v_scale[..., None])
        parts = [k_scale, k_min, v_scale, v_min]
        payload = [p.reshape(layers, -1).view(torch.uint8) for p in parts]
        payload += [self._pack(k_codes.reshape(layers, -1)), self._pack(v_codes.reshape(layers, -1))]
        return torch.cat(payload, dim=1).contiguous()

    def _range(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float16 minimum and scale; a constant group gets scale 1 (its codes are all 0).

        Codes are computed against these rounded values, so decoding sees what encoding
        assumed; float16's relative rounding (2^-11) moves the top code by < 0.13 of a step.
        """
        low16 = low.to(torch.float16)
        scale = (high - low16.float()) / self.levels
        return low16, torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)

    def _codes(self, x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((x - low.float()) / scale.float()).round_().clamp_(0, self.levels).to(torch.uint8)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """[layers, n] codes -> [layers, ceil(n * bits / 8)] bytes."""
        if self.bits == 8:
            return codes
        if codes.shape[1] % 2:
            codes = torch.cat([codes, codes.new_zeros(codes.shape[0], 1)], dim=1)
        return codes[:, 0::2] | (codes[:, 1::2] << 4)

    # -- decode --------------------------------------------------------------------------------

    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype) -> torch.Tensor:
        _, heads, tokens, dim = layer_shape
        sections = self._sections(layer_shape)
        if payload.dim() != 1 or payload.numel() != sum(sections):
            raise ValueError(f"{self.name} payload of shape {tuple(payload.shape)} does not fit layer {layer_shape}")
        ends = torch.tensor(sections).cumsum(0).tolist()
        starts = [0] + ends[:-1]
        k_scale, k_min, v_scale, v_min = (payload[s:e].view(torch.float16).to(dtype)
                                          for s, e in zip(starts[:4], ends[:4]))
        count = heads * tokens * dim
        k_codes = self._unpack(payload[starts[4]:ends[4]], count).view(heads, tokens, dim)
        v_codes = self._unpack(payload[starts[5]:ends[5]], count).view(heads, tokens, dim)
        groups = -(-tokens // self.key_group)
        k_scale = k_scale.view(heads, groups, 1, dim).expand(heads, groups, self.key_group, dim)
        k_min = k_min.view(heads, groups, 1, dim).expand(heads, groups, self.key_group, dim)
        k_scale = k_scale.reshape(heads, -1, dim)[:, :tokens]
        k_min = k_min.reshape(heads, -1, dim)[:, :tokens]
        keys = torch.addcmul(k_min, k_codes.to(dtype), k_scale)
        values = torch.addcmul(v_min.view(heads, tokens, 1), v_codes.to(dtype), v_scale.view(heads, tokens, 1))
        return torch.stack([keys, values])  # [2, heads, tokens, dim]

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        if self.bits == 8:
            return packed
        return torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:count]


def _token_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[layers, heads, tokens, dim] -> [layers, heads, groups, group, dim]; the last group is
    padded by repeating its last token (which changes neither its minimum nor its maximum)."""
    layers, heads, tokens, dim = x.shape
    pad = -tokens % group
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(layers, heads, pad, dim)], dim=2)
    return x.view(layers, heads, -1, group, dim)


CODECS: dict[str, KVCodec] = {name: FloatCodec(name) for name in FLOAT_CODECS}
CODECS.update({"int8": QuantCodec(8), "int4": QuantCodec(4)})


def get_codec(name: str) -> KVCodec:
    """The codec registered under `name`; ValueError naming the known ones otherwise."""
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; use one of {', '.join(CODECS)}")
    return CODECS[name]
