"""The Lua scripts :class:`~kvpolicy.directory.redis.RedisDirectory` runs in Redis: each one call's whole work, bounded
in the script itself (keys per call, holders per key, the capacity walk, an LRU page) so that no caller can make
Redis work without limit — see :mod:`.redis` for what each script decides."""

from __future__ import annotations

from .base import MAX_EXPIRES_AT_S, MAX_HOLDERS_LIMIT, MAX_KEYS_PER_CALL

# A holder's value ends in its own expiry (absolute seconds; '' = none): the entry is live while that is ahead.
# A hash lives as long as its longest-lived holder — persistent if any holder is, else until the latest expiry —
# recomputed after every change to its holders, so removing the long-lived one never leaves expired ones behind.

_HOLDERS = """
local MAXK = %(maxk)d
local MAXH = %(maxh)d
local MAXEXP = %(maxexp)d
local function too_many(n)
  if n > MAXK then return redis.error_reply('ERR kvpolicy: at most ' .. MAXK .. ' keys a call, got ' .. n) end
  return nil
end
-- a stored value, size|tier|digest hex|expiry: (true, expiry or nil), or false for anything else (written past the
-- scripts by a tenant's own ACL user): such a value is no live holder
local function parse(v)
  local size, tier, digest, e = string.match(v, '^(%%d+)|([^|]+)|(%%x*)|([^|]*)$')
  if size == nil or #digest %% 2 == 1 then return false, nil end
  if e == '' then return true, nil end
  local n = tonumber(e)
  if n == nil or n ~= n or n < 0 or n > MAXEXP then return false, nil end
  return true, n
end
local function live_value(v, now)
  local ok, e = parse(v)
  return ok and (e == nil or e > now)
end
local function live(key, now)
  for _, v in ipairs(redis.call('HVALS', key)) do
    if live_value(v, now) then return true end
  end
  return false
end
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function reset_expiry(key)
  local vals = redis.call('HVALS', key)
  if #vals == 0 then return end
  local latest = 0
  for _, v in ipairs(vals) do
    local ok, e = parse(v)
    if ok then
      if e == nil then
        redis.call('PERSIST', key)
        return
      end
      local ms = math.floor(e * 1000)
      if ms > latest then latest = ms end
    end
  end
  if latest > 0 then redis.call('PEXPIREAT', key, string.format('%%d', latest)) end
end
""" % {"maxk": MAX_KEYS_PER_CALL, "maxh": MAX_HOLDERS_LIMIT, "maxexp": int(MAX_EXPIRES_AT_S)}


_MATCH = _HOLDERS + """
local bad = too_many(#KEYS - 2)
if bad then return bad end
local n = 0
local now = now_s()
for i = 3, #KEYS do
  if not live(KEYS[i], now) then break end
  n = n + 1
end
if n > 0 then
  local tick = redis.call('INCRBY', KEYS[2], n)
  for i = 1, n do redis.call('ZADD', KEYS[1], tick - i + 1, ARGV[i]) end
end
return n
"""


# the spread layout: KEYS: lru, clock, then one hash per key (a group's keys, in chain order); ARGV: hex per key.
# Answers 1/0 per key (live or not) and touches the live ones, the earliest in the chain newest
_MATCH_EACH = _HOLDERS + """
local bad = too_many(#KEYS - 2)
if bad then return bad end
local now = now_s()
local flags = {}
local n = 0
for i = 3, #KEYS do
  if live(KEYS[i], now) then flags[i - 2] = 1; n = n + 1 else flags[i - 2] = 0 end
end
if n > 0 then
  local tick = redis.call('INCRBY', KEYS[2], n)
  local j = 0
  for i = 3, #KEYS do
    if flags[i - 2] == 1 then redis.call('ZADD', KEYS[1], tick - j, ARGV[i - 2]); j = j + 1 end
  end
end
return flags
"""


