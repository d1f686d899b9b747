-- A store written by mn_prefect at commit ff6a94d (schema 1) (tests/stores/write_store.py).
--
-- PostgreSQL database dump
--



SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

--
-- Name: mn_commit(text, text, jsonb, text, double precision, text, text, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.mn_commit(p_job text, p_fp text, p_demands jsonb, p_placements text, p_now double precision, p_lease text, p_owner text, p_epoch bigint) RETURNS text[]
    LANGUAGE plpgsql
    AS $$
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


--
-- Name: mn_release(text, double precision, text, text, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.mn_release(p_job text, p_now double precision, p_lease text, p_owner text, p_epoch bigint) RETURNS integer
    LANGUAGE plpgsql
    AS $$
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


SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: mn_bookings; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_bookings (
    job_id character varying NOT NULL,
    fingerprint character varying NOT NULL,
    placements character varying NOT NULL,
    demands character varying NOT NULL,
    committed_at double precision NOT NULL
);


--
-- Name: mn_events; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_events (
    id integer NOT NULL,
    at double precision NOT NULL,
    kind character varying NOT NULL,
    node character varying,
    job_id character varying,
    reason character varying,
    data character varying NOT NULL
);


--
-- Name: mn_events_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.mn_events_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: mn_events_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.mn_events_id_seq OWNED BY public.mn_events.id;


--
-- Name: mn_held_devices; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_held_devices (
    node character varying NOT NULL,
    device_id character varying NOT NULL,
    job_id character varying NOT NULL
);


--
-- Name: mn_held_ports; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_held_ports (
    node character varying NOT NULL,
    port_key character varying NOT NULL,
    job_id character varying NOT NULL
);


--
-- Name: mn_history; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_history (
    id integer NOT NULL,
    job_id character varying NOT NULL,
    placements character varying NOT NULL,
    committed_at double precision NOT NULL,
    released_at double precision
);


--
-- Name: mn_history_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.mn_history_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: mn_history_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.mn_history_id_seq OWNED BY public.mn_history.id;


--
-- Name: mn_jobs; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_jobs (
    job_id character varying NOT NULL,
    name character varying,
    job_type character varying,
    status character varying NOT NULL,
    spec character varying NOT NULL,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);


--
-- Name: mn_leases; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_leases (
    name character varying NOT NULL,
    owner character varying NOT NULL,
    epoch integer NOT NULL,
    expires_at double precision NOT NULL
);


--
-- Name: mn_meta; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_meta (
    key character varying NOT NULL,
    value character varying NOT NULL
);


--
-- Name: mn_nodes; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_nodes (
    name character varying NOT NULL,
    record character varying NOT NULL,
    status character varying NOT NULL,
    eligible boolean NOT NULL,
    last_heartbeat double precision,
    cpu_used double precision NOT NULL,
    mem_used double precision NOT NULL,
    disk_used double precision NOT NULL,
    gpu_used integer NOT NULL,
    cpu_total double precision NOT NULL,
    mem_total double precision NOT NULL,
    disk_total double precision NOT NULL,
    gpu_total integer NOT NULL,
    device_ids character varying NOT NULL
);


--
-- Name: mn_events id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_events ALTER COLUMN id SET DEFAULT nextval('public.mn_events_id_seq'::regclass);


--
-- Name: mn_history id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_history ALTER COLUMN id SET DEFAULT nextval('public.mn_history_id_seq'::regclass);


--
-- Data for Name: mn_bookings; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_bookings VALUES ('job-gpu', '1ef87532955192089a4ec96105b47eb0', '[{"agent_id": "w", "source_agent_id": "w", "node": "g-1", "resources": {"cpu_cores": 2.0, "memory_mb": 1024.0, "disk_mb": 0.0, "gpu_count": 1}, "allocation": {"devices": [{"id": "g0", "index": 0, "kind": "gpu", "vendor": "nvidia", "driver": "cuda", "model": "nvidia-16384", "memory_total_mb": 16384.0, "memory_free_mb": 16384.0, "api_version": "12.4", "capabilities": ["fp16"]}], "ports": [{"label": "api", "port": 8080, "protocol": "tcp", "dynamic": false}], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"allocation\":{\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"]}],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null}", "MN_NODE": "g-1", "MN_ALLOCATED_DEVICE_IDS": "g0", "CUDA_VISIBLE_DEVICES": "0", "MN_GPU_DRIVER": "cuda", "MN_PORT_API": "8080"}, "locality": "job_colocated", "score": 0.464988, "preferred": null, "job_id": null}]', '{"g-1": {"cpu": 2.0, "gpu": 1, "mem": 1024.0, "disk": 0.0, "ports": ["tcp:8080"], "devices": ["g0"]}}', 1796414361.9793825);
INSERT INTO public.mn_bookings VALUES ('job-cpu', '560d2a460b7fa44a14eaf9f7217a4dbb', '[{"agent_id": "w", "source_agent_id": "w", "node": "c-1", "resources": {"cpu_cores": 1.0, "memory_mb": 512.0, "disk_mb": 0.0, "gpu_count": 0}, "allocation": {"devices": [], "ports": [], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"allocation\":{\"devices\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null}", "MN_NODE": "c-1", "MN_ALLOCATED_DEVICE_IDS": ""}, "locality": "job_colocated", "score": 0.317608, "preferred": null, "job_id": null}]', '{"c-1": {"cpu": 1.0, "gpu": 0, "mem": 512.0, "disk": 0.0, "ports": [], "devices": []}}', 1796414362.1872838);


--
-- Data for Name: mn_events; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: mn_held_devices; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_held_devices VALUES ('g-1', 'g0', 'job-gpu');


--
-- Data for Name: mn_held_ports; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_held_ports VALUES ('g-1', 'tcp:8080', 'job-gpu');


--
-- Data for Name: mn_history; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_history VALUES (1, 'job-gpu', '[{"agent_id": "w", "source_agent_id": "w", "node": "g-1", "resources": {"cpu_cores": 2.0, "memory_mb": 1024.0, "disk_mb": 0.0, "gpu_count": 1}, "allocation": {"devices": [{"id": "g0", "index": 0, "kind": "gpu", "vendor": "nvidia", "driver": "cuda", "model": "nvidia-16384", "memory_total_mb": 16384.0, "memory_free_mb": 16384.0, "api_version": "12.4", "capabilities": ["fp16"]}], "ports": [{"label": "api", "port": 8080, "protocol": "tcp", "dynamic": false}], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"allocation\":{\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"]}],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null}", "MN_NODE": "g-1", "MN_ALLOCATED_DEVICE_IDS": "g0", "CUDA_VISIBLE_DEVICES": "0", "MN_GPU_DRIVER": "cuda", "MN_PORT_API": "8080"}, "locality": "job_colocated", "score": 0.464988, "preferred": null, "job_id": null}]', 1796414361.9793825, NULL);
INSERT INTO public.mn_history VALUES (2, 'job-cpu', '[{"agent_id": "w", "source_agent_id": "w", "node": "c-1", "resources": {"cpu_cores": 1.0, "memory_mb": 512.0, "disk_mb": 0.0, "gpu_count": 0}, "allocation": {"devices": [], "ports": [], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"allocation\":{\"devices\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null}", "MN_NODE": "c-1", "MN_ALLOCATED_DEVICE_IDS": ""}, "locality": "job_colocated", "score": 0.317608, "preferred": null, "job_id": null}]', 1796414362.1872838, NULL);


--
-- Data for Name: mn_jobs; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_jobs VALUES ('rec-1', 'train', 'batch', 'running', '{"steps": 3}', 1796414362.2140524, 1796414362.214395);


--
-- Data for Name: mn_leases; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: mn_meta; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_meta VALUES ('schema_version', '1');


--
-- Data for Name: mn_nodes; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_nodes VALUES ('g-1', '{"name":"g-1","status":"healthy","scheduling_eligible":true,"role":"runtime","cpu_cores":8.0,"memory_mb":16384.0,"disk_mb":100000.0,"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"]},{"id":"g1","index":1,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"]}],"capabilities":["gpu","nvidia","cuda"],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"os":null,"arch":null}', 'healthy', true, 1000, 2, 1024, 0, 1, 8, 16384, 100000, 2, '["g0", "g1"]');
INSERT INTO public.mn_nodes VALUES ('c-1', '{"name":"c-1","status":"healthy","scheduling_eligible":true,"role":"runtime","cpu_cores":4.0,"memory_mb":8192.0,"disk_mb":100000.0,"devices":[],"capabilities":[],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"os":null,"arch":null}', 'healthy', true, 1000, 1, 512, 0, 0, 4, 8192, 100000, 0, '[]');


--
-- Name: mn_events_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.mn_events_id_seq', 1, false);


--
-- Name: mn_history_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.mn_history_id_seq', 2, true);


--
-- Name: mn_bookings mn_bookings_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_bookings
    ADD CONSTRAINT mn_bookings_pkey PRIMARY KEY (job_id);


--
-- Name: mn_events mn_events_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_events
    ADD CONSTRAINT mn_events_pkey PRIMARY KEY (id);


--
-- Name: mn_held_devices mn_held_devices_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_held_devices
    ADD CONSTRAINT mn_held_devices_pkey PRIMARY KEY (node, device_id);


--
-- Name: mn_held_ports mn_held_ports_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_held_ports
    ADD CONSTRAINT mn_held_ports_pkey PRIMARY KEY (node, port_key);


--
-- Name: mn_history mn_history_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_history
    ADD CONSTRAINT mn_history_pkey PRIMARY KEY (id);


--
-- Name: mn_jobs mn_jobs_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_jobs
    ADD CONSTRAINT mn_jobs_pkey PRIMARY KEY (job_id);


--
-- Name: mn_leases mn_leases_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_leases
    ADD CONSTRAINT mn_leases_pkey PRIMARY KEY (name);


--
-- Name: mn_meta mn_meta_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_meta
    ADD CONSTRAINT mn_meta_pkey PRIMARY KEY (key);


--
-- Name: mn_nodes mn_nodes_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_nodes
    ADD CONSTRAINT mn_nodes_pkey PRIMARY KEY (name);


--
-- Name: ix_mn_events_at; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_events_at ON public.mn_events USING btree (at);


--
-- Name: ix_mn_events_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_events_job_id ON public.mn_events USING btree (job_id);


--
-- Name: ix_mn_events_node; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_events_node ON public.mn_events USING btree (node);


--
-- Name: ix_mn_held_devices_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_held_devices_job_id ON public.mn_held_devices USING btree (job_id);


--
-- Name: ix_mn_held_ports_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_held_ports_job_id ON public.mn_held_ports USING btree (job_id);


--
-- Name: ix_mn_history_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_history_job_id ON public.mn_history USING btree (job_id);


--
-- PostgreSQL database dump complete
--


