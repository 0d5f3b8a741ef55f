"""The `redis` tier: entries as Redis strings, shared by every server replica.

Keys: `<prefix><key>` holds the serialized entry (same safetensors bytes as on disk);
`<prefix>index` is a hash {key: payload bytes}. Puts and removes change the value and the
index in one MULTI/EXEC transaction, so replicas agree on the accounting (`used_bytes` sums
the index). Layers are read with GETRANGE, one layer per call. Install `hiredis` (a
dependency) for fast replies: redis-py's pure-Python parser reads large values ~4x slower.

Caveats: pins are local to this process (another replica may evict an entry this one is
reading; the read then fails its checksum or length check and becomes a miss). Give Redis
`maxmemory-policy noeviction` (or a capacity below maxmemory) so that Redis itself never
drops values behind the index.
Connection failures raise `TierUnavailable`; the tiered store then skips this tier for a while.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis as redis_lib
import torch

from app.store import codec
from app.store.base import BaseTier, EntryReader, TierUnavailable, check_key
from app.store.config import StoreConfig
from app.store.entry import CorruptEntry, KVEntry

log = logging.getLogger(__name__)
T = TypeVar("T")
# Bytes read on open: the whole header of any realistic entry (~100 bytes per layer).
_HEAD_READ = 1 << 16


class _RedisReader(EntryReader):
    def __init__(self, tier: RedisTier, key: str, layout: codec.EntryLayout):
        self.meta = layout.meta
        self._tier, self._key, self._layout = tier, key, layout

    def layer(self, index: int) -> torch.Tensor:
        start, end = self._layout.offsets[index]
        raw = _reply_bytes(
            self._tier._call(lambda c: c.getrange(self._tier.data_key(self._key), start, end - 1))
        )
        if len(raw) != end - start:
            raise CorruptEntry(f"layer {index} vanished or was truncated in redis")
        return codec.decode_layer(self._layout, index, bytearray(raw))


class RedisTier(BaseTier):
    name = "redis"
    shared = True

    def __init__(
        self,
        capacity_bytes: int,
        url: str,
        prefix: str = "kvmosaic:kv:",
        timeout_s: float = 2.0,
        check: bool = True,
    ):
        """`check`: ping now and raise TierUnavailable if Redis is unreachable."""
        super().__init__(capacity_bytes)
        self.url, self.prefix = url, prefix
        self._client = redis_lib.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._index_key = f"{prefix}index"
        if check:
            self.ping()

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> RedisTier:
        return cls(
            config.redis_bytes,
            config.redis_url,
            config.redis_prefix,
            config.redis_timeout_s,
            check=check,
        )

    def ping(self) -> None:
        self._call(lambda c: c.ping())

    def data_key(self, key: str) -> str:
        return f"{self.prefix}{check_key(key)}"

    def _call(self, operation: Callable[[redis_lib.Redis], T]) -> T:
        try:
            return operation(self._client)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
            raise TierUnavailable(f"redis at {self.url} is unreachable: {exc}") from exc

    # -- contract ------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda c: c.exists(self.data_key(key))))

    def put(self, key: str, entry: KVEntry) -> None:
        data, data_key = codec.encode(entry), self.data_key(key)

        def write(client: redis_lib.Redis) -> None:
            with client.pipeline(transaction=True) as pipe:  # value and index change together
                pipe.set(data_key, data)
                pipe.hset(self._index_key, key, entry.num_bytes)
                pipe.execute()

        self._call(write)

    def get(self, key: str) -> KVEntry | None:
        data = self._call(lambda c: c.get(self.data_key(key)))
        if data is None:
            self._drop_stale_index(key)
            return None
        return codec.decode(_reply_bytes(data))

    def open(self, key: str) -> EntryReader | None:
        data_key = self.data_key(key)

        def head_and_size(client: redis_lib.Redis) -> tuple[bytes, int]:
            # One transaction, so the header and the size describe the same value.
            with client.pipeline(transaction=True) as pipe:
                pipe.getrange(data_key, 0, _HEAD_READ - 1)
                pipe.strlen(data_key)
                head, size = pipe.execute()
                return _reply_bytes(head), int(size)

        head, size = self._call(head_and_size)
        if not head:
            self._drop_stale_index(key)
            return None
        length = codec.header_length(head)
        if 8 + length > len(head):  # unusually long header: fetch the rest
            head = _reply_bytes(self._call(lambda c: c.getrange(data_key, 0, 8 + length - 1)))
        return _RedisReader(self, key, codec.parse_header(head, size))

    def discard(self, key: str) -> bool:
        data_key = self.data_key(key)

        def delete(client: redis_lib.Redis) -> bool:
            with client.pipeline(transaction=True) as pipe:
                pipe.delete(data_key)
                pipe.hdel(self._index_key, key)
                existed, _ = pipe.execute()
                return bool(existed)

        return self._call(delete)

    def keys(self) -> dict[str, int]:
        raw = self._call(lambda c: c.hgetall(self._index_key))
        return {_reply_bytes(k).decode(): int(v) for k, v in raw.items()}

    def used_bytes(self) -> int:
        return sum(int(v) for v in self._call(lambda c: c.hvals(self._index_key)))

    def close(self) -> None:
        self._client.close()

    def _drop_stale_index(self, key: str) -> None:
        """The value is gone but the index may still list it (Redis evicted it): clean up."""
        data_key = self.data_key(key)

        def drop(client: redis_lib.Redis) -> bool:
            with client.pipeline(transaction=True) as pipe:
                try:
                    # a put of the key in between aborts the clean-up
                    pipe.watch(data_key)  # type: ignore[no-untyped-call]  # redis-py leaves Pipeline.watch unannotated
                    if pipe.exists(data_key) or not pipe.hexists(self._index_key, key):
                        return False
                    pipe.multi()
                    pipe.hdel(self._index_key, key)
                    return bool(pipe.execute()[0])
                except redis_lib.WatchError:
                    return False

        if self._call(drop):
            log.warning("redis value of %s vanished; dropped it from the index", key)


def _reply_bytes(reply: bytes | str) -> bytes:
    """A reply of our client as the bytes it is: redis-py types replies `bytes | str` because a
    client made with decode_responses gets str, and ours is made without it."""
    if isinstance(reply, str):
        raise TypeError("the redis tier's client must not decode responses")
    return reply
