"""Bit packing of quantization codes, and the flat payload layout shared by the quantized codecs.

Codes are packed little-endian: 4-bit two per byte, low nibble first; 3-bit eight per 3 bytes.
A quantized layer is one flat uint8 payload, its float16 parameters first (aligned), then the
packed K and V codes (`join_payload` / `split_payload`). Also the asymmetric min/max range
helpers both quantized families use (`minmax_range`, `quantize`).
"""

from __future__ import annotations

import math

import torch

from app.store.codecs.base import LayerShape


def join_payload(
    layers: int,
    params: tuple[torch.Tensor, ...],
    keys: tuple[torch.Tensor, int],
    values: tuple[torch.Tensor, int],
) -> torch.Tensor:
    """[layers, bytes] uint8: the float16 `params` (K scale, K min, V scale, V min) as bytes,
    then the K and V codes (each `(codes, bits)`) packed, layer by layer."""
    payload = [p.reshape(layers, -1).view(torch.uint8) for p in params]
    payload += [pack_codes(codes.reshape(layers, -1), bits) for codes, bits in (keys, values)]
    return torch.cat(payload, dim=1).contiguous()


def split_payload(
    payload: torch.Tensor, sections: list[int], what: str, layer_shape: LayerShape
) -> list[torch.Tensor]:
    """One layer's flat payload cut into `sections` (byte sizes); ValueError if it does not fit."""
    if payload.dim() != 1 or payload.numel() != sum(sections):
        raise ValueError(f"{what} of shape {tuple(payload.shape)} does not fit layer {layer_shape}")
    ends = torch.tensor(sections).cumsum(0).tolist()
    return [payload[start:end] for start, end in zip([0] + ends[:-1], ends)]


def minmax_range(
    low: torch.Tensor, high: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 minimum and scale; a constant group gets scale 1 (its codes are all 0).

    Codes are computed against these rounded values, so decoding sees what encoding
    assumed; float16's relative rounding (2^-11) moves the top code by < 0.13 of a step.
    """
    low16 = low.to(torch.float16)
    scale = (high - low16.float()) / levels
    return low16, torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)


def quantize(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    return ((x - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)


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
    words = (codes.view(rows, -1, per_word).to(dtype) << shifts).sum(
        -1, dtype=dtype
    )  # disjoint bits: sum == or
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
    codes = [(words >> bits * i if i else words) & mask for i in range(per_word - 1)] + [
        words >> top
    ]
    return (
        torch.stack(codes, dim=1).view(-1)[:count].to(torch.uint8)
    )  # [words, per_word] -> [count]
