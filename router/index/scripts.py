"""Server-side Lua scripts of the Redis prefix index and registry, and how to call them.

Each script touches keys of one hash tag only (see :mod:`router.index.layout`), so it
runs unchanged on a single node and on a Redis Cluster shard. Scripts are composed
from shared fragments instead of repeating them.

Entry values are tier masks (``1`` GPU, ``2`` CPU tier, ``3`` both); ``"0"`` in an
argument list means "remove the entry".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

from redis.exceptions import NoScriptError, ResponseError

from router.errors import PrefixIndexError

__all__ = [
    "ACQUIRE",
    "APPLY_BLOCKS",
    "APPLY_SINGLE",
    "APPLY_WORKER",
    "FENCED_ERROR",
    "LOOKUP",
    "RELEASE",
    "RENEW",
    "RESET_WORKER",
    "Script",
    "StaleLeaseError",
]

FENCED_ERROR: Final = "KVROUTE_FENCED"
"""Prefix of the error a script returns when the caller's lease token is not current."""


class StaleLeaseError(PrefixIndexError):
    """A write was refused: the writer's lease of that worker lapsed or a newer epoch holds it.

    The ingest layer re-acquires the lease and resyncs the worker.
    """


# KEYS[1] is the worker's lease, ARGV[1] the caller's token "<epoch>:<owner>".
_FENCE: Final = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('{FENCED_ERROR} lease not held with this epoch')
end
"""

# Writes one worker's field of one block hash; returns +1 when the hash was created,
# -1 when it was deleted, else 0 (for the namespace's distinct-key counter).
_BLOCK_OP: Final = """
local function block_op(key, field, mask)
  if mask == '0' then
    if redis.call('HDEL', key, field) == 1 and redis.call('EXISTS', key) == 0 then
      return -1
    end
  elseif redis.call('HSET', key, field, mask) == 1 and redis.call('HLEN', key) == 1 then
    return 1
  end
  return 0
end
"""

_MEMBER_OP: Final = """
local function member_op(members, member, mask)
  if mask == '0' then
    redis.call('SREM', members, member)
  else
    redis.call('SADD', members, member)
  end
end
"""

APPLY_SINGLE: Final = (
    _BLOCK_OP
    + _MEMBER_OP
    + _FENCE
    + """
-- Single node: the whole batch in one atomic, fenced script.
-- KEYS: lease, members, worker, stats, block_1..block_n
-- ARGV: token, field, entries_delta, then member_i, mask_i for each block
local created = 0
for i = 5, #KEYS do
  local a = 2 * i - 6
  member_op(KEYS[2], ARGV[a], ARGV[a + 1])
  created = created + block_op(KEYS[i], ARGV[2], ARGV[a + 1])
end
redis.call('HINCRBY', KEYS[3], 'entries', ARGV[3])
if created ~= 0 then
  redis.call('HINCRBY', KEYS[4], 'keys', created)
end
return created
"""
)

APPLY_WORKER: Final = (
    _MEMBER_OP
    + _FENCE
    + """
-- Cluster, worker shard: fencing check and membership of one batch.
-- KEYS: lease, members, worker   ARGV: token, entries_delta, then member_i, mask_i
for a = 3, #ARGV, 2 do
  member_op(KEYS[2], ARGV[a], ARGV[a + 1])
end
redis.call('HINCRBY', KEYS[3], 'entries', ARGV[2])
return 0
"""
)

APPLY_BLOCKS: Final = (
    _BLOCK_OP
    + """
-- Cluster, one family shard: block entries of one batch.
-- KEYS: block_1..block_n   ARGV: field, mask_1..mask_n
local created = 0
for i = 1, #KEYS do
  created = created + block_op(KEYS[i], ARGV[1], ARGV[i + 1])
end
return created
"""
)

RESET_WORKER: Final = (
    _FENCE
    + """
-- KEYS: lease, members, worker   ARGV: token
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[3], 'entries', 0)
return 0
"""
)

LOOKUP: Final = """
-- Walk one request's chain (all keys share a tag) and stop at the first block no
-- candidate still matching holds.
-- KEYS: block_1..block_n   ARGV: candidate fields (none: every holder of block 1)
-- Returns: flat list field, gpu_blocks, cpu_blocks for each worker matching block 1.
local alive = {}
local gpu, cpu = {}, {}
local first = {}
if #ARGV == 0 and #KEYS > 0 then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    alive[#alive + 1] = all[j]
  end
else
  for j = 1, #ARGV do
    alive[j] = ARGV[j]
  end
end
for i = 1, #KEYS do
  if #alive == 0 then
    break
  end
  local masks = redis.call('HMGET', KEYS[i], unpack(alive))
  local next_alive = {}
  for j = 1, #alive do
    local mask = masks[j]
    if mask then
      local w = alive[j]
      if i == 1 then
        first[#first + 1] = w
        gpu[w] = 0
        cpu[w] = 0
      end
      if tonumber(mask) % 2 == 1 then
        gpu[w] = gpu[w] + 1
      else
        cpu[w] = cpu[w] + 1
      end
      next_alive[#next_alive + 1] = w
    end
  end
  alive = next_alive
end
local out = {}
for _, w in ipairs(first) do
  out[#out + 1] = w
  out[#out + 1] = gpu[w]
  out[#out + 1] = cpu[w]
end
return out
"""

ACQUIRE: Final = """
-- KEYS: lease, worker   ARGV: owner, ttl_ms
-- Returns the new epoch, or nil when another owner holds the lease.
local current = redis.call('GET', KEYS[1])
if current and string.match(current, '^%d+:(.*)$') ~= ARGV[1] then
  return nil
end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
"""

RENEW: Final = """
-- KEYS: lease   ARGV: token, ttl_ms   Returns 1 when renewed, 0 when the lease is lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

RELEASE: Final = """
-- KEYS: lease   ARGV: token   Deletes the lease only if the caller still holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Script:
    """A Lua script called by SHA, loaded on demand on whichever node lacks it.

    Args:
        source: The Lua source.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(
        self, client: Any, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]
    ) -> Any:
        """Run the script (``EVALSHA``, falling back to ``EVAL`` once per node).

        Raises:
            StaleLeaseError: The script refused a fenced write.
            redis.exceptions.RedisError: Any other server or connection failure.
        """
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        except ResponseError as exc:
            if str(exc).startswith(FENCED_ERROR):
                raise StaleLeaseError(
                    f"write refused: {exc}; re-acquire the worker's lease and resync it"
                ) from exc
            raise
