-- A store written by mn_prefect at commit 21608f1 (schema 1) (tests/stores/write_store.py).
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

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: mn_bookings; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.mn_bookings (
    job_id character varying NOT NULL,
    fingerprint character varying NOT NULL,
    placements character varying NOT NULL,
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
    gpu_used integer NOT NULL
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

INSERT INTO public.mn_bookings VALUES ('job-gpu', '1ef87532955192089a4ec96105b47eb0', '[{"agent_id": "w", "source_agent_id": "w", "node": "g-1", "resources": {"cpu_cores": 2.0, "memory_mb": 1024.0, "disk_mb": 0.0, "gpu_count": 1}, "allocation": {"devices": [{"id": "g0", "index": 0, "kind": "gpu", "vendor": "nvidia", "driver": "cuda", "model": "nvidia-16384", "memory_total_mb": 16384.0, "memory_free_mb": 16384.0, "api_version": "12.4", "capabilities": ["fp16"]}], "ports": [{"label": "api", "port": 8080, "protocol": "tcp", "dynamic": false}], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"allocation\":{\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"]}],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null}", "MN_NODE": "g-1", "MN_ALLOCATED_DEVICE_IDS": "g0", "CUDA_VISIBLE_DEVICES": "0", "MN_GPU_DRIVER": "cuda", "MN_PORT_API": "8080"}, "locality": "job_colocated", "score": 0.464988, "preferred": null, "job_id": null}]', 1796414344.0007958);
INSERT INTO public.mn_bookings VALUES ('job-cpu', '560d2a460b7fa44a14eaf9f7217a4dbb', '[{"agent_id": "w", "source_agent_id": "w", "node": "c-1", "resources": {"cpu_cores": 1.0, "memory_mb": 512.0, "disk_mb": 0.0, "gpu_count": 0}, "allocation": {"devices": [], "ports": [], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"allocation\":{\"devices\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null}", "MN_NODE": "c-1", "MN_ALLOCATED_DEVICE_IDS": ""}, "locality": "job_colocated", "score": 0.317608, "preferred": null, "job_id": null}]', 1796414344.2860215);


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

INSERT INTO public.mn_history VALUES (1, 'job-gpu', '[{"agent_id": "w", "source_agent_id": "w", "node": "g-1", "resources": {"cpu_cores": 2.0, "memory_mb": 1024.0, "disk_mb": 0.0, "gpu_count": 1}, "allocation": {"devices": [{"id": "g0", "index": 0, "kind": "gpu", "vendor": "nvidia", "driver": "cuda", "model": "nvidia-16384", "memory_total_mb": 16384.0, "memory_free_mb": 16384.0, "api_version": "12.4", "capabilities": ["fp16"]}], "ports": [{"label": "api", "port": 8080, "protocol": "tcp", "dynamic": false}], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"allocation\":{\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"]}],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null}", "MN_NODE": "g-1", "MN_ALLOCATED_DEVICE_IDS": "g0", "CUDA_VISIBLE_DEVICES": "0", "MN_GPU_DRIVER": "cuda", "MN_PORT_API": "8080"}, "locality": "job_colocated", "score": 0.464988, "preferred": null, "job_id": null}]', 1796414344.0007958, NULL);
INSERT INTO public.mn_history VALUES (2, 'job-cpu', '[{"agent_id": "w", "source_agent_id": "w", "node": "c-1", "resources": {"cpu_cores": 1.0, "memory_mb": 512.0, "disk_mb": 0.0, "gpu_count": 0}, "allocation": {"devices": [], "ports": [], "volumes": [], "runtime_driver": "host_local"}, "env": {"MN_ALLOCATION_JSON": "{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"allocation\":{\"devices\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null}", "MN_NODE": "c-1", "MN_ALLOCATED_DEVICE_IDS": ""}, "locality": "job_colocated", "score": 0.317608, "preferred": null, "job_id": null}]', 1796414344.2860215, NULL);


--
-- Data for Name: mn_jobs; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.mn_jobs VALUES ('rec-1', 'train', 'batch', 'running', '{"steps": 3}', 1796414344.430088, 1796414344.458193);


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

INSERT INTO public.mn_nodes VALUES ('g-1', '{"name":"g-1","status":"healthy","scheduling_eligible":true,"role":"runtime","cpu_cores":8.0,"memory_mb":16384.0,"disk_mb":100000.0,"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"]},{"id":"g1","index":1,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"]}],"capabilities":["gpu","nvidia","cuda"],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"os":null,"arch":null}', 'healthy', true, 1000, 2, 1024, 0, 1);
INSERT INTO public.mn_nodes VALUES ('c-1', '{"name":"c-1","status":"healthy","scheduling_eligible":true,"role":"runtime","cpu_cores":4.0,"memory_mb":8192.0,"disk_mb":100000.0,"devices":[],"capabilities":[],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"os":null,"arch":null}', 'healthy', true, 1000, 1, 512, 0, 0);


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


