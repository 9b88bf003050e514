"""Server-side Lua scripts of the Redis prefix index and registry, and how to call them.

Each script touches keys of one hash tag only (see :mod:`router.index.layout`), so it
runs unchanged on a single node and on a Redis Cluster shard. Scripts are composed
from shared fragments instead of repeating them.

Entry values are tier masks (``1`` GPU, ``2`` CPU tier, ``3`` both). Keys and writes
travel packed in one argument each (8 bytes per key, 25 bytes per write record) and the
scripts build the key names: far cheaper for the client than thousands of arguments.
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
    "RECORD_BYTES",
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

# A write record is 25 bytes: the family tag as 16 hex digits, the router key as 8 raw
# bytes (together: the member id in the worker's set) and the new tier mask as one digit
# ('0' removes). The block key is ARGV prefix .. '{' .. tag .. '}' .. key.
RECORD_BYTES: Final = 25

# Applies the records in ARGV[rec] to block keys; with members set, also to the worker's
# membership set. Returns +created-deleted block keys (the namespace's key counter).
_WRITE: Final = f"""
local function write(prefix, field, recs, members)
  local created = 0
  for off = 1, #recs, {RECORD_BYTES} do
    local member = string.sub(recs, off, off + 23)
    local mask = string.sub(recs, off + 24, off + 24)
    local key = prefix .. '{{' .. string.sub(recs, off, off + 15) .. '}}' .. string.sub(member, 17)
    if mask == '0' then
      if members then
        redis.call('SREM', members, member)
      end
      if redis.call('HDEL', key, field) == 1 and redis.call('EXISTS', key) == 0 then
        created = created - 1
      end
    else
      if members then
        redis.call('SADD', members, member)
      end
      if redis.call('HSET', key, field, mask) == 1 and redis.call('HLEN', key) == 1 then
        created = created + 1
      end
    end
  end
  return created
end
"""

APPLY_SINGLE: Final = (
    _WRITE
    + _FENCE
    + """
-- Single node: the whole batch in one atomic, fenced script.
-- KEYS: lease, members, worker, stats   ARGV: token, field, entries_delta, prefix, records
local created = write(ARGV[4], ARGV[2], ARGV[5], KEYS[2])
redis.call('HINCRBY', KEYS[3], 'entries', ARGV[3])
if created ~= 0 then
  redis.call('HINCRBY', KEYS[4], 'keys', created)
end
return created
"""
)

APPLY_WORKER: Final = (
    _FENCE
    + f"""
-- Cluster, worker shard: fencing check and membership of one batch.
-- KEYS: lease, members, worker   ARGV: token, entries_delta, records
local recs = ARGV[3]
for off = 1, #recs, {RECORD_BYTES} do
  local member = string.sub(recs, off, off + 23)
  if string.sub(recs, off + 24, off + 24) == '0' then
    redis.call('SREM', KEYS[2], member)
  else
    redis.call('SADD', KEYS[2], member)
  end
end
redis.call('HINCRBY', KEYS[3], 'entries', ARGV[2])
return 0
"""
)

APPLY_BLOCKS: Final = (
    _WRITE
    + """
-- Cluster, one slot: block entries of one batch (every key in KEYS[1]'s slot).
-- KEYS: one block key of the slot   ARGV: field, prefix, records
return write(ARGV[2], ARGV[1], ARGV[3], nil)
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
-- Walk one request's chain (all keys share a tag, so one slot) and stop at the first
-- block no candidate still matching holds.
-- KEYS: block 0's key (routing)   ARGV: key prefix with the tag, packed 8-byte keys,
-- then the candidate fields (none: every holder of block 0).
-- Returns: flat list field, gpu_blocks, cpu_blocks for each worker matching block 0.
local prefix, packed = ARGV[1], ARGV[2]
local alive = {}
local gpu, cpu = {}, {}
local first = {}
if #ARGV == 2 then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    alive[#alive + 1] = all[j]
  end
else
  for j = 3, #ARGV do
    alive[#alive + 1] = ARGV[j]
  end
end
for i = 1, #packed / 8 do
  if #alive == 0 then
    break
  end
  local masks = redis.call('HMGET', prefix .. string.sub(packed, 8 * i - 7, 8 * i), unpack(alive))
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
      if mask == '1' or mask == '3' then
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
