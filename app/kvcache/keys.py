"""Where a chunk variant's KV lives in the store, and what a reader must find there.

A key hashes everything that makes KV reusable: the model fingerprint, the system prefix,
the storage codec (base and context variants may differ), the chunk's token ids, its
context (the ordered ids of the chunks it was computed after) and, for a neighbour-conditioned
base, how it was conditioned (`Conditioning.tag`; absent from every other key). Two replicas
of one model compute the same key for the same variant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from app.catalog import context_signature
from app.store import EntryExpectation, token_ids_hash
from engine.engine import Engine
from engine.kv import ChunkId


class VariantKeys:
    """Keys and read expectations of chunk variants for one engine: base variants stored in
    `storage_dtype`, context variants in `variant_dtype` (default: the same codec).

    When the two differ, a base variant may also have an exact copy in `variant_dtype`
    (`base_copy_codec`): kept where a request computed the chunk exactly at the head of its
    prompt, and loaded before the lossy base, so a prompt that opens with a hot chunk starts
    exact and the float context variants after it stay exact too.
    """

    def __init__(self, engine: Engine, storage_dtype: str, variant_dtype: str | None = None):
        self.engine = engine
        self.storage_dtype = storage_dtype
        self.variant_dtype = variant_dtype or storage_dtype

    @property
    def base_copy_codec(self) -> str | None:
        """The codec of base variants' exact copies; None when bases need none (same codec)."""
        return self.variant_dtype if self.variant_dtype != self.storage_dtype else None

    def codec(self, context: Sequence[ChunkId] = ()) -> str:
        """The codec a variant of `context` is stored in (empty context: the base variant)."""
        return self.variant_dtype if context else self.storage_dtype

    def key(
        self,
        token_ids: Sequence[int],
        context: Sequence[ChunkId] = (),
        codec: str | None = None,
        conditioning: str = "",
    ) -> str:
        """Hash of model fingerprint, prefix digest, codec (default: `codec(context)`), context,
        a conditioned base's `conditioning` tag (empty: any other variant) and token ids (32
        hex digits)."""
        h = hashlib.sha256()
        parts = [
            self.engine.fingerprint,
            self.engine.prompts.prefix_digest,
            codec or self.codec(context),
            context_signature(context),
        ]
        for part in parts + ([conditioning] if conditioning else []):
            h.update(part.encode())
            h.update(b"\0")
        h.update(np.asarray(token_ids, dtype="<i8").tobytes())
        return h.hexdigest()[:32]

    def expectation(
        self,
        token_ids: Sequence[int],
        context: Sequence[ChunkId] = (),
        codec: str | None = None,
        conditioning: str = "",
    ) -> EntryExpectation:
        """What an entry read under `key(token_ids, context, codec, conditioning)` must say
        about itself (a conditioned base has a lead, every other variant none)."""
        return EntryExpectation(
            self.engine.fingerprint,
            self.engine.prompts.prefix_digest,
            token_ids_hash(token_ids),
            codec or self.codec(context),
            tuple(context),
            conditioned=bool(conditioning),
        )
