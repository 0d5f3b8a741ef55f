"""KV codecs: how a chunk's KV is kept in the store, and how one layer is decoded back.

A codec turns a layer [2, kv_heads, tokens, head_dim] (K then V) into its stored payload
and back. Float codecs (`float16`, `bfloat16`, `float32`) store the layer as it is, in that
dtype. Quantized codecs (`int8`, `int4`, `k4v3`) follow KIVI (arXiv 2402.02750): keys are
quantized per channel (each (head, dim) channel over groups of `key_group` tokens: key
outliers sit in fixed channels, so a channel's range is tight), values per token (each
(head, token) row over its head_dim channels). Both are asymmetric min/max with a float16
scale and minimum. A quantized layer is one flat uint8 payload:

    [K scale][K min][V scale][V min][K codes][V codes]      (float16 sections first: aligned)

| codec  | key bits | key group | value bits |
|--------|----------|-----------|------------|
| `int8` | 8        | 64        | 8          |
| `int4` | 4        | 64        | 4          |
| `k4v3` | 4        | 128       | 3          |

`k4v3` is mixed precision: keys keep 4 bits because their error goes through the softmax
(KIVI's sensitive half); values drop to 3 bits, and the longer key group halves the keys'
scale overhead. Codes are packed little-endian (`pack_codes`): 4-bit two per byte, low
nibble first; 3-bit eight per 3 bytes. Decoding is a few element-wise ops on the device the
layer goes to, so entries travel and sit in every tier at their stored size.

Payload bytes per token (SmolLM2: 30 layers, 3 KV heads, head_dim 64, 256-token chunks;
`kvmosaic bench store` prints the table): float16 23,040; int8 12,240 (0.53×); int4 6,480
(0.28×: 4-bit codes plus the float16 scales and minimums); k4v3 5,580 (0.242×; 5,624 =
0.244× at 206 tokens, where the last key group is partial).

`h4v3` (`rotated.py`) rotates K and V by a Hadamard matrix before quantizing per token: the
same 4 / 3 bits at 0.25x float16 with a third of `k4v3`'s fidelity cost. `h4v3c` splits each
check layer's bits toward V; `ch4v3` and `ch4v3c` centre the keys per channel first (5,625
B/token = 0.244x at 256 tokens), with the least fidelity cost measured.

This module neither serializes nor checksums (`codec.py` does); it is pure tensor math.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

# Tokens per key quantization group of int8 / int4 (KIVI uses 32-128); a chunk's last group may be shorter.
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
    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype,
                     layer: int) -> torch.Tensor:
        """Layer number `layer`'s payload decoded (a codec may code layers differently)."""

    @abstractmethod
    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        """V rows [..., head_dim] of layer number `layer` as this codec would store and decode
        them (same dtype and device): what a cached V row reads back as, had these values been
        stored. Every codec here codes V per (head, token) row, so rows round independently
        of each other."""

    def layer_bytes(self, layer_shape: LayerShape) -> int:
        return math.prod(self.payload_shape(layer_shape)) * self.payload_dtype.itemsize

    def decode(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype) -> torch.Tensor:
        """Every layer: [layers, 2, kv_heads, tokens, head_dim]."""
        return torch.stack([self.decode_layer(payload[i], layer_shape, dtype, i) for i in range(payload.shape[0])])


class FloatCodec(KVCodec):
    lossy = False

    def __init__(self, name: str):
        self.name, self.payload_dtype = name, FLOAT_CODECS[name]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return tuple(layer_shape)

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.detach().to(device="cpu", dtype=self.payload_dtype).contiguous()

    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype,
                     layer: int) -> torch.Tensor:
        return payload.to(dtype)

    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        return values.to(self.payload_dtype).to(values.dtype)


