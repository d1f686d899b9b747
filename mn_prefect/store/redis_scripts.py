"""Lua scripts: each runs atomically on the Redis server, so a commit is all or nothing by construction. Scripts
that change what can be placed PUBLISH it from the same step (``<prefix>changes:<topic>``, store/changes.py).

The commit script knows no admission rule (see store/admission.py): it applies a decided ticket only if what
the decision relied on still holds, generically over the dimensions and claim kinds the ticket names.

The node scripts (REGISTER, HEARTBEAT) know the node-status rule only through the lists of model/node_status.py,
written into them here (``_lua_is_one_of``): the same constants the SQL backends and lifecycle decide with.
"""

from mn_prefect.model.node_status import KEPT_ON_REGISTER, LOST, RECONNECTED


def _lua_string(value: str) -> str:
    """``value`` as a Lua string literal (a node status: plain lowercase words)."""
    assert value.isidentifier(), value
    return f"'{value}'"


def _lua_is_one_of(variable: str, values: tuple[str, ...]) -> str:
    """A Lua condition: ``variable`` equals one of ``values``."""
    return " or ".join(f"{variable} == {_lua_string(v)}" for v in values)


EVENTS_MAXLEN = "100000"  # the events stream keeps about this many (XADD MAXLEN ~), whoever writes one

# Appends one event (its JSON) to the events stream, from a script that records it with the change it reports.
_ADD_EVENT = r"""
local function add_event(p, text) redis.call('XADD', p .. 'events', 'MAXLEN', '~', '""" + EVENTS_MAXLEN + r"""', '*', 'event', text) end
"""

_NUMBERS = r"""
local function fmt(x) return string.format('%.17g', x) end
local function round6(x) return math.max(math.floor(x * 1e6 + 0.5) / 1e6, 0) end
local function held_key(p, kind, node) return p .. 'held_' .. kind .. 's:' .. node end
local function announce(p, topic) redis.call('PUBLISH', p .. 'changes:' .. topic, '1') end
"""

# The commit's read: the plan's nodes (the record only where the caller's cached version is not the current
# one), their usage and held keys, the job's booking, the limits and the lease.
_READ_FN = r"""
local function read_state(p, job, cached, kinds, lease)
  local out = {nodes = {}, booked = redis.call('HGET', p .. 'booking:' .. job, 'fingerprint'),
               limits = redis.call('HGETALL', p .. 'limits')}
  for name, version_known in pairs(cached) do
    local key = p .. 'node:' .. name
    local n = redis.call('HMGET', key, 'status', 'eligible', 'version')
    if n[1] then
      local version = tonumber(n[3] or '0')
      local held = {}
      for _, kind in ipairs(kinds) do held[kind] = redis.call('HKEYS', p .. 'held_' .. kind .. 's:' .. name) end
      local entry = {status = n[1], eligible = n[2], version = version,
                     used = redis.call('HGETALL', p .. 'usage:' .. name), held = held}
      if version ~= version_known then entry.record = redis.call('HGET', key, 'record') end
      out.nodes[name] = entry
    end
  end
  if lease ~= '' then out.lease = redis.call('HMGET', p .. 'lease:' .. lease, 'owner', 'epoch', 'expires') end
  return cjson.encode(out)
end
"""

# ARGV: prefix, job_id, {node: cached version or -1} JSON, claim kinds JSON, lease name ('' = none)
READ = _READ_FN + r"""
return read_state(ARGV[1], ARGV[2], cjson.decode(ARGV[3]), cjson.decode(ARGV[4]), ARGV[5])
"""