# the spread layout, every group a node holds in one call (Redis >= 7.0's script flag: keys of several slots, all on the
# node that runs it; a cluster checks that the keys a call *declares* share a slot, so only the first group's LRU is
# declared — it routes the call — and the script reads every name from ARGV): ARGV: the number of groups, each group's
# key count, then per group its lru, its clock, and per key its hash's name and its hex. Answers 1/0 per key in that
# order and touches the live ones in their group's LRU, as _MATCH_EACH does for one group
_MATCH_NODE = "#!lua flags=allow-cross-slot-keys\n" + _HOLDERS + """
local now = now_s()
local groups = tonumber(ARGV[1])
if groups == nil or groups < 1 or groups > MAXK or #ARGV < 1 + groups then return redis.error_reply('ERR kvpolicy: bad group count') end
local total = 0
for g = 1, groups do
  local c = tonumber(ARGV[1 + g])
  if c == nil or c < 0 then return redis.error_reply('ERR kvpolicy: bad key count') end
  total = total + c
end
local bad = too_many(total)
if bad then return bad end
if #ARGV ~= 1 + groups + 2 * groups + 2 * total then return redis.error_reply('ERR kvpolicy: bad argument count') end
local out = {}
local a = groups + 2
for g = 1, groups do
  local cnt = tonumber(ARGV[1 + g])
  local lru, clock = ARGV[a], ARGV[a + 1]
  a = a + 2
  local flags = {}
  local n = 0
  for i = 1, cnt do
    if live(ARGV[a + 2 * (i - 1)], now) then flags[i] = 1; n = n + 1 else flags[i] = 0 end
  end
  if n > 0 then
    local tick = redis.call('INCRBY', clock, n)
    local j = 0
    for i = 1, cnt do
      if flags[i] == 1 then redis.call('ZADD', lru, tick - j, ARGV[a + 2 * (i - 1) + 1]); j = j + 1 end
    end
  end
  for i = 1, cnt do out[#out + 1] = flags[i] end
  a = a + 2 * cnt
end
return out
"""


# KEYS: lru, clock, then one hash per entry
# ARGV: max_keys, lease_prefix, max_holders, then per entry: hex, holder, value, expire_at_ms ('' = none)
_PUBLISH = _HOLDERS + """
local bad = too_many(#KEYS - 2)
if bad then return bad end
if #ARGV ~= 3 + 4 * (#KEYS - 2) then return redis.error_reply('ERR kvpolicy: bad argument count') end
-- every entry is checked before anything is written (a script is not undone by an error: a PEXPIREAT that failed
-- after its HSET left entries stored past every bound)
for i = 3, #KEYS do
  local j = (i - 3) * 4 + 4
  local ok, e = parse(ARGV[j + 2])
  if not ok or ARGV[j + 1] == '' or #ARGV[j + 1] > 256 then return redis.error_reply('ERR kvpolicy: malformed entry ' .. (i - 2)) end
  local exp = ARGV[j + 3]
  if exp ~= '' and (string.match(exp, '^%d+$') == nil or tonumber(exp) > MAXEXP * 1000) then
    return redis.error_reply('ERR kvpolicy: malformed expiry ' .. (i - 2))
  end
end
local tick = redis.call('INCRBY', KEYS[2], #KEYS - 2)
local n = 0
local refused = 0
local maxh = math.min(tonumber(ARGV[3]) or 1, MAXH)
local now = now_s()
for i = 3, #KEYS do
  local j = (i - 3) * 4 + 4
  local hex, holder, value, exp = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local room = redis.call('HEXISTS', KEYS[i], holder) == 1 or redis.call('HLEN', KEYS[i]) < maxh
  if not room then  -- full of holders: the expired ones make room first (at most maxh values read)
    local all = redis.call('HGETALL', KEYS[i])
    for k = 1, #all, 2 do
      if not live_value(all[k + 1], now) then redis.call('HDEL', KEYS[i], all[k]) end
    end
    room = redis.call('HLEN', KEYS[i]) < maxh
  end
  if room then
    redis.call('HSET', KEYS[i], holder, value)
    reset_expiry(KEYS[i])
    redis.call('ZADD', KEYS[1], tick - (i - 3), hex)
    n = n + 1
  else
    refused = refused + 1
  end
end
local maxk = tonumber(ARGV[1])
local excess = redis.call('ZCARD', KEYS[1]) - maxk
local evicted = 0
if excess > 0 then
  -- walk the LRU from its oldest end in windows, past leased keys, until the bound holds or nothing is left
  -- at most 2 * MAXK + 64 candidates a call (a tenant's own call with max_keys 0 cannot make one call evict the
  -- tenant whole): what is left over, the next publish takes
  local base = string.sub(KEYS[1], 1, -4)
  local start = 0
  local budget = 2 * MAXK + 64
  while excess > 0 and budget > 0 do
    local cands = redis.call('ZRANGE', KEYS[1], start, start + math.min(excess + 63, budget - 1))
    budget = budget - #cands
    if #cands == 0 then break end
    local kept = 0
    for _, hex in ipairs(cands) do
      if excess <= 0 then break end
      local b = base .. 'b:' .. hex
      if redis.call('EXISTS', b) == 0 then
        redis.call('ZREM', KEYS[1], hex)
        excess = excess - 1
      elseif redis.call('EXISTS', ARGV[2] .. hex) == 0 then
        redis.call('DEL', b)
        redis.call('ZREM', KEYS[1], hex)
        excess = excess - 1
        evicted = evicted + 1
      else
        kept = kept + 1
      end
    end
    start = start + kept
  end
end
return {n, evicted, refused}
"""


