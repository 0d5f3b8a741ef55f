"""The bytes a decode step reads: the model's weights as loaded, or a smaller copy for decode.

A decode step reads every weight once per step, whatever the number of requests it serves, so
its time follows the weights' bytes (docs/benchmarks/decode.md). `decode_weights` names the
format the native decode step (engine/model/native_step.py) reads; prefill always runs on the
model's own weights, so cached KV, fidelity of prefill and the fingerprint do not depend on it:

- `auto` (the default): the first of `int4`, `int8`, `bfloat16` that holds every weight
  exactly, else `model`: fewer bytes only where the decode stays `model`'s bit for bit;
- `model`: the model's own tensors (float32 or bfloat16), read in place, no copy;
- `bfloat16`: a bfloat16 copy of every linear layer and lm_head (exact for weights that were
  bfloat16 to begin with);
- `int8`: blocks of 32 weights along the input, 8-bit codes with a float16 scale (and a float16
  minimum where a block needs one) per block;
- `int4`: the same blocks with 4-bit codes, scale and minimum (GGUF's Q4_1 layout); lm_head in
  `int8` (as GGUF files keep their output layer at 8 bits or more).

Quantizing first looks for the block's own grid: weights that were dequantized from GGUF blocks
(the embedded SmolLM2 is Q4_1 layers and a Q8_0 embedding; Q4_0 and Q8_0 layers alike) are
recovered code for code, so the kernel computes the very float32 weights of the checkpoint
(value = scale * code + minimum, rounded as GGUF's dequantization rounds it) and the decode is
bit-for-bit that of `model`. A block with no such grid is rounded to the nearest code (symmetric
for `int8`, between its minimum and maximum for `int4`), which changes its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import DECODE_WEIGHTS

BLOCK = 32  # weights per block along the input (GGUF's Q4_0/Q4_1/Q8_0 block)
# kvm_matrix.format in engine/cpu/decode_step.c
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
# float16 candidates around an estimated scale: the rounded estimate and its neighbours
_NEIGHBOURS = (0, -1, 1, -2, 2)


@dataclass(frozen=True)
class PackedMatrix:
    """One weight matrix [rows, cols] as the kernel reads it (`kvm_matrix`).

    data: float32 / bfloat16 [rows, cols]; int8 [rows, cols]; int4 [rows, cols / 2] (byte j of a
    block holds code j in its low nibble, code j + 16 in its high one). scales / mins: float16
    [rows, cols / 32] (mins None: none). `exact`: the share of blocks whose weights are the
    source's exactly."""

    format: str
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    exact: float = 1.0

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def cols(self) -> int:
        return int(self.data.shape[1]) * (2 if self.format == "int4" else 1)

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scales, self.mins]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights the kernel computes with [rows, cols] (for tests and checks)."""
        if self.format in ("float32", "bfloat16"):
            return self.data.float()
        codes = _unpack_int4(self.data) if self.format == "int4" else self.data.float()
        blocks = codes.reshape(self.rows, -1, BLOCK)
        assert self.scales is not None
        values = self.scales.float()[..., None] * blocks
        if self.mins is not None:
            values = values + self.mins.float()[..., None]
        return values.reshape(self.rows, self.cols)


# what `auto` tries, fewest bytes first: the first whose every block is exact is taken
AUTO_CANDIDATES = ("int4", "int8", "bfloat16")


def needs_native_step(mode: str) -> bool:
    """Whether decode weights `mode` can only be read by the native step (`model` and `auto`
    decode on the twin where it cannot run)."""
    return mode not in ("model", "auto")


def formats_for(mode: str, dtype: torch.dtype) -> tuple[str, str]:
    """(linear layers' format, lm_head's format) of decode weights `mode` for a model in `dtype`
    (`auto` reads as `model` until the native step resolves it)."""
    if mode not in DECODE_WEIGHTS:
        raise ValueError(f"unknown decode weights {mode!r}; use one of {', '.join(DECODE_WEIGHTS)}")
    if mode in ("model", "auto"):
        own = str(dtype).removeprefix("torch.")
        return own, own
    return (mode, "int8") if mode == "int4" else (mode, mode)


def pack(weight: torch.Tensor, format: str, rows_at_once: int = 4096) -> PackedMatrix:
    """`weight` [rows, cols] (cols a multiple of 32) in `format`; float32 / bfloat16 in the
    weight's own dtype are the tensor itself, no copy. Quantized `rows_at_once` rows at a time
    (bounded scratch memory)."""
    if format in ("float32", "bfloat16"):
        dtype = getattr(torch, format)
        data = weight if weight.dtype == dtype and weight.is_contiguous() else weight.to(dtype)
        exact = 1.0 if data is weight else float(torch.equal(data.float(), weight.float()))
        return PackedMatrix(format, data.detach().contiguous(), exact=exact)
    if format not in ("int8", "int4"):
        raise ValueError(f"unknown weight format {format!r}")
    if weight.shape[1] % BLOCK:
        raise ValueError(
            f"{format} weights need a multiple of {BLOCK} inputs, not {weight.shape[1]}"
        )
    quantize = _int8 if format == "int8" else _int4
    parts = [
        quantize(
            weight[start : start + rows_at_once]
            .detach()
            .float()
            .reshape(-1, weight.shape[1] // BLOCK, BLOCK)
        )
        for start in range(0, weight.shape[0], rows_at_once)
    ]
    data, scales, mins, found = (torch.cat([part[i] for part in parts]) for i in range(4))
    return PackedMatrix(
        format,
        data,
        scales.half(),
        mins.half() if format == "int4" or bool((mins != 0).any()) else None,
        float(found.float().mean()),
    )


Quantized = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]  # data, scales, mins, found


def _int8(blocks: torch.Tensor) -> Quantized:
    """Signed 8-bit codes: each block's own grid where it has one (Q8_0: scale ~ max|w| / 127;
    Q4_0: ~ max|w| / 8; Q4_1, with its minimum: ~ (max - min) / 15), else symmetric rounding."""
    amax = blocks.abs().amax(-1)
    low, high = blocks.amin(-1), blocks.amax(-1)
    zero = torch.zeros_like(amax)
    grids = [  # (scale estimate, minimum, lowest code, highest code)
        (amax / 127, zero, -127, 127),
        (amax / 8, zero, -8, 8),
        ((high - low) / 15, low, 0, 15),
    ]
    scales, mins, codes, found = _recover(blocks, grids)
    rest = ~found
    if bool(rest.any()):
        scale = _half(amax[rest] / 127)
        scales[rest], mins[rest] = scale, 0.0
        codes[rest] = _codes(blocks[rest], scale, zero[rest], -127, 127)
    return codes.to(torch.int8).reshape(blocks.shape[0], -1), scales, mins, found


def _int4(blocks: torch.Tensor) -> Quantized:
    """Unsigned 4-bit codes with a scale and a minimum (Q4_1): each block's own grid where it has
    one, else rounding between its minimum and maximum."""
    low, high = blocks.amin(-1), blocks.amax(-1)
    scales, mins, codes, found = _recover(blocks, [((high - low) / 15, low, 0, 15)])
    rest = ~found
    if bool(rest.any()):
        minimum = _half(low[rest])
        scale = _half((high[rest] - minimum).clamp_min(0) / 15)
        scales[rest], mins[rest] = scale, minimum
        codes[rest] = _codes(blocks[rest], scale, minimum, 0, 15)
    nibbles = codes.to(torch.uint8)
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # byte j: codes j and j + 16
    return packed.reshape(blocks.shape[0], -1), scales, mins, found


def _unpack_int4(data: torch.Tensor) -> torch.Tensor:
    blocks = data.reshape(data.shape[0], -1, BLOCK // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)
    return codes.reshape(data.shape[0], -1).float()


def _recover(
    blocks: torch.Tensor, grids: list[tuple[torch.Tensor, torch.Tensor, int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block, the first grid (a float16 scale near its estimate, a float16 minimum, codes in
    [lowest, highest]) whose values scale * code + minimum, each rounded to float32 as GGUF's
    dequantization computes them, are the block's weights exactly. Returns scales, minimums,
    codes (as floats) and which blocks were found; the others' entries are zeros. A grid whose
    rounded estimate fits no block is not searched further."""
    found = torch.zeros(blocks.shape[:-1], dtype=torch.bool)
    scales = torch.zeros(blocks.shape[:-1])
    mins = torch.zeros(blocks.shape[:-1])
    codes = torch.zeros(blocks.shape)
    for estimate, minimum, lowest, highest in grids:
        for step in _NEIGHBOURS:
            todo = (~found).nonzero(as_tuple=True)
            if not todo[0].numel():
                return scales, mins, codes, found
            block, low = blocks[todo], minimum[todo]
            low = torch.where(_half(low) == low, low, torch.nan)  # a minimum float16 cannot hold
            scale = (estimate[todo].half().view(torch.int16) + step).view(torch.float16).float()
            scale = torch.where(scale > 0, scale, 0.0)
            candidate = _codes(block, scale, low, lowest, highest)
            exact = ((scale[..., None] * candidate + low[..., None]) == block).all(-1)
            hit = tuple(index[exact] for index in todo)
            found[hit], scales[hit], mins[hit], codes[hit] = (
                True,
                scale[exact],
                low[exact],
                candidate[exact],
            )
            if step == 0 and not bool(exact.any()):
                break
    return scales, mins, codes, found


def _codes(
    blocks: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, lowest: int, highest: int
) -> torch.Tensor:
    """Nearest codes of the weights on the grid (0 where the scale is 0)."""
    safe = torch.where(scale > 0, scale, 1.0)[..., None]
    codes = torch.round((blocks - minimum[..., None]) / safe).clamp(lowest, highest)
    return torch.where(scale[..., None] > 0, codes, 0.0).nan_to_num(0.0)


def _half(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float16 and back (the precision scales and minimums are stored in)."""
    return x.half().float()
