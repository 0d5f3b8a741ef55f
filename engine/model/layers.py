"""A thin view over a Hugging Face Llama-family model's modules, one decoder step at a time.

The runner drives these steps itself (embed -> per layer: norm, q/k/v, RoPE, attention,
o_proj, MLP -> final norm -> lm_head) so that each layer can run on a different subset of
token rows. The model's own modules and weights do the math; nothing is reimplemented
except the glue, which mirrors `LlamaDecoderLayer.forward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch

from engine.ape import ContextReading
from engine.model.attention import QueryLayout, causal_attention
from engine.model.decode_weights import formats_for, needs_native_step
from engine.model.linear import packed_for_any_rows
from engine.model.loader import LoadedModel
from engine.model.native_step import NativeDecodeStep, native_step_unfit
from engine.model.row_tiles import FREE_TILE, by_row_tiles, row_tile_for

# The modules of a Llama-family causal LM that the stack uses. To mypy every submodule of a
# torch Module is a `Tensor | Module` attribute; these protocols state the layout that
# LlamaForCausalLM, MistralForCausalLM and Qwen2/Qwen3ForCausalLM share.


class RowModule(Protocol):
    """A row-wise module (Linear, RMSNorm, MLP): [m, in] -> [m, out]."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class TokenEmbedding(Protocol):
    weight: torch.Tensor  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor, /) -> torch.Tensor: ...


class RotaryEmbedding(Protocol):
    inv_freq: torch.Tensor  # [head_dim / 2]

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor, /
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SelfAttention(Protocol):
    """q/k/v/o projections; Qwen3 adds per-head q_norm and k_norm (looked up with hasattr)."""

    q_proj: RowModule
    k_proj: RowModule
    v_proj: RowModule
    o_proj: RowModule


class DecoderLayer(Protocol):
    self_attn: SelfAttention
    input_layernorm: RowModule
    post_attention_layernorm: RowModule
    mlp: RowModule


class DecoderBody(Protocol):
    embed_tokens: TokenEmbedding
    layers: Sequence[DecoderLayer]
    norm: RowModule
    rotary_emb: RotaryEmbedding


class CausalLM(Protocol):
    model: DecoderBody
    lm_head: RowModule


# Rows per block of a prefill layer's row-wise part (o_proj, MLP): other work may run between
# two blocks (the decode scheduler's steps), and blocks this large keep the products' speed;
# a remainder under MIN_ROW_BLOCK rows joins the block before it.
ROW_BLOCK = 512
MIN_ROW_BLOCK = 64


