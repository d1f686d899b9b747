-- A store written by mn_prefect at commit c23ad85 (schema 6) (tests/stores/write_store.py).
BEGIN TRANSACTION;
CREATE TABLE mn_bookings (
	job_id VARCHAR NOT NULL, 
	fingerprint VARCHAR NOT NULL, 
	placements VARCHAR NOT NULL, 
	demands VARCHAR NOT NULL, 
	committed_at FLOAT NOT NULL, 
	PRIMARY KEY (job_id)
);
INSERT INTO "mn_bookings" VALUES('job-gpu','6a1df1fee4610b1dc15f34cfbeaf5ea7','[{"agent_id":"w","source_agent_id":"w","node":"g-1","resources":{"cpu_cores":2.0,"memory_mb":1024.0,"disk_mb":0.0,"gpu_count":1},"allocation":{"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"shares":[],"ports":[{"label":"api","port":8080,"protocol":"tcp","dynamic":false}],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null,\"group\":null,\"reservation\":null,\"reserves\":null,\"hold\":null,\"hold_for\":null,\"hold_queue\":null,\"hold_start\":null,\"ends_by\":null,\"over_hold\":null,\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"],\"mig_mode\":false,\"parent\":null,\"mig_profile\":null}],\"shares\":[],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"g-1","MN_ALLOCATED_DEVICE_IDS":"g0","CUDA_VISIBLE_DEVICES":"0","CUDA_DEVICE_ORDER":"PCI_BUS_ID","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":"","MN_GPU_DRIVER":"cuda","MN_PORT_API":"8080"},"locality":"job_colocated","score":0.464988,"preferred":null,"job_id":null,"group":null,"reservation":null,"reserves":null,"hold":null,"hold_for":null,"hold_queue":null,"hold_start":null,"ends_by":null,"over_hold":null,"queue":null,"priority":null,"preemptible":null,"min_runtime_s":null,"preempts":[]}]','{"g-1":{"version":1,"ceiling":{"cpu":8.0,"mem":16384.0,"disk":100000.0,"gpu":2.0,"share:g0":1.0},"add":{"cpu":2.0,"mem":1024.0,"disk":0.0,"gpu":1.0,"share:g0":1.0},"claim":{"device":["g0"],"port":["tcp:8080"],"reservation":[]}}}',1.79628110341269707677e+09);
INSERT INTO "mn_bookings" VALUES('job-cpu','c595228a2cd79f79d395724a92f0955d','[{"agent_id":"w","source_agent_id":"w","node":"c-1","resources":{"cpu_cores":1.0,"memory_mb":512.0,"disk_mb":0.0,"gpu_count":0},"allocation":{"devices":[],"shares":[],"ports":[],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null,\"group\":null,\"reservation\":null,\"reserves\":null,\"hold\":null,\"hold_for\":null,\"hold_queue\":null,\"hold_start\":null,\"ends_by\":null,\"over_hold\":null,\"devices\":[],\"shares\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"c-1","MN_ALLOCATED_DEVICE_IDS":"","CUDA_VISIBLE_DEVICES":"","CUDA_DEVICE_ORDER":"PCI_BUS_ID","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":""},"locality":"job_colocated","score":0.317608,"preferred":null,"job_id":null,"group":null,"reservation":null,"reserves":null,"hold":null,"hold_for":null,"hold_queue":null,"hold_start":null,"ends_by":null,"over_hold":null,"queue":null,"priority":null,"preemptible":null,"min_runtime_s":null,"preempts":[]}]','{"c-1":{"version":1,"ceiling":{"cpu":4.0,"mem":8192.0,"disk":100000.0,"gpu":0.0},"add":{"cpu":1.0,"mem":512.0,"disk":0.0,"gpu":0.0},"claim":{"device":[],"port":[],"reservation":[]}}}',1.79628110341471362116e+09);
CREATE TABLE mn_changes (
	topic VARCHAR NOT NULL, 
	seq INTEGER NOT NULL, 
	PRIMARY KEY (topic)
);
INSERT INTO "mn_changes" VALUES('capacity',2);
INSERT INTO "mn_changes" VALUES('placed:g-1',1);
INSERT INTO "mn_changes" VALUES('placed:c-1',1);
CREATE TABLE mn_events (
	id INTEGER NOT NULL, 
	at FLOAT NOT NULL, 
	kind VARCHAR NOT NULL, 
	node VARCHAR, 
	job_id VARCHAR, 
	reason VARCHAR, 
	data VARCHAR NOT NULL, 
	PRIMARY KEY (id)
);
CREATE TABLE mn_groups (
	name VARCHAR NOT NULL, 
	created_at FLOAT NOT NULL, 
	PRIMARY KEY (name)
);
CREATE TABLE mn_held (
	node VARCHAR NOT NULL, 
	kind VARCHAR NOT NULL, 
	"key" VARCHAR NOT NULL, 
	job_id VARCHAR NOT NULL, 
	PRIMARY KEY (node, kind, "key")
);
INSERT INTO "mn_held" VALUES('g-1','device','g0','job-gpu');
INSERT INTO "mn_held" VALUES('g-1','port','tcp:8080','job-gpu');
CREATE TABLE mn_history (
	id INTEGER NOT NULL, 
	job_id VARCHAR NOT NULL, 
	placements VARCHAR NOT NULL, 
	committed_at FLOAT NOT NULL, 
	released_at FLOAT, 
	PRIMARY KEY (id)
);
INSERT INTO "mn_history" VALUES(1,'job-gpu','[{"agent_id":"w","source_agent_id":"w","node":"g-1","resources":{"cpu_cores":2.0,"memory_mb":1024.0,"disk_mb":0.0,"gpu_count":1},"allocation":{"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"shares":[],"ports":[{"label":"api","port":8080,"protocol":"tcp","dynamic":false}],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"g-1\",\"resources\":{\"cpu_cores\":2.0,\"memory_mb\":1024.0,\"disk_mb\":0.0,\"gpu_count\":1},\"locality\":\"job_colocated\",\"score\":0.464988,\"preferred\":null,\"job_id\":null,\"group\":null,\"reservation\":null,\"reserves\":null,\"hold\":null,\"hold_for\":null,\"hold_queue\":null,\"hold_start\":null,\"ends_by\":null,\"over_hold\":null,\"devices\":[{\"id\":\"g0\",\"index\":0,\"kind\":\"gpu\",\"vendor\":\"nvidia\",\"driver\":\"cuda\",\"model\":\"nvidia-16384\",\"memory_total_mb\":16384.0,\"memory_free_mb\":16384.0,\"api_version\":\"12.4\",\"capabilities\":[\"fp16\"],\"mig_mode\":false,\"parent\":null,\"mig_profile\":null}],\"shares\":[],\"ports\":[{\"label\":\"api\",\"port\":8080,\"protocol\":\"tcp\",\"dynamic\":false}],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"g-1","MN_ALLOCATED_DEVICE_IDS":"g0","CUDA_VISIBLE_DEVICES":"0","CUDA_DEVICE_ORDER":"PCI_BUS_ID","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":"","MN_GPU_DRIVER":"cuda","MN_PORT_API":"8080"},"locality":"job_colocated","score":0.464988,"preferred":null,"job_id":null,"group":null,"reservation":null,"reserves":null,"hold":null,"hold_for":null,"hold_queue":null,"hold_start":null,"ends_by":null,"over_hold":null,"queue":null,"priority":null,"preemptible":null,"min_runtime_s":null,"preempts":[]}]',1.79628110341269707677e+09,NULL);
INSERT INTO "mn_history" VALUES(2,'job-cpu','[{"agent_id":"w","source_agent_id":"w","node":"c-1","resources":{"cpu_cores":1.0,"memory_mb":512.0,"disk_mb":0.0,"gpu_count":0},"allocation":{"devices":[],"shares":[],"ports":[],"volumes":[],"runtime_driver":"host_local"},"env":{"MN_ALLOCATION_JSON":"{\"agent_id\":\"w\",\"source_agent_id\":\"w\",\"node\":\"c-1\",\"resources\":{\"cpu_cores\":1.0,\"memory_mb\":512.0,\"disk_mb\":0.0,\"gpu_count\":0},\"locality\":\"job_colocated\",\"score\":0.317608,\"preferred\":null,\"job_id\":null,\"group\":null,\"reservation\":null,\"reserves\":null,\"hold\":null,\"hold_for\":null,\"hold_queue\":null,\"hold_start\":null,\"ends_by\":null,\"over_hold\":null,\"devices\":[],\"shares\":[],\"ports\":[],\"volumes\":[],\"runtime_driver\":\"host_local\"}","MN_NODE":"c-1","MN_ALLOCATED_DEVICE_IDS":"","CUDA_VISIBLE_DEVICES":"","CUDA_DEVICE_ORDER":"PCI_BUS_ID","ROCR_VISIBLE_DEVICES":"","HIP_VISIBLE_DEVICES":""},"locality":"job_colocated","score":0.317608,"preferred":null,"job_id":null,"group":null,"reservation":null,"reserves":null,"hold":null,"hold_for":null,"hold_queue":null,"hold_start":null,"ends_by":null,"over_hold":null,"queue":null,"priority":null,"preemptible":null,"min_runtime_s":null,"preempts":[]}]',1.79628110341471362116e+09,NULL);
CREATE TABLE mn_jobs (
	job_id VARCHAR NOT NULL, 
	name VARCHAR, 
	job_type VARCHAR, 
	status VARCHAR NOT NULL, 
	spec VARCHAR NOT NULL, 
	created_at FLOAT NOT NULL, 
	updated_at FLOAT NOT NULL, 
	PRIMARY KEY (job_id)
);
INSERT INTO "mn_jobs" VALUES('rec-1','train','batch','running','{"steps": 3}',1.79628110341502761834e+09,1.79628110341513729094e+09);
CREATE TABLE mn_leases (
	name VARCHAR NOT NULL, 
	owner VARCHAR NOT NULL, 
	epoch INTEGER NOT NULL, 
	expires_at FLOAT NOT NULL, 
	PRIMARY KEY (name)
);
CREATE TABLE mn_meta (
	"key" VARCHAR NOT NULL, 
	value VARCHAR NOT NULL, 
	PRIMARY KEY ("key")
);
INSERT INTO "mn_meta" VALUES('schema_version','6');
CREATE TABLE mn_nodes (
	name VARCHAR NOT NULL, 
	record VARCHAR NOT NULL, 
	status VARCHAR NOT NULL, 
	eligible BOOLEAN NOT NULL, 
	last_heartbeat FLOAT, 
	used VARCHAR NOT NULL, 
	version INTEGER NOT NULL, 
	node_group VARCHAR NOT NULL, 
	PRIMARY KEY (name)
);
INSERT INTO "mn_nodes" VALUES('g-1','{"name":"g-1","status":"healthy","scheduling_eligible":true,"role":"runtime","group":"default","cpu_cores":8.0,"memory_mb":16384.0,"disk_mb":100000.0,"devices":[{"id":"g0","index":0,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null},{"id":"g1","index":1,"kind":"gpu","vendor":"nvidia","driver":"cuda","model":"nvidia-16384","memory_total_mb":16384.0,"memory_free_mb":16384.0,"api_version":"12.4","capabilities":["fp16"],"mig_mode":false,"parent":null,"mig_profile":null}],"capabilities":["gpu","nvidia","cuda"],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"cpuset":null,"os":null,"arch":null}','healthy',1,1000.0,'{"cpu":2.0,"mem":1024.0,"disk":0.0,"gpu":1.0,"share:g0":1.0}',1,'default');
INSERT INTO "mn_nodes" VALUES('c-1','{"name":"c-1","status":"healthy","scheduling_eligible":true,"role":"runtime","group":"default","cpu_cores":4.0,"memory_mb":8192.0,"disk_mb":100000.0,"devices":[],"capabilities":[],"host_paths":[],"runtime_drivers":["host_local"],"profiles":[],"services":[],"labels":{},"dynamic_port_range":[20000,32000],"cpuset":null,"os":null,"arch":null}','healthy',1,1000.0,'{"cpu":1.0,"mem":512.0,"disk":0.0,"gpu":0.0}',1,'default');
CREATE INDEX ix_mn_nodes_node_group ON mn_nodes (node_group);
CREATE INDEX ix_mn_held_job_id ON mn_held (job_id);
CREATE INDEX ix_mn_history_job_id ON mn_history (job_id);
CREATE INDEX ix_mn_events_job_id ON mn_events (job_id);
CREATE INDEX ix_mn_events_node ON mn_events (node);
CREATE INDEX ix_mn_events_at ON mn_events (at);
CREATE INDEX ix_mn_jobs_status_type ON mn_jobs (status, job_type);
CREATE INDEX ix_mn_jobs_expiry ON mn_jobs ((json_extract(spec, '$.expires_at'))) WHERE job_type = 'reservation' AND status = 'active';
COMMIT;
