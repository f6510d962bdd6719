-- Written for Redis's Lua 5.1, where the per-call and per-table costs are the commit's: ARGV is
-- read by index (no closure call per argument), each command's table is built once with its
-- arguments in place (no second table to copy it into, no table per audit row), and what the
-- script needs of ARGV later (the deltas, the `key:` marks) is read there again, not copied.
-- That took the script from about 200 to 155 us a step of 16 (bench/RESULTS.md).
local audit, settled, state, dict = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local A = ARGV
local i = 2
local nd = tonumber(A[i])
i = i + 1
local dfrom = i
local ask = {'HMGET', state, 'commit', 'records'}
for d = 1, nd do
  ask[d + 4] = A[i]
  i = i + 2
end
local cur = redis.call(unpack(ask))
if cur[1] == A[1] then
  -- A retry of a commit that went through: which sink it wrote to does not matter here.
  local len = redis.call('XLEN', audit)
  return {len > 0 and len or tonumber(cur[2] or '0'), 0, 0}
end
-- `head` (a command and its key, if any) and then `n` arguments of `src` from `at` on, every
-- `stride`th (2: the fields of field/value pairs), in chunks of 1,000 (for unpack); array
-- replies are joined in order (a missing value is `false`, so none is skipped). No copy of the
-- arguments is made first, and no function is called per argument.
local function chunked(head, src, at, n, stride)
  local out = {}
  for from = 0, n - 1, 1000 do
    local args = {unpack(head)}
    local o = #args
    for j = from, math.min(from + 999, n - 1) do
      args[o + 1 + j - from] = src[at + j * stride]
    end
    local got = redis.call(unpack(args))
    if type(got) == 'table' then
      for _, v in ipairs(got) do out[#out + 1] = v end
    end
  end
  return out
end
local ndict = tonumber(A[i])
i = i + 1
if ndict > 0 then
  chunked({'HSET', dict}, A, i, 2 * ndict, 1)
  i = i + 2 * ndict
end
-- The rows: one XADD table, its field names set once and its values overwritten per row.
local nfields = tonumber(A[i])
i = i + 1
local xadd = {'XADD', audit, '*'}
for f = 1, nfields do
  xadd[2 + 2 * f] = A[i]
  i = i + 1
end
local nrows = tonumber(A[i])
i = i + 1
if nfields > 0 then
  for _ = 1, nrows do
    for f = 1, nfields do
      xadd[3 + 2 * f] = A[i]
      i = i + 1
    end
    redis.call(unpack(xadd))
  end
end
-- The settled marks and the new `key:` marks go out in one HSET. `key:` marks are set only where
-- none exists (the first message of the batch to publish a key keeps it); those that existed
-- already, or came twice in the batch, are counted.
local nm = tonumber(A[i])
i = i + 1
local marks = {}
for j = 1, 2 * nm do
  marks[j] = A[i]
  i = i + 1
end
local again = 0
local nkeys = tonumber(A[i])
i = i + 1
if nkeys > 0 then
  local had = chunked({'HMGET', settled}, A, i, nkeys, 2)
  local seen = {}
  local m = #marks
  for k = 0, nkeys - 1 do
    local f = A[i + 2 * k]
    if had[k + 1] or seen[f] then
      again = again + 1
    else
      seen[f] = true
      marks[m + 1] = f
      marks[m + 2] = A[i + 2 * k + 1]
      m = m + 2
    end
  end
  i = i + 2 * nkeys
end
chunked({'HSET', settled}, marks, 1, #marks, 1)
-- Ended claims: one MGET for all, then each of ours set (published) or deleted (released).
local nclaims = tonumber(A[i])
i = i + 1
if nclaims > 0 then
  -- The value each key holds as the claims are ended one after the other (a key ended twice
  -- sees what the first end left).
  local now = {}
  for k, v in ipairs(chunked({'MGET'}, KEYS, 5, nclaims, 1)) do now[KEYS[4 + k]] = v end
  local released = {}
  for k = 1, nclaims do
    local key, value, confirmed = KEYS[4 + k], A[i], A[i + 1]
    i = i + 2
    if now[key] == value then
      if confirmed == '' then
        released[#released + 1] = key
        now[key] = false
      else
        redis.call('SET', key, confirmed, 'KEEPTTL')
        now[key] = confirmed
      end
    end
  end
  chunked({'DEL'}, released, 1, #released, 1)
end
-- The state, written once: the commit id, the counts with their deltas added, and the rows
-- kept in the log (the stream counts its own).
local records = tonumber(cur[2] or '0')
local write = {'HSET', state, 'commit', A[1]}
if nfields == 0 then
  records = records + nrows
  write[#write + 1] = 'records'
  write[#write + 1] = records
else
  records = redis.call('XLEN', audit)
end
for d = 1, nd do
  local at = dfrom + 2 * (d - 1)
  write[#write + 1] = A[at]
  write[#write + 1] = tonumber(cur[2 + d] or '0') + tonumber(A[at + 1])
end
redis.call(unpack(write))
return {records, again, 1}
