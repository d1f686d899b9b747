"""PostgreSQL functions for commit and release: one round trip each, row locks held for microseconds.

They apply the same admission rules as ``ClusterView.admit`` (used by SQLite) and the Redis Lua scripts;
the shared contract tests hold the three to the same behaviour and messages.
"""

COMMIT = r"""
CREATE OR REPLACE FUNCTION mn_commit(p_job text, p_fp text, p_demands jsonb, p_placements text, p_now float8,
                                     p_lease text, p_owner text, p_epoch bigint)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
  n record;
  node_name text;
  d jsonb;
  lim jsonb;
  pn jsonb;
  existing text;
  dev text;
  port text;
  r record;
BEGIN
  IF p_lease <> '' THEN
    PERFORM 1 FROM mn_leases WHERE name = p_lease AND owner = p_owner AND epoch = p_epoch AND expires_at > p_now;
    IF NOT FOUND THEN RETURN ARRAY['stale_lease', '', '']; END IF;
  END IF;
  PERFORM 1 FROM mn_nodes WHERE name IN (SELECT jsonb_object_keys(p_demands)) ORDER BY name FOR UPDATE;
  SELECT fingerprint INTO existing FROM mn_bookings WHERE job_id = p_job;
  IF existing IS NOT NULL THEN
    IF existing = p_fp THEN RETURN ARRAY['already', '', '']; END IF;
    RETURN ARRAY['conflict', '', 'job ' || p_job || ' already holds a different booking'];
  END IF;
  SELECT value::jsonb INTO lim FROM mn_meta WHERE key = 'limits';
  lim := COALESCE(lim, '{}'::jsonb);
  FOR node_name, d IN SELECT key, value FROM jsonb_each(p_demands) ORDER BY key LOOP
    SELECT * INTO n FROM mn_nodes WHERE name = node_name;
    IF NOT FOUND THEN RETURN ARRAY['conflict', node_name, 'unknown node: ' || node_name]; END IF;
    IF n.status NOT IN ('healthy', 'joining') THEN
      RETURN ARRAY['conflict', node_name, 'node not ready: ' || node_name || ' status ' || n.status];
    END IF;
    IF NOT n.eligible THEN RETURN ARRAY['conflict', node_name, 'scheduling ineligible: ' || node_name]; END IF;
    pn := COALESCE(lim -> 'per_node' -> node_name, '{}'::jsonb);
    FOR r IN SELECT * FROM (VALUES
        ('cpu', n.cpu_total * COALESCE((pn ->> 'cpu')::float8, (lim ->> 'cpu')::float8, 100) / 100, n.cpu_used, (d ->> 'cpu')::float8),
        ('memory', n.mem_total * COALESCE((pn ->> 'memory')::float8, (lim ->> 'memory')::float8, 100) / 100, n.mem_used, (d ->> 'mem')::float8),
        ('disk', n.disk_total * COALESCE((pn ->> 'disk')::float8, (lim ->> 'disk')::float8, 100) / 100, n.disk_used, (d ->> 'disk')::float8),
        ('gpu', floor(n.gpu_total * COALESCE((pn ->> 'gpu')::float8, (lim ->> 'gpu')::float8, 100) / 100 + 1e-9), n.gpu_used::float8,
         (d ->> 'gpu')::float8)
      ) AS c(name, cap, used, ask) LOOP
      IF r.used + r.ask > r.cap + 1e-9 THEN
        RETURN ARRAY['conflict', node_name, 'insufficient ' || r.name || ': asks ' || r.ask || ', '
                     || greatest(r.cap - r.used, 0) || ' of ' || r.cap || ' free on ' || node_name];
      END IF;
    END LOOP;
    FOR dev IN SELECT jsonb_array_elements_text(d -> 'devices') LOOP
      IF NOT (n.device_ids::jsonb ? dev) THEN
        RETURN ARRAY['conflict', node_name, 'missing devices: device ' || dev || ' is not on ' || node_name];
      END IF;
      IF EXISTS (SELECT 1 FROM mn_held_devices WHERE node = node_name AND device_id = dev) THEN
        RETURN ARRAY['conflict', node_name, 'missing devices: device ' || dev || ' on ' || node_name || ' is held'];
      END IF;
    END LOOP;
    IF (SELECT count(*) <> count(DISTINCT v) FROM jsonb_array_elements_text(d -> 'devices') v) THEN
      RETURN ARRAY['conflict', node_name, 'missing devices: a device on ' || node_name || ' is asked twice'];
    END IF;
    FOR port IN SELECT jsonb_array_elements_text(d -> 'ports') LOOP
      IF EXISTS (SELECT 1 FROM mn_held_ports WHERE node = node_name AND port_key = port) THEN
        RETURN ARRAY['conflict', node_name, 'port in use: ' || port || ' on ' || node_name];
      END IF;
    END LOOP;
    IF (SELECT count(*) <> count(DISTINCT v) FROM jsonb_array_elements_text(d -> 'ports') v) THEN
      RETURN ARRAY['conflict', node_name, 'port in use: a port on ' || node_name || ' is asked twice'];
    END IF;
  END LOOP;
  INSERT INTO mn_bookings (job_id, fingerprint, placements, demands, committed_at)
    VALUES (p_job, p_fp, p_placements, p_demands::text, p_now);
  INSERT INTO mn_held_devices (node, device_id, job_id)
    SELECT e.key, jsonb_array_elements_text(e.value -> 'devices'), p_job FROM jsonb_each(p_demands) e;
  INSERT INTO mn_held_ports (node, port_key, job_id)
    SELECT e.key, jsonb_array_elements_text(e.value -> 'ports'), p_job FROM jsonb_each(p_demands) e;
  UPDATE mn_nodes SET cpu_used = round((cpu_used + (e.value ->> 'cpu')::float8)::numeric, 6),
                      mem_used = round((mem_used + (e.value ->> 'mem')::float8)::numeric, 6),
                      disk_used = round((disk_used + (e.value ->> 'disk')::float8)::numeric, 6),
                      gpu_used = gpu_used + (e.value ->> 'gpu')::int
    FROM jsonb_each(p_demands) e WHERE mn_nodes.name = e.key;
  INSERT INTO mn_history (job_id, placements, committed_at) VALUES (p_job, p_placements, p_now);
  -- Failpoint for the crash tests: everything is written, nothing committed; the test kills the client here.
  IF current_setting('mn.failpoint', true) = 'commit.half_written' THEN PERFORM pg_sleep(600); END IF;
  RETURN ARRAY['ok', '', ''];
END $$;
"""