# ARGV: prefix, job_id, fingerprint, plan JSON {node: {version, add: {dim: n}, ceiling: {dim: n}, claim: {kind: [key]},
#       need: {kind: [key]} (optional: keys that must be held)},
#       placements JSON, now, lease name ('' = unfenced), lease owner, lease epoch, {node: cached version} JSON,
#       claim kinds JSON, how many placements, an event's JSON to record with the booking ('' = none), '1' to report
#       the master's connected replicas. The booking keeps the plan as its demands (a release reads add and claim).
# -> {'ok', commit sequence, connected replicas (-1: not asked)} | {'changed', the state now (as READ)} (decide
#    again) | {'stale_lease'}
APPLY = _NUMBERS + _ADD_EVENT + _READ_FN + r"""
local p, job = ARGV[1], ARGV[2]
local plan = cjson.decode(ARGV[4])
local now = tonumber(ARGV[6])
if ARGV[7] ~= '' then
  local l = redis.call('HMGET', p .. 'lease:' .. ARGV[7], 'owner', 'epoch', 'expires')
  if l[1] ~= ARGV[8] or l[2] ~= ARGV[9] or tonumber(l[3] or '0') <= now then return {'stale_lease'} end
end
local function changed()
  return {'changed', read_state(p, job, cjson.decode(ARGV[10]), cjson.decode(ARGV[11]), ARGV[7])}
end
if redis.call('EXISTS', p .. 'booking:' .. job) == 1 then return changed() end
local updates = {}
for node, n in pairs(plan) do
  local v = redis.call('HMGET', p .. 'node:' .. node, 'status', 'version')
  if not v[1] or tonumber(v[2] or '0') ~= n.version then return changed() end
  local dims, values = {}, {}
  for dim, _ in pairs(n.add) do dims[#dims + 1] = dim end
  local current = redis.call('HMGET', p .. 'usage:' .. node, unpack(dims))
  for i, dim in ipairs(dims) do
    local value = tonumber(current[i] or '0') + n.add[dim]
    if value > n.ceiling[dim] + 1e-9 then return changed() end
    values[#values + 1] = dim
    values[#values + 1] = fmt(round6(value))
  end
  updates[node] = values
  for kind, keys in pairs(n.claim) do
    for _, key in ipairs(keys) do
      if redis.call('HEXISTS', held_key(p, kind, node), key) == 1 then return changed() end
    end
  end
  for kind, keys in pairs(n.need or {}) do  -- keys that must still be held (a reservation the run lands in)
    for _, key in ipairs(keys) do
      if redis.call('HEXISTS', held_key(p, kind, node), key) == 0 then return changed() end
    end
  end
end
for node, n in pairs(plan) do
  redis.call('HSET', p .. 'usage:' .. node, unpack(updates[node]))
  for kind, keys in pairs(n.claim) do
    for _, key in ipairs(keys) do redis.call('HSET', held_key(p, kind, node), key, job) end
  end
end
redis.call('HSET', p .. 'booking:' .. job, 'fingerprint', ARGV[3], 'demands', ARGV[4], 'placements', ARGV[5],
           'committed_at', ARGV[6], 'count', ARGV[12])
redis.call('SADD', p .. 'active', job)
-- The placements go in as they are (a JSON array, not a string to escape); a release appends released_at.
redis.call('RPUSH', p .. 'history:' .. job, '{"committed_at":' .. ARGV[6] .. ',"placements":' .. ARGV[5] .. '}')
redis.call('SADD', p .. 'history_jobs', job)
for node, _ in pairs(plan) do announce(p, 'placed:' .. node) end  -- the nodes' workers may start it now
if (ARGV[13] or '') ~= '' then add_event(p, ARGV[13]) end
local replicas = -1
if ARGV[14] == '1' then
  replicas = tonumber(string.match(redis.call('INFO', 'replication'), 'connected_slaves:(%d+)') or '0')
end
return {'ok', tostring(redis.call('INCR', p .. 'commit_seq')), replicas}
"""

# Shared by the two release scripts: the fence (ARGV 3-6: now, lease name, owner, epoch; -1 when stale), freeing
# one node's share of a booking, and closing a booking that has nothing left.
_RELEASE_HEAD = _NUMBERS + r"""
local p, job, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
if ARGV[4] ~= '' then
  local l = redis.call('HMGET', p .. 'lease:' .. ARGV[4], 'owner', 'epoch', 'expires')
  if l[1] ~= ARGV[5] or l[2] ~= ARGV[6] or tonumber(l[3] or '0') <= now then return -1 end
end
local function free(node, d)
  if d.add == nil then  -- a booking written before dimensions were generic
    d = {add = {cpu = d.cpu, mem = d.mem, disk = d.disk, gpu = d.gpu}, claim = {device = d.devices, port = d.ports}}
  end
  local usage, dims, values = p .. 'usage:' .. node, {}, {}
  for dim, _ in pairs(d.add) do dims[#dims + 1] = dim end
  if #dims > 0 then  -- one read and one write of the node's usage, whatever the number of dimensions
    local current = redis.call('HMGET', usage, unpack(dims))
    for i, dim in ipairs(dims) do
      values[#values + 1] = dim
      values[#values + 1] = fmt(round6(tonumber(current[i] or '0') - d.add[dim]))
    end
    redis.call('HSET', usage, unpack(values))
  end
  for kind, keys in pairs(d.claim) do
    local held = held_key(p, kind, node)
    for _, key in ipairs(keys) do
      if redis.call('HGET', held, key) == job then redis.call('HDEL', held, key) end
    end
  end
end
local function close()
  redis.call('DEL', p .. 'booking:' .. job)
  redis.call('SREM', p .. 'active', job)
  local history = p .. 'history:' .. job
  local last = redis.call('LINDEX', history, -1)
  if last then  -- the entry is a JSON object: released_at goes in before its closing brace, nothing re-encoded
    redis.call('LSET', history, -1, string.sub(last, 1, -2) .. ',"released_at":' .. fmt(now) .. '}')
  end
end
"""

