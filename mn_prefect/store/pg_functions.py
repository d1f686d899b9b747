"""PostgreSQL functions for applying a commit and for a release: one round trip each, row locks held for
microseconds; and the announcement of what they changed on the ``mn_changes`` channel (store/changes.py).

``mn_apply`` knows no admission rule (see store/admission.py): it applies a decided ticket if every node still
has the version the decision read, every dimension stays under the ceiling the rule computed and no claimed
key is held, generically over whatever dimensions and claim kinds the ticket names.
"""

import hashlib

# The commit's read: the plan's nodes, the keys held on them, the job's booking, the limits and the lease,
# in one statement (one snapshot). mn_apply answers a change with the same read, saving the next round trip.
# A node's record only where its version is not the one the caller knows (p_known: {node: version}): the
# caller keeps the texts it read. PL/pgSQL, not SQL: a session plans the statement once and keeps the plan (a
# SQL function is planned per call).
READ_FUNCTION = r"""
CREATE OR REPLACE FUNCTION mn_read(p_nodes text[], p_job text, p_lease text, p_known jsonb)
RETURNS json LANGUAGE plpgsql STABLE AS $$
BEGIN
RETURN json_build_object(
  'nodes', (SELECT COALESCE(json_agg(json_build_object('name', name, 'status', status, 'eligible', eligible,
            'version', version, 'used', used,
            'record', CASE WHEN (p_known ->> name)::bigint IS DISTINCT FROM version THEN record END)), '[]')
            FROM mn_nodes WHERE name = ANY(p_nodes)),
  'held', (SELECT COALESCE(json_agg(json_build_array(node, kind, key)), '[]') FROM mn_held WHERE node = ANY(p_nodes)),
  'booked', (SELECT fingerprint FROM mn_bookings WHERE job_id = p_job),
  'limits', (SELECT value FROM mn_meta WHERE key = 'limits'),
  'lease', (SELECT json_build_array(owner, epoch, expires_at) FROM mn_leases WHERE name = p_lease));
END $$;
"""

# mn_apply's answer when anything its ticket relied on changed: the state now, records where versions moved.
CHANGED_FUNCTION = r"""
CREATE OR REPLACE FUNCTION mn_changed(p_plan jsonb, p_job text, p_lease text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN mn_read(ARRAY(SELECT jsonb_object_keys(p_plan)), p_job, p_lease,
                 (SELECT jsonb_object_agg(key, value -> 'version') FROM jsonb_each(p_plan)))::text;
END $$;
"""