RELEASE = r"""
CREATE OR REPLACE FUNCTION mn_release(p_job text, p_now float8, p_lease text, p_owner text, p_epoch bigint)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  placements text;
  locked jsonb;
  p_demands jsonb;
BEGIN
  IF p_lease <> '' THEN
    PERFORM 1 FROM mn_leases WHERE name = p_lease AND owner = p_owner AND epoch = p_epoch AND expires_at > p_now;
    IF NOT FOUND THEN RETURN -1; END IF;
  END IF;
  SELECT demands::jsonb INTO locked FROM mn_bookings WHERE job_id = p_job;
  IF locked IS NULL THEN RETURN 0; END IF;
  PERFORM 1 FROM mn_nodes WHERE name IN (SELECT jsonb_object_keys(locked)) ORDER BY name FOR UPDATE;
  -- Node rows first, then the booking row (as a partial release): re-read it, a partial release may have
  -- shrunk it meanwhile. Nodes it now uses that are not locked (the job re-booked elsewhere): -2, call again.
  SELECT demands::jsonb INTO p_demands FROM mn_bookings WHERE job_id = p_job FOR UPDATE;
  IF p_demands IS NULL THEN RETURN 0; END IF;
  IF NOT (locked ?& ARRAY(SELECT jsonb_object_keys(p_demands))) THEN RETURN -2; END IF;
  DELETE FROM mn_bookings WHERE job_id = p_job RETURNING mn_bookings.placements INTO placements;
  UPDATE mn_nodes SET cpu_used = greatest(round((cpu_used - (e.value ->> 'cpu')::float8)::numeric, 6), 0),
                      mem_used = greatest(round((mem_used - (e.value ->> 'mem')::float8)::numeric, 6), 0),
                      disk_used = greatest(round((disk_used - (e.value ->> 'disk')::float8)::numeric, 6), 0),
                      gpu_used = greatest(gpu_used - (e.value ->> 'gpu')::int, 0)
    FROM jsonb_each(p_demands) e WHERE mn_nodes.name = e.key;
  DELETE FROM mn_held_devices WHERE job_id = p_job;
  DELETE FROM mn_held_ports WHERE job_id = p_job;
  UPDATE mn_history SET released_at = p_now WHERE job_id = p_job AND released_at IS NULL;
  RETURN jsonb_array_length(placements::jsonb);
END $$;
"""