# ARGV: prefix, job_id, now, lease name, owner, epoch
RELEASE = _RELEASE_HEAD + r"""
local booking = redis.call('HMGET', p .. 'booking:' .. job, 'demands', 'count')
if not booking[1] then return 0 end
for node, d in pairs(cjson.decode(booking[1])) do free(node, d) end
local count = tonumber(booking[2] or '')
if count == nil then count = #cjson.decode(redis.call('HGET', p .. 'booking:' .. job, 'placements')) end
close()
announce(p, 'capacity')
return count
"""

# Partial release (one node's share of a booking). Python computes what stays; the script checks the booking
# is still the one Python read (else -2: read again), so the change is all-or-nothing.
# ARGV: prefix, job, now, lease name, owner, epoch, node, placements read ('' = no booking),
#       what goes, {node or account: demand} JSON ('' = nothing there), kept placements JSON ('' = nothing kept:
#       close the booking),
#       kept demands JSON, kept fingerprint, how many placements go, how many stay
RELEASE_NODE = _RELEASE_HEAD + r"""
local key = p .. 'booking:' .. job
if (redis.call('HGET', key, 'placements') or '') ~= ARGV[8] then return -2 end
if ARGV[9] == '' then return 0 end
for name, d in pairs(cjson.decode(ARGV[9])) do free(name, d) end
if ARGV[10] == '' then close() else
  redis.call('HSET', key, 'placements', ARGV[10], 'demands', ARGV[11], 'fingerprint', ARGV[12], 'count', ARGV[14])
end
announce(p, 'capacity')
return tonumber(ARGV[13])
"""

# The expiry index: the active reservations' ids, scored by their expiry (``<prefix>expiries``), kept by PUT_JOB in
# the step that writes the record, so finding the ones due reads only those (DUE), never every record. A store
# written before the index existed has no ``<prefix>expiries_built``: DUE builds it from the records first.
_EXPIRY_FN = r"""
local function index_expiry(p, id, text)
  local ok, row = pcall(cjson.decode, text)
  if ok and type(row) == 'table' and row.job_type == 'reservation' and row.status == 'active'
      and type(row.spec) == 'table' and type(row.spec.expires_at) == 'number' then
    redis.call('ZADD', p .. 'expiries', row.spec.expires_at, id)
  else
    redis.call('ZREM', p .. 'expiries', id)
  end
end
"""

# ARGV: prefix, job id, the record's JSON (JobRecord's: created_at and updated_at its last two fields). A record
# already stored keeps its created_at, as the SQL backends keep it: the new text takes the stored one's, in one
# step (no read by the client first). -> 1
PUT_JOB = _EXPIRY_FN + r"""
local p, id, new = ARGV[1], ARGV[2], ARGV[3]
local key = p .. 'jobs'
local old = redis.call('HGET', key, id)
if old then
  local tail = '"created_at":([^,]*)(,"updated_at":[^,]*})$'
  local created = string.match(old, tail)
  if created then new = string.gsub(new, tail, function(_, rest) return '"created_at":' .. created .. rest end) end
end
redis.call('HSET', key, id, new)
index_expiry(p, id, new)
return 1
"""

# ARGV: prefix, job id -> 1 when there was a record (removed, and from the expiry index), else 0
DELETE_JOB = r"""
local p, id = ARGV[1], ARGV[2]
redis.call('ZREM', p .. 'expiries', id)
return redis.call('HDEL', p .. 'jobs', id)
"""