APPLY = r"""
CREATE OR REPLACE FUNCTION mn_apply(p_job text, p_fp text, p_plan jsonb, p_placements text,
                                    p_now float8, p_lease text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  e jsonb;
  n record;
  found_nodes int := 0;
  claims boolean := false;
  after jsonb := '{}'::jsonb;  -- node -> its used amounts once the ticket is applied (each node's text parsed once)
BEGIN
  IF p_lease <> '' THEN
    PERFORM 1 FROM mn_leases WHERE name = p_lease AND owner = p_owner AND epoch = p_epoch AND expires_at > p_now;
    IF NOT FOUND THEN RETURN 'stale_lease'; END IF;
  END IF;
  -- Anything the decision relied on changed (MN001): this block is undone, which also releases the node rows it
  -- locked, and the answer is the state now (mn_read's JSON), read without holding them.
  BEGIN
    -- The plan's nodes are locked and read in one statement, in name order (no deadlock between two commits).
    FOR n IN SELECT name, version, used::jsonb AS used FROM mn_nodes
             WHERE name = ANY(ARRAY(SELECT jsonb_object_keys(p_plan))) ORDER BY name FOR UPDATE LOOP
      found_nodes := found_nodes + 1;
      e := p_plan -> n.name;
      IF n.version <> (e ->> 'version')::bigint THEN RAISE EXCEPTION USING ERRCODE = 'MN001'; END IF;
      IF EXISTS (SELECT 1 FROM jsonb_each_text(e -> 'add') a
                 WHERE COALESCE((n.used ->> a.key)::float8, 0) + a.value::float8
                       > (e -> 'ceiling' ->> a.key)::float8 + 1e-9) THEN
        RAISE EXCEPTION USING ERRCODE = 'MN001';
      END IF;
      IF e -> 'claim' <> '{}'::jsonb THEN  -- keys to hold: none of them may be held already
        claims := true;
        IF EXISTS (SELECT 1 FROM jsonb_each(e -> 'claim') c
                   CROSS JOIN LATERAL jsonb_array_elements_text(c.value) AS k(key)
                   JOIN mn_held h ON h.node = n.name AND h.kind = c.key AND h.key = k.key) THEN
          RAISE EXCEPTION USING ERRCODE = 'MN001';
        END IF;
      END IF;
      -- Keys that must still be held (the reservation a run lands in); the node's row lock orders this with
      -- the release that would free them.
      IF e ? 'need' AND EXISTS (SELECT 1 FROM jsonb_each(e -> 'need') c
                 CROSS JOIN LATERAL jsonb_array_elements_text(c.value) AS k(key)
                 WHERE NOT EXISTS (SELECT 1 FROM mn_held h WHERE h.node = n.name AND h.kind = c.key AND h.key = k.key)) THEN
        RAISE EXCEPTION USING ERRCODE = 'MN001';
      END IF;
      after := after || jsonb_build_object(n.name, n.used || COALESCE((
        SELECT jsonb_object_agg(a.key, round(COALESCE((n.used ->> a.key)::numeric, 0) + a.value::numeric, 6))
        FROM jsonb_each_text(e -> 'add') a), '{}'::jsonb));
    END LOOP;
    IF found_nodes <> (SELECT count(*) FROM jsonb_object_keys(p_plan)) THEN  -- a node of the plan is gone
      RAISE EXCEPTION USING ERRCODE = 'MN001';
    END IF;
    IF EXISTS (SELECT 1 FROM mn_bookings WHERE job_id = p_job) THEN RAISE EXCEPTION USING ERRCODE = 'MN001'; END IF;
    INSERT INTO mn_bookings (job_id, fingerprint, placements, demands, committed_at)
      VALUES (p_job, p_fp, p_placements, p_plan::text, p_now);  -- the plan is the booking's demands
    IF claims THEN
      INSERT INTO mn_held (node, kind, key, job_id)
        SELECT pn.key, c.key, k.key, p_job FROM jsonb_each(p_plan) pn
        CROSS JOIN LATERAL jsonb_each(pn.value -> 'claim') c
        CROSS JOIN LATERAL jsonb_array_elements_text(c.value) AS k(key);
    END IF;
    UPDATE mn_nodes m SET used = (after -> m.name)::text WHERE m.name = ANY(ARRAY(SELECT jsonb_object_keys(after)));
    INSERT INTO mn_history (job_id, placements, committed_at) VALUES (p_job, p_placements, p_now);
    -- Failpoint for the crash tests: everything is written, nothing committed; the test kills the client here.
    IF current_setting('mn.failpoint', true) = 'commit.half_written' THEN PERFORM pg_sleep(600); END IF;
  EXCEPTION WHEN SQLSTATE 'MN001' THEN
    RETURN mn_changed(p_plan, p_job, p_lease);
  END;
  IF EXISTS (SELECT 1 FROM mn_listeners) THEN RETURN 'ok'; END IF;
  RETURN 'ok quiet';  -- no watcher listens: the client sends no announcement
END $$;
"""

