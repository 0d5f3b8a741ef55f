"""The `redis` tier: entries as Redis strings, shared by every server replica.

Keys: `<prefix><key>` holds the serialized entry (same safetensors bytes as on disk);
`<prefix>index` is a hash {key: payload bytes} and `<prefix>bytes` their sum. Puts and
removes run as Lua scripts, so the value, the index and the byte counter change together
and replicas agree on the accounting. Layers are read with GETRANGE, one layer per call.

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

from engine.store import codec
from engine.store.base import BaseTier, EntryReader, TierUnavailable, check_key
from engine.store.config import StoreConfig
from engine.store.entry import CorruptEntry, KVEntry

log = logging.getLogger(__name__)
T = TypeVar("T")
# Bytes read on open: the whole header of any realistic entry (~100 bytes per layer).
_HEAD_READ = 1 << 16

_PUT = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('INCRBY', KEYS[3], tonumber(ARGV[3]) - tonumber(old or 0))
return 1
"""
_REMOVE = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
local existed = redis.call('DEL', KEYS[1])
if old then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[3], tonumber(old))
end
return existed
"""
_DROP_STALE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], tonumber(old))
return 1
"""


class _RedisReader(EntryReader):
    def __init__(self, tier: RedisTier, key: str, layout: codec.EntryLayout):
        self.meta = layout.meta
        self._tier, self._key, self._layout = tier, key, layout

    def layer(self, index: int) -> torch.Tensor:
        start, end = self._layout.offsets[index]
        raw = self._tier._call(lambda c: c.getrange(self._tier.data_key(self._key), start, end - 1))
        if len(raw) != end - start:
            raise CorruptEntry(f"layer {index} vanished or was truncated in redis")
        return codec.decode_layer(self._layout, index, bytearray(raw))


class RedisTier(BaseTier):
    name = "redis"

    def __init__(self, capacity_bytes: int, url: str, prefix: str = "kvmosaic:kv:", timeout_s: float = 2.0,
                 check: bool = True):
        """`check`: ping now and raise TierUnavailable if Redis is unreachable."""
        super().__init__(capacity_bytes)
        self.url, self.prefix = url, prefix
        self._client = redis_lib.Redis.from_url(url, socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s)
        self._index_key, self._bytes_key = f"{prefix}index", f"{prefix}bytes"
        if check:
            self.ping()
        self._put_script = self._client.register_script(_PUT)
        self._remove_script = self._client.register_script(_REMOVE)
        self._drop_stale_script = self._client.register_script(_DROP_STALE)

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> RedisTier:
        return cls(config.redis_bytes, config.redis_url, config.redis_prefix, config.redis_timeout_s,
                   check=check)

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
        data = codec.encode(entry)
        keys = [self.data_key(key), self._index_key, self._bytes_key]
        self._call(lambda c: self._put_script(keys=keys, args=[key, data, entry.num_bytes], client=c))

    def get(self, key: str) -> KVEntry | None:
        data = self._call(lambda c: c.get(self.data_key(key)))
        if data is None:
            self._drop_stale_index(key)
            return None
        return codec.decode(data)

    def open(self, key: str) -> EntryReader | None:
        data_key = self.data_key(key)

        def head_and_size(client: redis_lib.Redis) -> list:
            # One transaction, so the header and the size describe the same value.
            with client.pipeline(transaction=True) as pipe:
                return pipe.getrange(data_key, 0, _HEAD_READ - 1).strlen(data_key).execute()

        head, size = self._call(head_and_size)
        if not head:
            self._drop_stale_index(key)
            return None
        length = codec.header_length(head)
        if 8 + length > len(head):  # unusually long header: fetch the rest
            head = self._call(lambda c: c.getrange(data_key, 0, 8 + length - 1))
        return _RedisReader(self, key, codec.parse_header(head, size))

    def _discard(self, key: str) -> bool:
        keys = [self.data_key(key), self._index_key, self._bytes_key]
        return bool(self._call(lambda c: self._remove_script(keys=keys, args=[key], client=c)))

    def keys(self) -> dict[str, int]:
        raw = self._call(lambda c: c.hgetall(self._index_key))
        return {k.decode(): int(v) for k, v in raw.items()}

    def used_bytes(self) -> int:
        return int(self._call(lambda c: c.get(self._bytes_key)) or 0)

    def close(self) -> None:
        self._client.close()

    def _drop_stale_index(self, key: str) -> None:
        """The value is gone but the index may still list it (Redis evicted it): clean up."""
        keys = [self.data_key(key), self._index_key, self._bytes_key]
        if self._call(lambda c: self._drop_stale_script(keys=keys, args=[key], client=c)):
            log.warning("redis value of %s vanished; dropped it from the index", key)
