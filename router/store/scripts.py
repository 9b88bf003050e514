"""Server-side Lua scripts of the Redis prefix index and registry, and how to call them.

Each script touches keys of one hash tag only (see :mod:`router.store.layout`), so it
runs unchanged on a single node and on a Redis Cluster shard. Scripts are composed
from shared fragments instead of repeating them.

Router keys are 63-bit, so plain non-negative decimals that Redis stores as intsets. A
write passes them as one argument each, preceded by their count: the client packs them
in C (see :mod:`router.store.connection`) and the scripts hand ranges of ``ARGV`` to
``SADD``/``SREM`` unchanged. A lookup passes a request's keys as one string of
fixed-width decimals instead: it touches O(log n) of them per candidate, so cutting out
the few it needs is cheaper for Redis than receiving hundreds of arguments. The scripts
build key names from the namespace prefix, the family tag and the worker id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

from redis.exceptions import NoScriptError, ResponseError

from router.errors import PrefixIndexError

__all__ = [
    "ACQUIRE",
    "ADD_LOAD",
    "APPLY_FAMILIES",
    "APPLY_WORKER",
    "APPLY_WORKERS",
    "CLEAR_FAMILIES",
    "FENCED_ERROR",
    "FORGET_FAMILIES",
    "HAND_OFF",
    "HEARTBEAT",
    "LOOKUP",
    "RELEASE",
    "REWRITE_HASH",
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

# Applies a set command to ARGV[first .. first + count - 1], in chunks that stay far
# below Lua's limit on unpack() results.
_SET_OP: Final = """
local function set_op(cmd, key, first, count)
  local last = first + count - 1
  for s = first, last, 4000 do
    redis.call(cmd, key, unpack(ARGV, s, math.min(s + 3999, last)))
  end
end
"""

# Applies one family's part of a write: ARGV from position a: tag, the counts of four key
# lists (GPU added, GPU removed, CPU added, CPU removed), then the lists. Returns the
# worker's entry count left in the family and the position after the family.
_FAMILY: Final = """
local function family(ns, worker, a)
  local tag = ARGV[a]
  local g = ns .. 'g:{' .. tag .. '}:' .. worker
  local c = ns .. 'c:{' .. tag .. '}:' .. worker
  local n1, n2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local n3, n4 = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local i = a + 5
  set_op('SADD', g, i, n1)
  set_op('SREM', g, i + n1, n2)
  set_op('SADD', c, i + n1 + n2, n3)
  set_op('SREM', c, i + n1 + n2 + n3, n4)
  local h = ns .. 'h:{' .. tag .. '}'
  local left = redis.call('HINCRBY', h, worker, n1 + n3 - n2 - n4)
  if left <= 0 then
    redis.call('HDEL', h, worker)
  end
  return left, i + n1 + n2 + n3 + n4
end
"""

APPLY_WORKERS: Final = (
    _SET_OP
    + _FAMILY
    + """
-- Single node: the writes of any number of workers in one atomic script, each fenced by
-- its own lease token; a worker whose token is not current is skipped and reported.
-- KEYS: per worker: lease, worker, families   ARGV: ns prefix, then per worker: token,
-- worker id, entries delta, number of its family arguments, its families.
-- Returns the ids of the workers whose writes were refused.
local ns = ARGV[1]
local refused = {}
local a, k = 2, 1
while a <= #ARGV do
  local token, worker, delta = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local stop = a + 4 + tonumber(ARGV[a + 3])
  if redis.call('GET', KEYS[k]) ~= token then
    refused[#refused + 1] = worker
  else
    local f = a + 4
    while f < stop do
      local tag, left = ARGV[f], 0
      left, f = family(ns, worker, f)
      if left > 0 then
        redis.call('SADD', KEYS[k + 2], tag)
      else
        redis.call('SREM', KEYS[k + 2], tag)
      end
    end
    redis.call('HINCRBY', KEYS[k + 1], 'entries', delta)
  end
  a, k = stop, k + 3
end
return refused
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
    + """
-- Cluster, one slot: the families of a batch that live in KEYS[1]'s slot.
-- KEYS: one holders hash of the slot   ARGV: worker id, ns prefix, then the families.
local a = 3
while a <= #ARGV do
  local _
  _, a = family(ARGV[2], ARGV[1], a)
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

ADD_LOAD: Final = """
-- A replica's load increments in one call. KEYS: the replica's load hash. ARGV: its TTL
-- in ms, then field, increment pairs.
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 0
"""

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
  -- The index is prefix-closed per chain (see router.ingest.bridge): held(i) implies
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
-- KEYS: lease, worker   ARGV: owner, ttl_ms, then the live routers as the caller knows
-- them (none: every holder counts as live)
-- Returns the new epoch, or nil when another live owner holds the lease. A lease handed
-- off to nobody in particular ('<epoch>:', see HAND_OFF) is free for any owner, and so
-- is one whose holder is not among the live routers given (its heartbeat lapsed).
local current = redis.call('GET', KEYS[1])
if current then
  local holder = string.match(current, '^%d+:(.*)$')
  if holder ~= '' and holder ~= ARGV[1] then
    local live = #ARGV == 2
    for a = 3, #ARGV do
      if ARGV[a] == holder then
        live = true
      end
    end
    if live then
      return nil
    end
  end
end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
"""

HEARTBEAT: Final = """
-- KEYS: routers   ARGV: router id ('' to only read), ttl_ms
-- Drops lapsed routers, renews the caller's heartbeat, returns the live router ids.
-- Scores are the server's clock, so replicas' clocks never need to agree.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
end
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

HAND_OFF: Final = """
-- KEYS: lease, handoff   ARGV: token, next owner ('' for any), lease ttl_ms,
--       handoff ttl_ms, state
-- Passes a held lease to the next owner with the holder's state of the worker. The
-- lease stays taken (epoch unchanged, now in the next owner's name), so no reaper
-- clears the worker meanwhile; the next owner's ACQUIRE bumps the epoch as usual.
-- Returns 1, or 0 when the caller's token is not current (nothing is written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local epoch = string.match(ARGV[1], '^(%d+):')
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[4])
return 1
"""

RELEASE: Final = """
-- KEYS: lease   ARGV: token   Deletes the lease only if the caller still holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

REWRITE_HASH: Final = """
-- KEYS: a hash   ARGV: ttl_ms, then field, value pairs (none: the hash is deleted)
-- Replaces the hash whole and sets its expiry: one key, so one call on any cluster node.
-- Pairs go in chunks of 500, far below Lua's limit on unpack() results.
redis.call('DEL', KEYS[1])
for a = 2, #ARGV, 1000 do
  redis.call('HSET', KEYS[1], unpack(ARGV, a, math.min(a + 999, #ARGV)))
end
if #ARGV > 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return 1
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
