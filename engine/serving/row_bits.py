"""Whether a prefill product gives a row other bits with the number of rows computed with it.

Row tiles (engine/model/row_tiles.py) run every prefill product in calls of one row count,
padding the last, because some libraries choose how to sum a row by the call's shape (MKL in
float32, oneDNN in bfloat16 on AMX: docs/benchmarks/bfloat16.md, "Row tiles"). Where no product
of the model does, the padding only costs: a short tail after a reused prefix pays a whole tile,
and tiles of 128 rows run below the kernel's peak on a small model's shapes. So at load the
engine computes every distinct linear shape of the first decoder layer, as installed (a oneDNN
layer reading its packed weight for any row count), in calls of many row counts at several
offsets, on one thread and on its own count, and compares every row with one thread's calls of
`FREE_TILE` rows (`rows_change_bits`). Only if every row matches do its prefills run untiled.

Comparing with one thread keeps the thread probe's rule (engine/serving/thread_bits.py): the
variant builder's one thread and the compute thread's count give the same bits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine.model.linear import packed_for_any_rows
from engine.model.row_tiles import FREE_TILE, ROW_TILE, by_row_tiles
from engine.serving.threads import in_own_thread

# Row counts probed: every count up to 64 (the kernels' row blocks and their remainders), then
# each side of the larger blocks, up to a whole free tile.
PROBED_ROWS = (
    *range(1, 65),
    *(95, 96, 97, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 192, 255, 256, 257),
    *(383, 384, 385, FREE_TILE - 1, FREE_TILE),
)
# Rows of the probe's input: a whole free tile and a partial one, so that the reference itself
# is the calls an untiled prefill makes.
_PROBE_ROWS = FREE_TILE + FREE_TILE // 2

Linears = dict[tuple[int, int], Callable[[torch.Tensor], torch.Tensor]]
Rows = dict[tuple[int, int], torch.Tensor]  # per linear shape


def rows_change_bits(model: PreTrainedModel, threads: int) -> bool:
    """Whether some linear layer of `model`'s first decoder layer, as installed, gives a row
    other bits in a call of some probed row count (`PROBED_ROWS`, at offsets that are and are
    not multiples of a row block, on one thread and on `threads`) than in one thread's calls of
    FREE_TILE rows. True on other devices than the CPU (not probed: their prefills keep their
    own rule). Probed once per model and thread count (engines on one model share it)."""
    if next(model.parameters()).device.type != "cpu":
        return True
    known = _VERDICTS.setdefault(model, {})
    if threads not in known:
        known[threads] = _probe(model, threads)
    return known[threads]


# model -> thread count -> verdict; a model that is dropped takes its verdicts with it
_VERDICTS: weakref.WeakKeyDictionary[PreTrainedModel, dict[int, bool]] = weakref.WeakKeyDictionary()


def _probe(model: PreTrainedModel, threads: int) -> bool:
    linears = first_layer_linears(model)
    dtype = next(model.parameters()).dtype
    inputs = _inputs(linears, dtype)
    reference = in_own_thread(lambda: _untiled(linears, inputs), threads=1)
    counts = (1,) if threads <= 1 else (1, threads)
    return not all(
        in_own_thread(lambda: _calls_match(linears, inputs, reference), threads=count)
        for count in counts
    )


def first_layer_linears(model: PreTrainedModel) -> Linears:
    """The first decoder layer's linear layers, one per (inputs, outputs) shape."""
    layer = model.model.layers[0]
    linears: Linears = {}
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        if module is not layer and weight is not None and weight.dim() == 2:
            linears.setdefault((weight.shape[1], weight.shape[0]), module)
    return linears


def _inputs(linears: Linears, dtype: torch.dtype) -> Rows:
    generator = torch.Generator().manual_seed(0)
    return {
        shape: torch.randn(_PROBE_ROWS, shape[0], generator=generator).to(dtype)
        for shape in linears
    }


def _untiled(linears: Linears, inputs: Rows) -> Rows:
    with torch.inference_mode(), packed_for_any_rows():
        return {
            shape: by_row_tiles(linear, inputs[shape], FREE_TILE, pad=False)
            for shape, linear in linears.items()
        }


def _calls_match(linears: Linears, inputs: Rows, reference: Rows) -> bool:
    """Whether every probed call's rows are the reference's, bit for bit."""
    with torch.inference_mode(), packed_for_any_rows():
        for shape, linear in linears.items():
            x, expected = inputs[shape], reference[shape]
            for rows in PROBED_ROWS:
                # offsets that are and are not multiples of the kernels' row blocks
                start = (rows * 7) % 61
                if not torch.equal(linear(x[start : start + rows]), expected[start : start + rows]):
                    return False
    return True
