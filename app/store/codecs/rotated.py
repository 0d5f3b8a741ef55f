"""`h4v3` and kin: 4-bit keys and 3-bit values after a Hadamard rotation, per token, range clipped.

KIVI's per-channel keys (`k4v3`) keep a key outlier channel from flooding the others, but at
3 bits a value row's range is still set by its largest channel. Rotating each head's rows by
the orthonormal Hadamard matrix first (QuaRot, arXiv 2404.00456) spreads every outlier over
all channels, so a rotated row is close to Gaussian and one range per row fits it; the
rotation is undone after dequantizing (H is symmetric and orthonormal: H @ H = I), so
attention sees K and V in their own basis (and RoPE shifts still apply to K). Each row's range
is then shrunk about its centre by the factor in `CLIPS` with the least squared error: a few
clipped extremes cost less than a coarse step for every other element.

Payload per layer, packed like the KIVI codecs':

    [K scale][K min][V scale][V min][K codes][V codes]      (float16 per (head, token) row)

`h4v3c` spends the same bytes per layer otherwise on the check layers (`layer_bits`: more bits
for V there, whose stored copy the selection compares with fresh V). `ch4v3` / `ch4v3c`
(`centre_keys`) subtract each (head, channel)'s mean over the chunk from K first and code the
rest symmetrically about zero: keys carry large offsets per channel, which rotated become part
of every row's range. Why these codecs, and what each costs: docs/benchmarks/codecs.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

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

# Range shrink factors tried per row; 1.0 is plain min/max. Finer grids measured no better.
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [n, n] (float32); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim; got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class RotatedQuantCodec(KVCodec):
    """Hadamard-rotated rows of K and V, each quantized per (head, token) row to `key_bits` /
    `value_bits` with the least-error clipped range of `CLIPS`; see the module docstring.

    `layer_bits` {layer: (key bits, value bits)} codes some layers with another split of the
    same bits: each pair must add up to key_bits + value_bits, so every layer's payload has
    the same size (the entry format's layers are all alike) and the codec's bytes per token
    do not change.

    `centre_keys` subtracts each (head, channel)'s mean over the chunk's tokens from K before
    quantizing (stored once per layer in float16) and codes each K row symmetrically about it
    (a scale, no minimum): keys carry large per-channel offsets, so centred K rows are close
    to zero-mean after the rotation and their range shrinks. The means cost heads x head_dim x
    2 bytes per layer and chunk, the dropped minimums 2 bytes per K row, so such an entry is
    no larger than the plain one from 64 tokens on.
    """

    payload_dtype = torch.uint8
    lossy = True

    def __init__(
        self,
        name: str,
        key_bits: int,
        value_bits: int,
        layer_bits: Mapping[int, tuple[int, int]] | None = None,
        centre_keys: bool = False,
    ):
        self.name, self.key_bits, self.value_bits = name, key_bits, value_bits
        self.centre_keys = centre_keys
        self.layer_bits = dict(layer_bits or {})
        for layer, (keys, values) in self.layer_bits.items():
            packing(keys), packing(values)  # ValueError unless 1-8 bits each
            if keys + values != key_bits + value_bits:
                raise ValueError(
                    f"layer {layer} splits {keys + values} bits; every layer of {name} "
                    f"has {key_bits + value_bits} (key + value bits), so its payload keeps its size"
                )
        self._rotations: dict[tuple[int, str], torch.Tensor] = {}

    def bits(self, layer: int) -> tuple[int, int]:
        """(key bits, value bits) of layer number `layer`."""
        return self.layer_bits.get(layer, (self.key_bits, self.value_bits))

    def _sections(self, layer_shape: LayerShape, layer: int) -> list[int]:
        """Byte sizes of one layer's [K scale, K min, V scale, V min, K codes, V codes], or with
        `centre_keys` [K scale, V scale, V min, K channel means, K codes, V codes]."""
        _, heads, tokens, dim = layer_shape
        row_params = heads * tokens * 2
        count = heads * tokens * dim
        key_bits, value_bits = self.bits(layer)
        params = [row_params] * 3 + [heads * dim * 2] if self.centre_keys else [row_params] * 4
        return params + [packed_bytes(count, key_bits), packed_bytes(count, value_bits)]

    def payload_shape(self, layer_shape: LayerShape) -> tuple[int, ...]:
        # the same for every layer: head_dim (a power of two, >= 8) makes every split a whole
        # number of bytes
        return (sum(self._sections(layer_shape, -1)),)

    def _rotation(self, dim: int, device: torch.device) -> torch.Tensor:
        key = (dim, str(device))
        if key not in self._rotations:  # a benign race: two threads build the same matrix
            self._rotations[key] = hadamard(dim).to(device)
        return self._rotations[key]

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        kv = kv.detach().to(device="cpu", dtype=torch.float32)  # [layers, 2, heads, tokens, dim]
        rotated = kv @ self._rotation(kv.shape[-1], kv.device)
        layers, _, heads, tokens, dim = kv.shape
        splits: dict[tuple[int, int], list[int]] = {}  # layers coded alike are coded together
        for layer in range(layers):
            splits.setdefault(self.bits(layer), []).append(layer)
        payload = torch.empty(
            (layers, *self.payload_shape((2, heads, tokens, dim))), dtype=torch.uint8
        )
        for (key_bits, value_bits), members in splits.items():
            index = torch.tensor(members)
            v_min, v_scale, v_codes = _quantize_rows(rotated[index, 1], value_bits)
            params: tuple[torch.Tensor, ...]
            if self.centre_keys:
                # the mean of rotated rows is the rotated mean (H is linear): centre in either basis
                k_mean = rotated[index, 0].mean(2, keepdim=True).to(torch.float16)
                k_scale, k_codes = _quantize_rows_symmetric(
                    rotated[index, 0] - k_mean.float(), key_bits
                )
                params = (k_scale, v_scale, v_min, k_mean)
            else:
                k_min, k_scale, k_codes = _quantize_rows(rotated[index, 0], key_bits)
                params = (k_scale, k_min, v_scale, v_min)
            payload[index] = join_payload(
                len(members), params, (k_codes, key_bits), (v_codes, value_bits)
            )
        return payload

    def decode_layer(
        self, payload: torch.Tensor, layer_shape: LayerShape, dtype: torch.dtype, layer: int
    ) -> torch.Tensor:
        _, heads, tokens, dim = layer_shape
        key_bits, value_bits = self.bits(layer)
        parts = split_payload(
            payload, self._sections(layer_shape, layer), f"{self.name} payload", layer_shape
        )
        count = heads * tokens * dim
        k_codes = unpack_codes(parts[4], key_bits, count).view(heads, tokens, dim).float()
        v_codes = unpack_codes(parts[5], value_bits, count).view(heads, tokens, dim)
        if self.centre_keys:
            k_scale, v_scale, v_min = (
                p.view(torch.float16).float().view(heads, tokens, 1) for p in parts[:3]
            )
            k_mean = parts[3].view(torch.float16).float().view(heads, 1, dim)
            keys = k_codes.sub_(((1 << key_bits) - 1) / 2).mul_(k_scale).add_(k_mean)
        else:
            k_scale, k_min, v_scale, v_min = (
                p.view(torch.float16).float().view(heads, tokens, 1) for p in parts[:4]
            )
            keys = torch.addcmul(k_min, k_codes, k_scale)
        rotated = torch.stack([keys, torch.addcmul(v_min, v_codes.float(), v_scale)])
        return (rotated @ self._rotation(dim, payload.device)).to(dtype)  # H is its own inverse

    def round_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        rotation = self._rotation(values.shape[-1], values.device)
        v_min, v_scale, v_codes = _quantize_rows(values.float() @ rotation, self.bits(layer)[1])
        rotated = torch.addcmul(
            v_min.float()[..., None], v_codes.float(), v_scale.float()[..., None]
        )
        return (rotated @ rotation).to(values.dtype)


def _quantize_rows_symmetric(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [..., dim], codes about zero: float16 scale [...] and uint8 codes [...,
    dim] that decode as (code - levels / 2) * scale (no code is zero: the levels straddle it),
    from the clipped range of `CLIPS` with the least squared error (the widest among equals)."""
    levels = (1 << bits) - 1
    amax = x.abs().amax(-1)
    best: tuple[torch.Tensor, torch.Tensor] | None = None  # error, scale16
    for clip in CLIPS:
        scale = (amax * (2 * clip / levels)).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale
        scale32 = scale.float()[..., None]
        codes = (x / scale32 + levels / 2).round_().clamp_(0, levels)
        error = codes.sub_(levels / 2).mul_(scale32).sub_(x).square_().sum(-1)
        if best is None:
            best = (error, scale)
            continue
        better = error < best[0]
        best = (torch.where(better, error, best[0]), torch.where(better, scale, best[1]))
    assert best is not None  # CLIPS is not empty
    scale32 = best[1].float()[..., None]
    return best[1], (x / scale32 + levels / 2).round_().clamp_(0, levels).to(torch.uint8)


def _quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of x [..., dim]: float16 minimum and scale [...] and uint8 codes [..., dim],
    from the range in `CLIPS` that reconstructs the row with the least squared error (the
    widest among equals). One pass per clip: all clips at once needs 7x the memory and runs
    slower on a CPU. The passes keep codes as floats and only each row's best range; the codes
    of that range are computed once at the end (the same values: codes are small integers)."""
    levels = (1 << bits) - 1
    low, high = x.amin(-1), x.amax(-1)
    centre, half = (low + high) / 2, (high - low) / 2
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # error, low16, scale16
    for clip in CLIPS:
        low16, scale16 = minmax_range(centre - half * clip, centre + half * clip, levels)
        low32, scale32 = low16.float()[..., None], scale16.float()[..., None]
        codes = x.sub(low32).div_(scale32).round_().clamp_(0, levels)  # as `quantize`, in float
        error = torch.addcmul(low32, codes, scale32).sub_(x).square_().sum(-1)
        if best is None:
            best = (error, low16, scale16)
            continue
        better = error < best[0]
        best = (
            torch.where(better, error, best[0]),
            torch.where(better, low16, best[1]),
            torch.where(better, scale16, best[2]),
        )
    assert best is not None  # CLIPS is not empty
    return best[1], best[2], quantize(x, best[1][..., None], best[2][..., None], levels)
