"""Server-side Lua scripts of the Redis prefix index and registry, and how to call them.

Each script touches keys of one hash tag only (see :mod:`router.index.layout`), so it
runs unchanged on a single node and on a Redis Cluster shard. Scripts are composed
from shared fragments instead of repeating them.

Router keys travel as one space-separated argument of signed decimals per list (the
scripts split them), and the scripts build key names from the namespace prefix, the
family tag and the worker id: far cheaper for the client than thousands of arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

from redis.exceptions import NoScriptError, ResponseError

from router.errors import PrefixIndexError

__all__ = [
    "ACQUIRE",
    "APPLY_FAMILIES",
    "APPLY_SINGLE",
    "APPLY_WORKER",
    "CLEAR_FAMILIES",
    "FAMILY_ARGS",
    "FENCED_ERROR",
    "FORGET_FAMILIES",
    "LOOKUP",
    "RELEASE",
    "RENEW",
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

# Splits a space-separated key list and applies a set command to it, in chunks that
# stay far below Lua's limit on unpack() arguments.
_SET_OP: Final = """
local function set_op(cmd, key, list)
  if list == '' then
    return
  end
  local chunk = {}
  for member in string.gmatch(list, '%S+') do
    chunk[#chunk + 1] = member
    if #chunk == 1000 then
      redis.call(cmd, key, unpack(chunk))
      chunk = {}
    end
  end
  if #chunk > 0 then
    redis.call(cmd, key, unpack(chunk))
  end
end
"""

# Applies one family's part of a batch: ARGV from position a: tag, entries delta, GPU keys
# added, GPU keys removed, CPU keys added, CPU keys removed. Returns the worker's entry
# count left in the family.
_FAMILY: Final = """
local function family(ns, worker, a)
  local tag = ARGV[a]
  local g = ns .. 'g:{' .. tag .. '}:' .. worker
  local c = ns .. 'c:{' .. tag .. '}:' .. worker
  set_op('SADD', g, ARGV[a + 2])
  set_op('SREM', g, ARGV[a + 3])
  set_op('SADD', c, ARGV[a + 4])
  set_op('SREM', c, ARGV[a + 5])
  local h = ns .. 'h:{' .. tag .. '}'
  local left = redis.call('HINCRBY', h, worker, ARGV[a + 1])
  if left <= 0 then
    redis.call('HDEL', h, worker)
  end
  return left
end
"""

FAMILY_ARGS: Final = 6
"""Arguments per family in the write scripts (see ``_FAMILY``)."""

APPLY_SINGLE: Final = (
    _SET_OP
    + _FAMILY
    + _FENCE
    + f"""
-- Single node: the whole batch in one atomic, fenced script.
-- KEYS: lease, worker, families   ARGV: token, worker id, ns prefix, entries delta,
-- then {FAMILY_ARGS} arguments per family.
for a = 5, #ARGV, {FAMILY_ARGS} do
  if family(ARGV[3], ARGV[2], a) > 0 then
    redis.call('SADD', KEYS[3], ARGV[a])
  else
    redis.call('SREM', KEYS[3], ARGV[a])
  end
end
redis.call('HINCRBY', KEYS[2], 'entries', ARGV[4])
return 0
"""
)

APPLY_WORKER: Final = (
    _FENCE
    + """
-- Cluster, worker shard: fencing check and bookkeeping of one batch. The family list
-- only grows here (a superset); clear_worker empties it.
-- KEYS: lease, worker, families   ARGV: token, entries delta, family tags...
for a = 3, #ARGV do
  redis.call('SADD', KEYS[3], ARGV[a])
end
redis.call('HINCRBY', KEYS[2], 'entries', ARGV[2])
return 0
"""
)

APPLY_FAMILIES: Final = (
    _SET_OP
    + _FAMILY
    + f"""
-- Cluster, one slot: the families of a batch that live in KEYS[1]'s slot.
-- KEYS: one holders hash of the slot   ARGV: worker id, ns prefix, then
-- {FAMILY_ARGS} arguments per family.
for a = 3, #ARGV, {FAMILY_ARGS} do
  family(ARGV[2], ARGV[1], a)
end
return 0
"""
)

CLEAR_FAMILIES: Final = """
-- Drop a worker's sets and holder counts in some families (one slot).
-- KEYS: one holders hash of the slot   ARGV: worker id, ns prefix, family tags...
local worker, ns = ARGV[1], ARGV[2]
for a = 3, #ARGV do
  local tag = ARGV[a]
  redis.call('DEL', ns .. 'g:{' .. tag .. '}:' .. worker, ns .. 'c:{' .. tag .. '}:' .. worker)
  redis.call('HDEL', ns .. 'h:{' .. tag .. '}', worker)
end
return 0
"""

FORGET_FAMILIES: Final = (
    _FENCE
    + """
-- Fenced end of a clear: forget dropped families; the last one resets the entry count.
-- KEYS: lease, worker, families   ARGV: token, family tags whose sets were dropped
for a = 2, #ARGV do
  redis.call('SREM', KEYS[3], ARGV[a])
end
if redis.call('SCARD', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[2], 'entries', 0)
end
return 0
"""
)

LOOKUP: Final = """
-- The longest consecutive prefix of one request's keys per candidate worker, in one
-- family (one slot): O(log n) membership checks per candidate holding the family.
-- KEYS: the family's holders hash.
-- ARGV: ns prefix, family tag, the keys (20 characters each, right-aligned), then the
-- candidate worker ids (none: every holder of the family).
-- Returns: flat list worker, gpu_blocks, cpu_blocks for each worker holding block 0.
local ns, tag = ARGV[1], ARGV[2]
local candidates = {}
if #ARGV == 3 then
  candidates = redis.call('HKEYS', KEYS[1])
else
  local asked = {}
  for j = 4, #ARGV do
    asked[#asked + 1] = ARGV[j]
  end
  local counts = redis.call('HMGET', KEYS[1], unpack(asked))
  for j = 1, #asked do
    if counts[j] then
      candidates[#candidates + 1] = asked[j]
    end
  end
end
if #candidates == 0 then
  return {}
end
local packed = ARGV[3]
local n = #packed / 20
local function key(i)
  return string.match(string.sub(packed, 20 * i - 19, 20 * i), '%S+')
end
local out = {}
for _, w in ipairs(candidates) do
  local gset = ns .. 'g:{' .. tag .. '}:' .. w
  local cset = ns .. 'c:{' .. tag .. '}:' .. w
  local has_cpu = redis.call('EXISTS', cset) == 1
  local function held(i)
    local k = key(i)
    return redis.call('SISMEMBER', gset, k) == 1
      or (has_cpu and redis.call('SISMEMBER', cset, k) == 1)
  end
  -- The index is prefix-closed per chain (see router.index.bridge): held(i) implies
  -- held(i - 1), so the matched depth is found by binary search.
  local depth = 0
  if held(1) then
    local lo, hi = 1, n + 1
    if held(n) then
      lo = n
    else
      hi = n
    end
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if held(mid) then
        lo = mid
      else
        hi = mid
      end
    end
    depth = lo
  end
  local gpu, cpu = depth, 0
  if has_cpu and depth > 0 then
    gpu = 0
    for first = 1, depth, 1000 do
      local chunk = {}
      for i = first, math.min(depth, first + 999) do
        chunk[#chunk + 1] = key(i)
      end
      local g = redis.call('SMISMEMBER', gset, unpack(chunk))
      for i = 1, #g do
        gpu = gpu + g[i]
      end
    end
    cpu = depth - gpu
  end
  if gpu + cpu > 0 then
    out[#out + 1] = w
    out[#out + 1] = gpu
    out[#out + 1] = cpu
  end
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