RELEASE = r"""
CREATE OR REPLACE FUNCTION mn_release(p_job text, p_now float8, p_lease text, p_owner text, p_epoch bigint)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  placements text;
  read_text text;
  now_text text;
  locked jsonb;
  p_demands jsonb;
  e jsonb;
  n record;
BEGIN
  IF p_lease <> '' THEN
    PERFORM 1 FROM mn_leases WHERE name = p_lease AND owner = p_owner AND epoch = p_epoch AND expires_at > p_now;
    IF NOT FOUND THEN RETURN -1; END IF;
  END IF;
  SELECT demands INTO read_text FROM mn_bookings WHERE job_id = p_job;
  IF read_text IS NULL THEN RETURN 0; END IF;
  locked := read_text::jsonb;
  PERFORM 1 FROM mn_nodes WHERE name = ANY(ARRAY(SELECT jsonb_object_keys(locked))) ORDER BY name FOR UPDATE;
  -- Node rows first, then the booking row (as a partial release): re-read it, a partial release may have
  -- shrunk it meanwhile. Nodes it now uses that are not locked (the job re-booked elsewhere): -2, call again.
  SELECT demands INTO now_text FROM mn_bookings WHERE job_id = p_job FOR UPDATE;
  IF now_text IS NULL THEN RETURN 0; END IF;
  p_demands := CASE WHEN now_text = read_text THEN locked ELSE now_text::jsonb END;
  IF NOT (locked ?& ARRAY(SELECT jsonb_object_keys(p_demands))) THEN RETURN -2; END IF;
  DELETE FROM mn_bookings WHERE job_id = p_job RETURNING mn_bookings.placements INTO placements;
  -- Each node's used text parsed once, on the row locked above.
  FOR n IN SELECT name, used::jsonb AS cur FROM mn_nodes WHERE name = ANY(ARRAY(SELECT jsonb_object_keys(p_demands))) LOOP
    e := p_demands -> n.name;
    UPDATE mn_nodes SET used = (n.cur || COALESCE((
        SELECT jsonb_object_agg(a.key, greatest(round(COALESCE((n.cur ->> a.key)::numeric, 0) - a.value::numeric, 6), 0))
        FROM jsonb_each_text(e -> 'add') a), '{}'::jsonb))::text
      WHERE name = n.name;
  END LOOP;
  DELETE FROM mn_held WHERE job_id = p_job;
  UPDATE mn_history SET released_at = p_now WHERE job_id = p_job AND released_at IS NULL;
  RETURN json_array_length(placements::json);  -- json, not jsonb: counted, not converted
END $$;
"""

# The commit path's release: mn_release, and whether a change watcher listens (" quiet" after the count when none
# does: the client then sends no announcement). Named so that it reads as mn_release where sessions are listed.
RELEASE_HEARD = r"""
CREATE OR REPLACE FUNCTION mn_release_heard(p_job text, p_now float8, p_lease text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  n int;
BEGIN
  n := mn_release(p_job, p_now, p_lease, p_owner, p_epoch);
  IF n > 0 AND NOT EXISTS (SELECT 1 FROM mn_listeners) THEN RETURN n::text || ' quiet'; END IF;
  RETURN n::text;
END $$;
"""

# The announcement of a commit or release (store/changes.py), sent by the client once mn_apply or mn_release has
# committed: not inside them, because a transaction that notifies holds the server's one notify lock through its
# commit, WAL flush included, which serialised every commit of the cluster behind the others' flushes (with 2 ms
# flushes, 8 committers made a quarter of the commits/s; BENCHMARKS.md, "Event-driven wake-ups"). Its own
# transaction commits without waiting for the flush (an announcement needs no durability), so it holds that lock
# for microseconds. A client that dies between the two leaves a change unannounced: the workers' polls find it.
ANNOUNCE = r"""
CREATE OR REPLACE FUNCTION mn_announce(p_topics text[])
RETURNS int LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);  -- this transaction only
  PERFORM pg_notify('mn_changes', t) FROM unnest(p_topics) AS t;
  RETURN cardinality(p_topics);
END $$;
"""

# The watchers listening now (store/changes.py: each registers its session's pid when it LISTENs and removes it
# when it closes; a new one also removes the pids of sessions that are gone). mn_apply answers "ok quiet" when
# there is none and mn_release_heard "N quiet", and the client then sends no announcement: a commit or a release
# costs one transaction, not two, where no worker waits on wake-ups. A session that died registered only makes
# announcements go on.
LISTENERS = r"""
CREATE TABLE IF NOT EXISTS mn_listeners (pid integer PRIMARY KEY, since float8 NOT NULL)
"""

# Every commit and release rewrites its nodes' usage: room on each page keeps those updates on the row's own page
# (heap-only), so the table stays a few pages however many commits go by, rather than growing until a vacuum.
NODES_FILLFACTOR = "ALTER TABLE mn_nodes SET (fillfactor = 30)"

# Schema 1's commit function read columns that are gone; mn_read took no known versions before.
DROP_OLD = ("DROP FUNCTION IF EXISTS mn_commit(text, text, jsonb, text, float8, text, text, bigint)",
            "DROP FUNCTION IF EXISTS mn_read(text[], text, text)")

# Identifies this version of the functions: a store that has them is not given them again when opened.
FUNCTIONS = (LISTENERS, NODES_FILLFACTOR, READ_FUNCTION, CHANGED_FUNCTION, APPLY, RELEASE, RELEASE_HEARD, ANNOUNCE)
TAG = hashlib.sha256("".join(FUNCTIONS).encode()).hexdigest()[:16]