# ARGV: prefix, now, how many at most -> {the records of the active reservations due by now..., the earliest expiry
# after now or '' (now itself when as many as asked were returned: more may be due)}
DUE = _EXPIRY_FN + r"""
local p, now, most = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', p .. 'expiries_built') == 0 then
  local all = redis.call('HGETALL', p .. 'jobs')
  for i = 1, #all, 2 do index_expiry(p, all[i], all[i + 1]) end
  redis.call('SET', p .. 'expiries_built', '1')
end
local out = {}
local due = redis.call('ZRANGEBYSCORE', p .. 'expiries', '-inf', now, 'LIMIT', 0, most)
if #due > 0 then out = redis.call('HMGET', p .. 'jobs', unpack(due)) end
if #due == most then  -- more may be due: the caller asks again at once
  out[#out + 1] = now
else
  local first = redis.call('ZRANGEBYSCORE', p .. 'expiries', '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  out[#out + 1] = first[2] or ''
end
return out
"""

# ARGV: prefix, name, owner, ttl seconds, now -> {epoch, expires} or {}
ACQUIRE = r"""
local key = ARGV[1] .. 'lease:' .. ARGV[2]
local now, ttl = tonumber(ARGV[5]), tonumber(ARGV[4])
local l = redis.call('HMGET', key, 'owner', 'epoch', 'expires')
local expires = tonumber(l[3] or '0')
if l[1] and expires > now and l[1] ~= ARGV[3] then return {} end
local epoch = tonumber(l[2] or '0')
if not (l[1] == ARGV[3] and expires > now) then epoch = epoch + 1 end
redis.call('HSET', key, 'owner', ARGV[3], 'epoch', tostring(epoch), 'expires', string.format('%.6f', now + ttl))
return {tostring(epoch), string.format('%.6f', now + ttl)}
"""

# ARGV: prefix, name, owner, epoch, ttl, now -> 1 renewed / 0 not ours
RENEW = r"""
local key = ARGV[1] .. 'lease:' .. ARGV[2]
local l = redis.call('HMGET', key, 'owner', 'epoch', 'expires')
if l[1] ~= ARGV[3] or l[2] ~= ARGV[4] or tonumber(l[3] or '0') <= tonumber(ARGV[6]) then return 0 end
redis.call('HSET', key, 'expires', string.format('%.6f', tonumber(ARGV[6]) + tonumber(ARGV[5])))
return 1
"""

# ARGV: prefix, name, owner, epoch
RELEASE_LEASE = r"""
local key = ARGV[1] .. 'lease:' .. ARGV[2]
local l = redis.call('HMGET', key, 'owner', 'epoch')
if l[1] ~= ARGV[3] or l[2] ~= ARGV[4] then return 0 end
redis.call('HSET', key, 'expires', '0')
return 1
"""

# ARGV: prefix, name, record JSON, status (new), eligible (new '1'/'0'), now, group. A new record may change what
# fits, so the node's version grows (commits decided on the old record read again). -> {status, eligible}, or
# {'unknown_group'} with nothing written when the group does not exist (``default`` always does). A node with no
# group field was registered before groups existed: it is in ``default``.
REGISTER = r"""
local p, name, group = ARGV[1], ARGV[2], ARGV[7]
if group ~= 'default' and redis.call('HEXISTS', p .. 'groups', group) == 0 then return {'unknown_group'} end
local key = p .. 'node:' .. name
local cur = redis.call('HMGET', key, 'status', 'eligible', 'group')
local status, eligible = ARGV[4], ARGV[5]
if cur[1] then
  if """ + _lua_is_one_of("cur[1]", KEPT_ON_REGISTER) + r""" then status = cur[1] end
  if cur[2] == '0' then eligible = '0' end
end
redis.call('SREM', p .. 'group_nodes:' .. (cur[3] or 'default'), name)
redis.call('SADD', p .. 'group_nodes:' .. group, name)
redis.call('HSET', key, 'record', ARGV[3], 'status', status, 'eligible', eligible, 'heartbeat', ARGV[6],
           'group', group)
redis.call('HINCRBY', key, 'version', 1)
redis.call('SADD', p .. 'nodes', name)
redis.call('PUBLISH', p .. 'changes:capacity', '1')  -- a node joined, came back or changed what it offers
return {status, eligible}
"""

