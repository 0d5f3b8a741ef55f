"""Learned chunk packets (KV Packet, arXiv 2604.13226): soft tokens around every chunk.

The model stays frozen. `head` soft tokens go before each chunk and `tail` after it, the same
for every chunk; each chunk is encoded alone between them right after the system prefix, moved
to its place (keys re-rotated, as any base) and read by the question with nothing recomputed.
The tokens are trained so that this gives full prefill's answers (engine/adapt/train.py). A
packet file lives beside the converted checkpoint; KV encoded with packets is another cache, so
its digest belongs in the cache's identity.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import DynamicCache, PreTrainedModel

from engine.config import EngineConfig
from engine.errors import InvalidRequest, KvMosaicError
from engine.model.known import checkpoint_of
from engine.model.loader import LoadedModel

log = logging.getLogger(__name__)

KVRows = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [1, kv_heads, rows, dim]


@dataclass
class Packets:
    """`head` [h, hidden] and `tail` [t, hidden]: input embeddings of the soft tokens."""

    head: torch.Tensor
    tail: torch.Tensor

    @classmethod
    def initial(
        cls, model: PreTrainedModel, separator_ids: Sequence[int], h: int, t: int
    ) -> Packets:
        """A neutral start: every soft token the embedding of the separator's tokens in turn
        (chunks begin as if set apart by blank lines)."""
        if not separator_ids or h < 1 or t < 1:
            raise InvalidRequest("packets need a separator and at least one head and tail token")
        table = embedding(model).weight.detach()
        ids = [separator_ids[i % len(separator_ids)] for i in range(max(h, t))]
        rows = table[torch.tensor(ids)].float().clone()
        return cls(rows[:h].clone(), rows[:t].clone())

    @property
    def extra_rows(self) -> int:
        """Rows a chunk's cached KV gains: its head and tail."""
        return self.head.shape[0] + self.tail.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(head tokens, tail tokens)."""
        return self.head.shape[0], self.tail.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        """[head + tail, hidden]: the head's rows, then the tail's."""
        return torch.cat([self.head, self.tail])

    def around(self, token_ids: Sequence[int], first_id: int) -> tuple[int, ...]:
        """`token_ids` between the packets, whose tokens take the ids from `first_id` on (the
        soft rows of `DecoderStack.install_soft_rows`): what a chunk is encoded and read as."""
        head = range(first_id, first_id + self.head.shape[0])
        tail = range(head.stop, head.stop + self.tail.shape[0])
        return (*head, *token_ids, *tail)

    def digest(self) -> str:
        """sha256 of the tokens' bytes (float32): the packets' part of a cache's identity."""
        data = torch.cat([self.head, self.tail]).detach().float().contiguous()
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]

    def save(self, path: Path, meta: dict[str, object]) -> None:
        """Write the tokens and `meta` (the model's fingerprint, training figures) atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        tensors = {"head": self.head.detach().float(), "tail": self.tail.detach().float()}
        text = {"meta": json.dumps(meta, sort_keys=True), "digest": self.digest()}
        safetensors.torch.save_file(tensors, str(partial), metadata=text)
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> tuple[Packets, dict[str, object]]:
        """Tokens and meta of `save`; InvalidRequest if the file is unreadable or altered."""
        try:
            with safetensors.safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
                packets = cls(handle.get_tensor("head"), handle.get_tensor("tail"))
            meta = json.loads(metadata.get("meta", "{}"))
        except (OSError, ValueError, KeyError) as exc:
            raise InvalidRequest(f"cannot read packets {path}: {exc}") from exc
        if metadata.get("digest") != packets.digest():
            raise InvalidRequest(f"packets {path} do not match their digest")
        return packets, meta


PACKETS_FILE = "packets.safetensors"  # beside the converted checkpoint (`kvmosaic adapt`)


def packets_for(config: EngineConfig, loaded: LoadedModel) -> Packets | None:
    """The packets `config.packets` names for `loaded` (None: unset, or `auto` and no file
    beside the checkpoint). KvMosaicError if the file is unreadable or fits another model's
    hidden size; a warning if they were trained on a model of another fingerprint (another
    dtype or kernel: they still fit, not as well)."""
    if config.packets is None:
        return None
    if config.packets == "auto":
        path = checkpoint_of(config.data_dir, config.model, config.model_path) / PACKETS_FILE
        if not path.is_file():
            return None
    else:
        path = Path(config.packets)
    try:
        packets, meta = Packets.load(path)
    except InvalidRequest as exc:
        raise KvMosaicError(str(exc)) from None
    if packets.head.shape[1] != loaded.spec.hidden_size:
        raise KvMosaicError(
            f"packets {path} have {packets.head.shape[1]} columns, the model's hidden size is "
            f"{loaded.spec.hidden_size}: they belong to another model"
        )
    if meta.get("fingerprint") != loaded.fingerprint:
        log.warning(
            "packets %s were trained on model fingerprint %s, this one is %s",
            path,
            meta.get("fingerprint"),
            loaded.fingerprint,
        )
    log.info("packets: %s (%d + %d soft tokens, digest %s)", path, *packets.shape, packets.digest())
    return packets


def packets_fingerprint(fingerprint: str, packets: Packets) -> str:
    """A model fingerprint that also names the packets: KV encoded with them is another cache."""
    text = f"{fingerprint} packets {packets.digest()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shifted_keys(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys that carry RoPE at p, as at p + `delta` (differentiable; `ops.rope_shift_` rotates
    in place and is not)."""
    if delta == 0:
        return k
    angles = inv_freq.to(torch.float64) * float(delta)
    cos, sin = angles.cos().to(k.dtype), angles.sin().to(k.dtype)
    half = k.shape[-1] // 2
    first, second = k[..., :half], k[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def prefix_rows(model: PreTrainedModel, prefix_ids: Sequence[int]) -> KVRows:
    """The system prefix's KV, computed once and never trained."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prefix_ids)]), use_cache=True)
    return cache_rows(out.past_key_values)


def encoded_blocks(
    model: PreTrainedModel, prefix: KVRows, blocks: Sequence[torch.Tensor]
) -> list[KVRows]:
    """KV of each of `blocks` ([rows, hidden] embeddings) computed alone right after the
    prefix (its base), all in one batched pass: shorter blocks are padded at their end, which
    no real row reads (attention is causal), and cut off after."""
    if not blocks:
        return []
    start = prefix[0][0].shape[2]
    longest = max(block.shape[0] for block in blocks)
    padded = torch.stack([pad_rows(block, longest) for block in blocks])
    batch = len(blocks)
    cache = DynamicCache(
        ddp_cache_data=[
            (k.expand(batch, -1, -1, -1).clone(), v.expand(batch, -1, -1, -1).clone())
            for k, v in prefix
        ]
    )
    positions = torch.arange(start, start + longest)[None].expand(batch, -1)
    model.model(inputs_embeds=padded, position_ids=positions, cache=cache, use_cache=True)
    layers = cache_rows(cache)
    return [
        [
            (k[i : i + 1, :, start : start + n], v[i : i + 1, :, start : start + n])
            for k, v in layers
        ]
        for i, n in enumerate(block.shape[0] for block in blocks)
    ]


def pad_rows(block: torch.Tensor, rows: int) -> torch.Tensor:
    """`block` [n, hidden] with zero rows after it up to `rows`."""
    if block.shape[0] == rows:
        return block
    return torch.cat([block, block.new_zeros(rows - block.shape[0], block.shape[1])])


def cache_rows(cache: DynamicCache) -> KVRows:
    """Every layer's (K, V) of a Hugging Face cache of attention layers."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"cache layer {type(layer).__name__} holds no attention KV")
        out.append((keys, values))
    return out


def embedding(model: PreTrainedModel) -> torch.nn.Embedding:
    """The model's input embedding table."""
    module = model.get_input_embeddings()
    if not isinstance(module, torch.nn.Embedding):
        raise TypeError(f"{type(model).__name__} has no plain input embedding table")
    return module


def reused_cache(
    model: PreTrainedModel,
    prefix: KVRows,
    chunks: Sequence[Sequence[int]],
    packets: Packets | None,
    inv_freq: torch.Tensor,
) -> tuple[DynamicCache, int]:
    """The prompt's cache as reuse assembles it: each chunk (between the packets, if any)
    encoded alone after the prefix, moved to its place; and the position after the last."""
    embed = embedding(model)
    start = prefix[0][0].shape[2]
    layers: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([k], [v]) for k, v in prefix]
    blocks = []
    for ids in chunks:
        rows = embed(torch.tensor(list(ids)))
        if packets is not None:
            rows = torch.cat([packets.head.to(rows.dtype), rows, packets.tail.to(rows.dtype)])
        blocks.append(rows)
    position = start
    for block, kv in zip(blocks, encoded_blocks(model, prefix, blocks)):
        for (keys, values), (k, v) in zip(layers, kv):
            keys.append(shifted_keys(k, position - start, inv_freq))
            values.append(v)
        position += block.shape[0]
    data = [(torch.cat(keys, dim=2), torch.cat(values, dim=2)) for keys, values in layers]
    return DynamicCache(ddp_cache_data=data), position


def logits_after(
    model: PreTrainedModel,
    cache: DynamicCache,
    position: int,
    ids: Sequence[int],
    last_only: bool = False,
) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` read at `position` on over `cache` (which grows);
    `last_only`: of the last id only ([1, vocab]: the output head skips the other rows)."""
    positions = torch.arange(position, position + len(ids))[None]
    hidden = model.model(
        input_ids=torch.tensor([list(ids)]), position_ids=positions, cache=cache, use_cache=True
    ).last_hidden_state[0]
    logits: torch.Tensor = model.lm_head(hidden[-1:] if last_only else hidden)
    return logits.float()