class QuantCodec(KVCodec):
    """KIVI-style asymmetric quantization: keys to `key_bits` per channel over `key_group`
    tokens, values to `value_bits` per token (1 to 8 bits each); see the module docstring."""

    payload_dtype = torch.uint8
    lossy = True

    def __init__(self, name: str, key_bits: int, value_bits: int, key_group: int = KEY_GROUP):
        if key_group < 1:
            raise ValueError("key_group must be >= 1")
        packing(key_bits), packing(value_bits)  # ValueError unless 1-8 bits
        self.name, self.key_bits, self.value_bits, self.key_group = name, key_bits, value_bits, key_group

    # -- sizes ---------------------------------------------------------------------------------

    def _sections(self, layer_shape: LayerShape) -> list[int]:
        """Byte sizes of [K scale, K min, V scale, V min, K codes, V codes]."""
        _, heads, tokens, dim = layer_shape
        key_params = heads * -(-tokens // self.key_group) * dim * 2
        value_params = heads * tokens * 2
        count = heads * tokens * dim
        return [key_params, key_params, value_params, value_params,
                packed_bytes(count, self.key_bits), packed_bytes(count, self.value_bits)]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        return (sum(self._sections(layer_shape)),)

    # -- encode --------------------------------------------------------------------------------

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        kv = kv.detach().to(device="cpu", dtype=torch.float32)  # [layers, 2, heads, tokens, dim]
        layers, _, heads, tokens, dim = kv.shape
        key_levels, value_levels = (1 << self.key_bits) - 1, (1 << self.value_bits) - 1
        keys = _token_groups(kv[:, 0], self.key_group)  # [layers, heads, groups, group, dim]
        k_min, k_scale = _range(keys.amin(dim=3), keys.amax(dim=3), key_levels)  # [layers, heads, groups, dim]
        k_codes = _codes(keys, k_min[:, :, :, None], k_scale[:, :, :, None], key_levels)
        k_codes = k_codes.reshape(layers, heads, -1, dim)[:, :, :tokens]  # drop the padded rows
        v_min, v_scale, v_codes = self._quantize_values(kv[:, 1])  # [layers, heads, tokens], codes [..., dim]
        return join_payload(layers, (k_scale, k_min, v_scale, v_min), (k_codes, self.key_bits),
                            (v_codes, self.value_bits))

    def _quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float16 minimum and scale [...] and uint8 codes [..., dim] of float32 rows [..., dim]."""
        levels = (1 << self.value_bits) - 1
        v_min, v_scale = _range(values.amin(dim=-1), values.amax(dim=-1), levels)
        return v_min, v_scale, _codes(values, v_min[..., None], v_scale[..., None], levels)

    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        v_min, v_scale, v_codes = self._quantize_values(values.float())
        dtype = values.dtype  # decode_layer's arithmetic, in the dtype it decodes to
        return torch.addcmul(v_min.to(dtype)[..., None], v_codes.to(dtype), v_scale.to(dtype)[..., None])

    # -- decode --------------------------------------------------------------------------------

    def decode_layer(self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype,
                     layer: int) -> torch.Tensor:
        _, heads, tokens, dim = layer_shape
        parts = split_payload(payload, self._sections(layer_shape), f"{self.name} payload", layer_shape)
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
        values = torch.addcmul(v_min.view(heads, tokens, 1), v_codes.to(dtype), v_scale.view(heads, tokens, 1))
        return torch.stack([keys, values])  # [2, heads, tokens, dim]


def join_payload(layers: int, params: tuple[torch.Tensor, ...], keys: tuple[torch.Tensor, int],
                 values: tuple[torch.Tensor, int]) -> torch.Tensor:
    """[layers, bytes] uint8: the float16 `params` (K scale, K min, V scale, V min) as bytes,
    then the K and V codes (each `(codes, bits)`) packed, layer by layer."""
    payload = [p.reshape(layers, -1).view(torch.uint8) for p in params]
    payload += [pack_codes(codes.reshape(layers, -1), bits) for codes, bits in (keys, values)]
    return torch.cat(payload, dim=1).contiguous()


def split_payload(payload: torch.Tensor, sections: list[int], what: str, layer_shape: LayerShape) -> list[torch.Tensor]:
    """One layer's flat payload cut into `sections` (byte sizes); ValueError when it does not fit."""
    if payload.dim() != 1 or payload.numel() != sum(sections):
        raise ValueError(f"{what} of shape {tuple(payload.shape)} does not fit layer {layer_shape}")
    ends = torch.tensor(sections).cumsum(0).tolist()
    return [payload[start:end] for start, end in zip([0] + ends[:-1], ends)]


def _range(low: torch.Tensor, high: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 minimum and scale; a constant group gets scale 1 (its codes are all 0).

    Codes are computed against these rounded values, so decoding sees what encoding
    assumed; float16's relative rounding (2^-11) moves the top code by < 0.13 of a step.
    """
    low16 = low.to(torch.float16)
    scale = (high - low16.float()) / levels
    return low16, torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)


def _codes(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    return ((x - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)


# -- bit packing ---------------------------------------------------------------------------------

# bits per code -> (codes per word, bytes per word): a word is the smallest whole number of
def packing(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word): the shortest run of whole bytes that holds a whole
    number of `bits`-bit codes (4-bit: 2 in 1 byte; 3-bit: 8 in 3; 5-bit: 8 in 5)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codes are 1 to 8 bits wide; got {bits}")
    common = math.gcd(8, bits)
    return 8 // common, bits // common


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of `count` codes of `bits` bits packed (a last partial word is padded)."""
    per_word, word_bytes = packing(bits)
    return -(-count // per_word) * word_bytes


def _word_dtype(word_bytes: int) -> torch.dtype:
    """The integer type that holds a word: uint8 for one byte, else int32 up to 3 bytes and
    int64 above (a 5-byte word needs 40 bits)."""
    return torch.uint8 if word_bytes == 1 else torch.int32 if word_bytes <= 3 else torch.int64


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] uint8 codes < 2**bits -> [rows, packed_bytes(n, bits)] uint8.

    Little-endian: code i of a word takes bits [i*bits, (i+1)*bits) of the word and byte j
    of the word holds its bits [8j, 8j+8); a last partial word is padded with zero codes.
    4-bit is thus low nibble first, and 3-bit packs 8 codes into 3 bytes.
    """
    per_word, word_bytes = packing(bits)
    if per_word == 1:
        return codes
    rows = codes.shape[0]
    pad = -codes.shape[1] % per_word
    if pad:
        codes = torch.cat([codes, codes.new_zeros(rows, pad)], dim=1)
    dtype = _word_dtype(word_bytes)
    shifts = torch.arange(0, per_word * bits, bits, dtype=dtype, device=codes.device)
    words = (codes.view(rows, -1, per_word).to(dtype) << shifts).sum(-1, dtype=dtype)  # disjoint bits: sum == or
    if word_bytes == 1:
        return words
    byte_shifts = torch.arange(0, 8 * word_bytes, 8, dtype=dtype, device=codes.device)
    return ((words[..., None] >> byte_shifts) & 0xFF).to(torch.uint8).view(rows, -1)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of `pack_codes` for one row: [packed_bytes(count, bits)] uint8 -> [count]
    uint8 codes, on `packed`'s device."""
    per_word, word_bytes = packing(bits)
    if per_word == 1:
        return packed[:count]
    words = packed
    if word_bytes > 1:  # little-endian bytes -> integer words
        columns = packed.view(-1, word_bytes).to(_word_dtype(word_bytes))
        words = columns[:, 0]
        for j in range(1, word_bytes):
            words = words | (columns[:, j] << 8 * j)
    # code i is bits [i*bits, (i+1)*bits) of its word; the top code has nothing above it to mask
    # (one op per code position, not a broadcast shift: 2x faster for uint8 on CPU)
    mask, top = (1 << bits) - 1, bits * (per_word - 1)
    codes = [(words >> bits * i if i else words) & mask for i in range(per_word - 1)] + [words >> top]
    return torch.stack(codes, dim=1).view(-1)[:count].to(torch.uint8)  # [words, per_word] -> [count]


def _token_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[layers, heads, tokens, dim] -> [layers, heads, groups, group, dim]; the last group is
    padded by repeating its last token (which changes neither its minimum nor its maximum)."""
    layers, heads, tokens, dim = x.shape
    pad = -tokens % group
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(layers, heads, pad, dim)], dim=2)
    return x.view(layers, heads, -1, group, dim)


CODECS: dict[str, KVCodec] = {name: FloatCodec(name) for name in FLOAT_CODECS}
CODECS.update({"int8": QuantCodec("int8", 8, 8), "int4": QuantCodec("int4", 4, 4),
               "k4v3": QuantCodec("k4v3", 4, 3, key_group=128)})

# Registered here so that `get_codec` knows it; `rotated` imports this module's helpers, all
# defined above this line.
from app.store.rotated import RotatedQuantCodec  # noqa: E402

CODECS["h4v3"] = RotatedQuantCodec("h4v3", 4, 3)
# the same bytes, split for the engine's default check layers (1, 2, 6), whose stored V the
# selection compares with fresh V: 5-bit V there (6: 4-bit), paid for by those layers' keys
CODECS["h4v3c"] = RotatedQuantCodec("h4v3c", 4, 3, layer_bits={1: (2, 5), 2: (2, 5), 6: (3, 4)})
CODECS["ch4v3"] = RotatedQuantCodec("ch4v3", 4, 3, centre_keys=True)
CODECS["ch4v3c"] = RotatedQuantCodec("ch4v3c", 4, 3, layer_bits={1: (2, 5), 2: (2, 5), 6: (3, 4)}, centre_keys=True)


def get_codec(name: str) -> KVCodec:
    """The codec registered under `name`; ValueError naming the known ones otherwise."""
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; use one of {', '.join(CODECS)}")
    return CODECS[name]