# ARGV: prefix, group -> {'ok'} | {'unknown_group'} | {'in_use', node...}; atomic with REGISTER.
DELETE_GROUP = r"""
local p, group = ARGV[1], ARGV[2]
if redis.call('HEXISTS', p .. 'groups', group) == 0 then return {'unknown_group'} end
local members = redis.call('SMEMBERS', p .. 'group_nodes:' .. group)
if #members > 0 then return {'in_use', unpack(members)} end
redis.call('HDEL', p .. 'groups', group)
return {'ok'}
"""

# Shared by the node scripts: a node event written in the same atomic step as the change it records.
# ``at`` is the caller's number as text (the event keeps its exact value); ``reason`` is JSON (a string or null).
_NODE_EVENT = _ADD_EVENT + r"""
local function node_event(p, kind, at, node, reason, from, to)
  add_event(p,
    '{"kind":' .. cjson.encode(kind) .. ',"at":' .. at .. ',"node":' .. cjson.encode(node) .. ',"job_id":null,"reason":'
    .. reason .. ',"data":{"from":' .. cjson.encode(from) .. ',"to":' .. cjson.encode(to) .. '}}')
end
"""

# ARGV: prefix, name, now -> the new status (nil: unknown node). A reconnect writes its event (booking.reconnect_event
# words the reason the same way); which statuses a heartbeat reconnects: model/node_status.py.
HEARTBEAT = _NODE_EVENT + r"""
local p, name, now = ARGV[1], ARGV[2], ARGV[3]
local key = p .. 'node:' .. name
local cur = redis.call('HMGET', key, 'status', 'heartbeat')
local status = cur[1]
if not status then return nil end
if """ + _lua_is_one_of("status", LOST) + r""" then
  local reason = 'heartbeat received while ' .. status
  if cur[2] and cur[2] ~= '' then
    reason = reason .. ', ' .. string.format('%.0f', tonumber(now) - tonumber(cur[2])) .. ' s after the last one'
  end
  node_event(p, 'node.reconnected', now, name, cjson.encode(reason), status, """ + _lua_string(RECONNECTED) + r""")
  status = """ + _lua_string(RECONNECTED) + r"""
  redis.call('HINCRBY', key, 'version', 1)
  redis.call('PUBLISH', p .. 'changes:capacity', '1')
end
redis.call('HSET', key, 'status', status, 'heartbeat', now)
return status
"""

# ARGV: prefix, name, to status, from statuses (JSON list), eligible ('' keeps it, '1', '0'), heartbeat_before
#       ('' = any), now, reason (JSON) -> {} unknown node, {'skip'} did not apply, {'ok', record, status, eligible}.
# The rule is model/node_status.py:transition_applies.
TRANSITION_NODE = _NODE_EVENT + r"""
local p, name, to = ARGV[1], ARGV[2], ARGV[3]
local key = p .. 'node:' .. name
local cur = redis.call('HMGET', key, 'status', 'heartbeat', 'eligible', 'record')
if not cur[1] then return {} end
local allowed = false
for _, s in ipairs(cjson.decode(ARGV[4])) do
  if s == cur[1] then allowed = true end
end
if not allowed then return {'skip'} end
if ARGV[6] ~= '' and cur[2] and cur[2] ~= '' and tonumber(cur[2]) >= tonumber(ARGV[6]) then return {'skip'} end
local eligible = cur[3]
if ARGV[5] ~= '' then eligible = ARGV[5] end
redis.call('HSET', key, 'status', to, 'eligible', eligible)
redis.call('HINCRBY', key, 'version', 1)
redis.call('PUBLISH', p .. 'changes:capacity', '1')
node_event(p, 'node.' .. to, ARGV[7], name, ARGV[8], cur[1], to)
return {'ok', cur[4], to, eligible}
"""