class DecoderStack:
    """Per-row building blocks of the decoder. Hidden rows are [m, hidden]."""

    def __init__(
        self,
        loaded: LoadedModel,
        decode_attention: str = "torch",
        decode_weights: str = "model",
        rounded_decode_weights: str | None = None,
    ):
        causal_lm = cast(CausalLM, loaded.model)
        body = causal_lm.model
        self.model = loaded.model
        self.model_dtype = loaded.dtype
        self.spec = loaded.spec
        self.embed_tokens = body.embed_tokens
        self.layers = body.layers
        self.final_norm = body.norm
        self.lm_head = causal_lm.lm_head
        self.rotary = body.rotary_emb
        attn = self.layers[0].self_attn
        self.scale = float(getattr(attn, "scaling", self.spec.head_dim**-0.5))
        # how decode steps attend: "torch" or "native", as resolved for this model
        # (engine/model/decode_attention.py; prefill never uses it)
        self.decode_attention = decode_attention
        # the whole decode step in C where it can run (engine/model/native_step.py): why not, or
        # None; `decode.native_step` builds it on the first step, on the thread that decodes
        self.native_unfit = native_step_unfit(self)
        self.decode_weights = decode_weights
        # what `auto` takes unless a narrower format is exact (known.rounded_decode_weights)
        self.rounded_decode_weights = rounded_decode_weights
        formats_for(decode_weights, self.model_dtype)  # an unknown name is refused here
        if needs_native_step(decode_weights) and self.native_unfit is not None:
            raise ValueError(
                f"decode weights {decode_weights!r} need the native decode step, which cannot run "
                f"here: {self.native_unfit}"
            )
        self.native: NativeDecodeStep | None = None
        # rows per call of a prefill's products (engine/model/row_tiles.py); decode is untiled;
        # `pad_tiles` False once `free_rows` found a row's bits its own in any call
        self.row_tile = row_tile_for(self.embed_tokens.weight.device)
        self.pad_tiles = True
        # input rows of the ids past the vocabulary (`embed`); None: there are none
        self.soft_rows: torch.Tensor | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input rows of `ids`; an id past the vocabulary's table is soft row `id - table
        size` (`install_soft_rows`: learned packets, engine/adapt/packets.py)."""
        if self.soft_rows is None:
            return self.embed_tokens(ids)
        vocab = self.embed_tokens.weight.shape[0]
        soft = ids >= vocab
        out: torch.Tensor = self.embed_tokens(torch.where(soft, 0, ids))
        if bool(soft.any()):
            out[soft] = self.soft_rows[ids[soft] - vocab]
        return out

    def install_soft_rows(self, rows: torch.Tensor) -> None:
        """Let ids from the table's size on stand for `rows` [n, hidden] (in the model's dtype)."""
        if rows.ndim != 2 or rows.shape[1] != self.embed_tokens.weight.shape[1]:
            raise ValueError(f"soft rows {tuple(rows.shape)} do not fit the model's hidden size")
        self.soft_rows = rows.to(self.embed_tokens.weight)

    def rope_tables(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [m, head_dim] for the given positions, exactly as the model computes them."""
        cos, sin = self.rotary(like, positions[None])
        return cos[0], sin[0]

    def input_norm(self, index: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[index].input_layernorm(h)

    def project_kv(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        decode: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after RoPE) and V of normed rows x: each [kv_heads, m, head_dim]. Prefill rows run
        in row tiles (`row_tiles`), a decode step's (`decode`) in one call."""
        attn = self.layers[index].self_attn
        k = self._heads(self._rows(attn.k_proj, x, decode), self.spec.num_kv_heads)
        if hasattr(attn, "k_norm"):  # Qwen3 normalises per head before RoPE
            k = attn.k_norm(k)
        v = self._heads(self._rows(attn.v_proj, x, decode), self.spec.num_kv_heads)
        return _rope(k, cos, sin), v

    def project_q(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        decode: bool = False,
    ) -> torch.Tensor:
        """Q (after RoPE) of normed rows x: [heads, m, head_dim]; `decode` as in project_kv."""
        attn = self.layers[index].self_attn
        q = self._heads(self._rows(attn.q_proj, x, decode), self.spec.num_heads)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        return _rope(q, cos, sin)

    def attend_and_mlp(
        self,
        index: int,
        h: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: QueryLayout,
        between_blocks: Callable[[], None] | None = None,
        reading: ContextReading | None = None,
    ) -> torch.Tensor:
        """Finish layer `index` for rows h: attention over the cache, then o_proj, residual and
        MLP by blocks of rows (`row_blocks`), with `between_blocks()` called between two.
        `reading`: the rows after the contexts read them by APE (engine/ape.py)."""
        attn_out = (
            causal_attention(q, keys, values, queries, self.scale)
            if reading is None
            else reading.read(
                q,
                keys,
                values,
                queries.positions,
                self.scale,
                lambda: causal_attention(q, keys, values, queries, self.scale),
            )
        )
        blocks = row_blocks(h.shape[0])
        if len(blocks) <= 1:
            return self.finish_layer(index, h, attn_out)
        finished: list[torch.Tensor] = []
        for block in blocks:
            if finished and between_blocks is not None:
                between_blocks()
            finished.append(self.finish_layer(index, h[block], attn_out[block]))
        return torch.cat(finished)

    def finish_layer(
        self, index: int, h: torch.Tensor, attn_out: torch.Tensor, decode: bool = False
    ) -> torch.Tensor:
        """Rows h after layer `index`, given their attention output [m, heads * head_dim]:
        o_proj, residual, MLP (row-wise, so rows of several sequences may share one call);
        `decode` as in project_kv."""
        layer = self.layers[index]
        h = h + self._rows(layer.self_attn.o_proj, attn_out, decode)
        return h + self._rows(layer.mlp, layer.post_attention_layernorm(h), decode)

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Next-token logits [rows, vocab] in float32 from final hidden rows."""
        return self.lm_head(self.final_norm(h_last)).float()

    def free_rows(self) -> None:
        """Run prefills' products in calls of up to FREE_TILE rows, none padded, reading packed
        weights at any row count: for a model whose products were found to give a row the same
        bits in a call of any row count (engine/serving/row_bits.py)."""
        if self.row_tile is not None:
            self.row_tile, self.pad_tiles = FREE_TILE, False

    @property
    def prefill_calls(self) -> str:
        """How a prefill's products are called, for the start-up line."""
        if self.row_tile is None:
            return "in one call"
        return f"in tiles of {self.row_tile}, " + ("padded" if self.pad_tiles else "unpadded")

    def _rows(
        self, rowwise: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, decode: bool
    ) -> torch.Tensor:
        if decode or self.pad_tiles:
            return by_row_tiles(rowwise, x, None if decode else self.row_tile)
        with packed_for_any_rows():
            return by_row_tiles(rowwise, x, self.row_tile, pad=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], num_heads, self.spec.head_dim).transpose(0, 1)


def row_blocks(rows: int) -> list[slice]:
    """Blocks of ROW_BLOCK rows covering [0, rows); a remainder under MIN_ROW_BLOCK joins the
    block before it. Always the same blocks for the same rows, so a prefill's bits do not
    depend on what runs between its blocks."""
    starts = list(range(0, rows, ROW_BLOCK))
    if len(starts) > 1 and rows - starts[-1] < MIN_ROW_BLOCK:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows])]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half RoPE on x [heads, m, head_dim] with cos, sin [m, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