# KEYS: lru, then one hash per key; ARGV: force ('1'/'0'), holder ('' = all), lease_prefix, then hex per key
_EVICT = _HOLDERS + """
local bad = too_many(#KEYS - 1)
if bad then return bad end
local n = 0
local now = now_s()
for i = 2, #KEYS do
  local hex = ARGV[i + 2]
  if ARGV[1] == '1' or redis.call('EXISTS', ARGV[3] .. hex) == 0 then
    if ARGV[2] == '' then
      if live(KEYS[i], now) then n = n + 1 end
      redis.call('DEL', KEYS[i])
      redis.call('ZREM', KEYS[1], hex)
    else
      local v = redis.call('HGET', KEYS[i], ARGV[2])
      if v then
        if live_value(v, now) then n = n + 1 end
        redis.call('HDEL', KEYS[i], ARGV[2])
        reset_expiry(KEYS[i])
      end
      if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('ZREM', KEYS[1], hex) end
    end
  end
end
return n
"""


# a key's leases are a set of lease ids (expiring with the longest): releasing one twice is a no-op
_LEASE = _HOLDERS + """
local bad = too_many(#KEYS)
if bad then return bad end
local t = redis.call('TIME')
for i = 1, #KEYS do
  redis.call('SADD', KEYS[i], ARGV[2])
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return {#KEYS, t[1], t[2]}
"""


_RELEASE = _HOLDERS + """
local bad = too_many(#KEYS)
if bad then return bad end
for i = 1, #KEYS do
  redis.call('SREM', KEYS[i], ARGV[1])
  if redis.call('SCARD', KEYS[i]) == 0 then redis.call('DEL', KEYS[i]) end
end
return #KEYS
"""


# one page of a holder's removal: ARGV: holder, the LRU score the last page ended at ('' = from the start). At most MAXK
# keys of the LRU a call (a 300k-key tenant in one script held the server 6.1 s: other tenants' calls failed BUSY).
# Scores only grow (a touch moves a key to a new tick), so walking by score never skips a key that stays put; a key
# touched meanwhile is met again, later, and removing a holder twice is a no-op. Answers {removed live, next cursor or ''}
_CLEAR_HOLDER = _HOLDERS + """
local n = 0
local now = now_s()
local base = string.sub(KEYS[1], 1, -4)
local from = '-inf'
if ARGV[2] ~= '' then from = '(' .. ARGV[2] end
local items = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES', 'LIMIT', 0, MAXK)
for i = 1, #items, 2 do
  local b = base .. 'b:' .. items[i]
  local v = redis.call('HGET', b, ARGV[1])
  if v then
    if live_value(v, now) then n = n + 1 end
    redis.call('HDEL', b, ARGV[1])
    reset_expiry(b)
  end
  if redis.call('EXISTS', b) == 0 then redis.call('ZREM', KEYS[1], items[i]) end
end
local nxt = ''
if #items == 2 * MAXK then nxt = items[#items] end
return {n, nxt}
"""