# ARGV: prefix, with bookings ('1'/'0'), claim kinds JSON, group ('' = every node) -> everything the checker and
# planning need, read atomically. A group's nodes come from its set, so reading one group costs nothing per node
# of the others; ``default`` also takes the nodes registered before groups (no group field, in no set).
SNAPSHOT = r"""
local p = ARGV[1]
local kinds = cjson.decode(ARGV[3])
local group = ARGV[4]
local out = {nodes = {}, bookings = {}, limits = redis.call('HGETALL', p .. 'limits')}
local names
if group == '' then names = redis.call('SMEMBERS', p .. 'nodes')
elseif group ~= 'default' then names = redis.call('SMEMBERS', p .. 'group_nodes:' .. group)
else
  names = {}
  for _, name in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
    if (redis.call('HGET', p .. 'node:' .. name, 'group') or 'default') == 'default' then names[#names + 1] = name end
  end
end
for _, name in ipairs(names) do
  local n = redis.call('HMGET', p .. 'node:' .. name, 'record', 'status', 'eligible', 'heartbeat', 'version')
  local held = {}
  for _, kind in ipairs(kinds) do held[kind] = redis.call('HGETALL', p .. 'held_' .. kind .. 's:' .. name) end
  out.nodes[#out.nodes + 1] = {name = name, record = n[1], status = n[2], eligible = n[3], heartbeat = n[4] or '',
    version = n[5] or '0', used = redis.call('HGETALL', p .. 'usage:' .. name), held = held}
end
out.accounts = {}  -- queues and cohorts (store/accounts.py): not nodes, in no group
for _, name in ipairs(redis.call('SMEMBERS', p .. 'accounts')) do
  local n = redis.call('HMGET', p .. 'node:' .. name, 'record', 'version')
  if n[1] then
    out.accounts[#out.accounts + 1] = {name = name, record = n[1], version = n[2] or '0',
                                       used = redis.call('HGETALL', p .. 'usage:' .. name)}
  end
end
if ARGV[2] == '1' then
  for _, job in ipairs(redis.call('SMEMBERS', p .. 'active')) do
    out.bookings[#out.bookings + 1] = {job = job, placements = redis.call('HGET', p .. 'booking:' .. job, 'placements') or '[]'}
  end
end
return cjson.encode(out)
"""

# What store.repair_derived reads (store/repair.py): every registered node's usage and held keys, and every live
# booking's placements, in one canonical text (sorted, arrays only, so the same state always gives the same
# text): REPAIR_READ returns it, REPAIR_APPLY hashes it again and writes only if the state is still the one read.
_REPAIR_STATE = r"""
local function sorted_pairs(flat)
  local out = {}
  for i = 1, #flat, 2 do out[#out + 1] = {flat[i], flat[i + 1]} end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end
local function repair_state(p, kinds)
  local names = redis.call('SMEMBERS', p .. 'nodes')
  local jobs = redis.call('SMEMBERS', p .. 'active')
  table.sort(names)
  table.sort(jobs)
  local nodes, bookings = {}, {}
  for _, name in ipairs(names) do
    local held = {}
    for i, kind in ipairs(kinds) do held[i] = sorted_pairs(redis.call('HGETALL', held_key(p, kind, name))) end
    nodes[#nodes + 1] = {name, sorted_pairs(redis.call('HGETALL', p .. 'usage:' .. name)), held}
  end
  for _, job in ipairs(jobs) do
    bookings[#bookings + 1] = {job, redis.call('HGET', p .. 'booking:' .. job, 'placements') or '[]'}
  end
  return cjson.encode({nodes, bookings})
end
"""

# ARGV: prefix, claim kinds JSON -> the state as text: [[[node, [[dim, value]...], [[[key, job]...] per kind]]...],
#       [[job, placements JSON]...]]
REPAIR_READ = _NUMBERS + _REPAIR_STATE + r"""
return repair_state(ARGV[1], cjson.decode(ARGV[2]))
"""

# ARGV: prefix, claim kinds JSON, SHA-1 of the state text read, fixes JSON {drop: [[kind, node, key]...],
#       add: [[kind, node, key, job]...], usage: [[node, dim, value, dim, value...]...]}
# -> 1 written | 0 the state changed since it was read (nothing written: read again)
REPAIR_APPLY = _NUMBERS + _REPAIR_STATE + r"""
local p = ARGV[1]
if redis.sha1hex(repair_state(p, cjson.decode(ARGV[2]))) ~= ARGV[3] then return 0 end
local fix = cjson.decode(ARGV[4])
for _, d in ipairs(fix.drop) do redis.call('HDEL', held_key(p, d[1], d[2]), d[3]) end
for _, a in ipairs(fix.add) do redis.call('HSET', held_key(p, a[1], a[2]), a[3], a[4]) end
for _, u in ipairs(fix.usage) do redis.call('HSET', p .. 'usage:' .. u[1], unpack(u, 2)) end
announce(p, 'capacity')  -- what was held in error may fit something now
return 1
"""
