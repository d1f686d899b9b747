-- A store written by mn_prefect at commit 27dd191 (schema 2) (tests/stores/write_store.py).
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
-- Name: mn_apply(text, text, jsonb, text, double precision, text, text, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.mn_apply(p_job text, p_fp text, p_plan jsonb, p_placements text, p_now double precision, p_lease text, p_owner text, p_epoch bigint) RETURNS text
    LANGUAGE plpgsql
    AS $$
DECLARE
  e record;
  n record;
BEGIN
  IF p_lease <> '' THEN
    PERFORM 1 FROM mn_leases WHERE name = p_lease AND owner = p_owner AND epoch = p_epoch AND expires_at > p_now;
    IF NOT FOUND THEN RETURN 'stale_lease'; END IF;
  END IF;
  PERFORM 1 FROM mn_nodes WHERE name IN (SELECT jsonb_object_keys(p_plan)) ORDER BY name FOR UPDATE;
  -- Anything the decision relied on changed: answer with the state now (mn_read's JSON), not just 'changed'.
  IF EXISTS (SELECT 1 FROM mn_bookings WHERE job_id = p_job) THEN RETURN mn_changed(p_plan, p_job, p_lease); END IF;
  FOR e IN SELECT key, value FROM jsonb_each(p_plan) LOOP
    SELECT version, used::jsonb AS used INTO n FROM mn_nodes WHERE name = e.key;
    IF NOT FOUND OR n.version <> (e.value ->> 'version')::bigint THEN RETURN mn_changed(p_plan, p_job, p_lease); END IF;
    IF EXISTS (SELECT 1 FROM jsonb_each_text(e.value -> 'add') a
               WHERE COALESCE((n.used ->> a.key)::float8, 0) + a.value::float8
                     > (e.value -> 'ceiling' ->> a.key)::float8 + 1e-9) THEN
      RETURN mn_changed(p_plan, p_job, p_lease);
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_each(e.value -> 'claim') c
               CROSS JOIN LATERAL jsonb_array_elements_text(c.value) AS k(key)
               JOIN mn_held h ON h.node = e.key AND h.kind = c.key AND h.key = k.key) THEN
      RETURN mn_changed(p_plan, p_job, p_lease);
    END IF;
  END LOOP;
  INSERT INTO mn_bookings (job_id, fingerprint, placements, demands, committed_at)
    VALUES (p_job, p_fp, p_placements, p_plan::text, p_now);  -- the plan is the booking's demands
  INSERT INTO mn_held (node, kind, key, job_id)
    SELECT pn.key, c.key, k.key, p_job FROM jsonb_each(p_plan) pn
    CROSS JOIN LATERAL jsonb_each(pn.value -> 'claim') c
    CROSS JOIN LATERAL jsonb_array_elements_text(c.value) AS k(key);
  UPDATE mn_nodes m SET used = (m.used::jsonb || (
      SELECT COALESCE(jsonb_object_agg(a.key, round(COALESCE((m.used::jsonb ->> a.key)::numeric, 0) + a.value::numeric, 6)),
                      '{}'::jsonb)
      FROM jsonb_each_text(pn.value -> 'add') a))::text
    FROM jsonb_each(p_plan) pn WHERE m.name = pn.key;
  INSERT INTO mn_history (job_id, placements, committed_at) VALUES (p_job, p_placements, p_now);
  -- Failpoint for the crash tests: everything is written, nothing committed; the test kills the client here.
  IF current_setting('mn.failpoint', true) = 'commit.half_written' THEN PERFORM pg_sleep(600); END IF;
  RETURN 'ok';
END $$;


--
-- Name: mn_changed(jsonb, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.mn_changed(p_plan jsonb, p_job text, p_lease text) RETURNS text
    LANGUAGE plpgsql STABLE
    AS $$
BEGIN
  RETURN mn_read(ARRAY(SELECT jsonb_object_keys(p_plan)), p_job, p_lease,
                 (SELECT jsonb_object_agg(key, value -> 'version') FROM jsonb_each(p_plan)))::text;
END $$;


--
-- Name: mn_read(text[], text, text, jsonb); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.mn_read(p_nodes text[], p_job text, p_lease text, p_known jsonb) RETURNS json
    LANGUAGE plpgsql STABLE
    AS $$
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
  UPDATE mn_nodes m SET used = (m.used::jsonb || (
      SELECT COALESCE(jsonb_object_agg(a.key,
                        greatest(round(COALESCE((m.used::jsonb ->> a.key)::numeric, 0) - a.value::numeric, 6), 0)),
                      '{}'::jsonb)
      FROM jsonb_each_text(e.value -> 'add') a))::text
    FROM jsonb_each(p_demands) e WHERE m.name = e.key;
  DELETE FROM mn_held WHERE job_id = p_job;
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
-- Name: mn_held; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_held (
    node character varying NOT NULL,
    kind character varying NOT NULL,
    key character varying NOT NULL,
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
    used character varying NOT NULL,
    version integer NOT NULL
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

INSERT INTO public.mn_bookings VALUES ('job-gpu', 'aba3cbd1d33046afe296b6365e886b6b', '[{"agent_id":"w","source_agent_id":"w","node":"g-1","resources":{"cpu_cores":2.0,"memory_mb":1024.0,"disk_mb":0.0,"gpu_count":1},"allocation":{"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"shares":[],"ports":[{"label":"api","port":8080,"protocol":"tcp","dynamic":false}],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null,\"group\":null,\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"],\"mig_mode\":false,\"parent\":null,\"mig_profile\":null}],\"shares\":[],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"g-1","MN_ALLOCATED_DEVICE_IDS":"g0","CUDA_VISIBLE_DEVICES":"0","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":"","MN_GPU_DRIVER":"cuda","MN_PORT_API":"8080"},"locality":"job_colocated","score":0.464988,"preferred":null,"job_id":null,"group":null}]', '{"g-1": {"add": {"cpu": 2.0, "gpu": 1.0, "mem": 1024.0, "disk": 0.0, "share:g0": 1.0}, "claim": {"port": ["tcp:8080"], "device": ["g0"]}, "ceiling": {"cpu": 8.0, "gpu": 2.0, "mem": 16384.0, "disk": 100000.0, "share:g0": 1.0}, "version": 1}}', 1796414399.6357286);
INSERT INTO public.mn_bookings VALUES ('job-cpu', '9b288e45e7692fa785f563e072a97eba', '[{"agent_id":"w","source_agent_id":"w","node":"c-1","resources":{"cpu_cores":1.0,"memory_mb":512.0,"disk_mb":0.0,"gpu_count":0},"allocation":{"devices":[],"shares":[],"ports":[],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null,\"group\":null,\"devices\":[],\"shares\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"c-1","MN_ALLOCATED_DEVICE_IDS":"","CUDA_VISIBLE_DEVICES":"","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":""},"locality":"job_colocated","score":0.317608,"preferred":null,"job_id":null,"group":null}]', '{"c-1": {"add": {"cpu": 1.0, "gpu": 0.0, "mem": 512.0, "disk": 0.0}, "claim": {"port": [], "device": []}, "ceiling": {"cpu": 4.0, "gpu": 0.0, "mem": 8192.0, "disk": 100000.0}, "version": 1}}', 1796414399.8714507);


--
-- Data for Name: mn_events; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: mn_held; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_held VALUES ('g-1', 'port', 'tcp:8080', 'job-gpu');
INSERT INTO public.mn_held VALUES ('g-1', 'device', 'g0', 'job-gpu');


--
-- Data for Name: mn_history; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_history VALUES (1, 'job-gpu', '[{"agent_id":"w","source_agent_id":"w","node":"g-1","resources":{"cpu_cores":2.0,"memory_mb":1024.0,"disk_mb":0.0,"gpu_count":1},"allocation":{"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"shares":[],"ports":[{"label":"api","port":8080,"protocol":"tcp","dynamic":false}],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null,\"group\":null,\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"],\"mig_mode\":false,\"parent\":null,\"mig_profile\":null}],\"shares\":[],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"g-1","MN_ALLOCATED_DEVICE_IDS":"g0","CUDA_VISIBLE_DEVICES":"0","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":"","MN_GPU_DRIVER":"cuda","MN_PORT_API":"8080"},"locality":"job_colocated","score":0.464988,"preferred":null,"job_id":null,"group":null}]', 1796414399.6357286, NULL);
INSERT INTO public.mn_history VALUES (2, 'job-cpu', '[{"agent_id":"w","source_agent_id":"w","node":"c-1","resources":{"cpu_cores":1.0,"memory_mb":512.0,"disk_mb":0.0,"gpu_count":0},"allocation":{"devices":[],"shares":[],"ports":[],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null,\"group\":null,\"devices\":[],\"shares\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"c-1","MN_ALLOCATED_DEVICE_IDS":"","CUDA_VISIBLE_DEVICES":"","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":""},"locality":"job_colocated","score":0.317608,"preferred":null,"job_id":null,"group":null}]', 1796414399.8714507, NULL);


--
-- Data for Name: mn_jobs; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_jobs VALUES ('rec-1', 'train', 'batch', 'running', '{"steps": 3}', 1796414399.9300122, 1796414399.930209);


--
-- Data for Name: mn_leases; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: mn_meta; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_meta VALUES ('schema_version', '2');
INSERT INTO public.mn_meta VALUES ('functions', 'ac36338c5d78cb23');


--
-- Data for Name: mn_nodes; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_nodes VALUES ('g-1', '{"name":"g-1","status":"healthy","scheduling_eligible":true,"role":"runtime","group":"default","cpu_cores":8.0,"memory_mb":16384.0,"disk_mb":100000.0,"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null},{"id":"g1","index":1,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"capabilities":["gpu","nvidia","cuda"],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"cpuset":null,"os":null,"arch":null}', 'healthy', true, 1000, '{"cpu": 2.000000, "gpu": 1.000000, "mem": 1024.000000, "disk": 0.000000, "share:g0": 1.000000}', 1);
INSERT INTO public.mn_nodes VALUES ('c-1', '{"name":"c-1","status":"healthy","scheduling_eligible":true,"role":"runtime","group":"default","cpu_cores":4.0,"memory_mb":8192.0,"disk_mb":100000.0,"devices":[],"capabilities":[],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"cpuset":null,"os":null,"arch":null}', 'healthy', true, 1000, '{"cpu": 1.000000, "gpu": 0.000000, "mem": 512.000000, "disk": 0.000000}', 1);


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
-- Name: mn_held mn_held_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.mn_held
    ADD CONSTRAINT mn_held_pkey PRIMARY KEY (node, kind, key);


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
-- Name: ix_mn_held_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_held_job_id ON public.mn_held USING btree (job_id);


--
-- Name: ix_mn_history_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_mn_history_job_id ON public.mn_history USING btree (job_id);


--
-- PostgreSQL database dump complete
--


