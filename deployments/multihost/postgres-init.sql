-- On the PostgreSQL server, as a superuser: `psql -f postgres-init.sql`. Two databases, two roles: the Prefect
-- server's own state, and mn-prefect's cluster store (which creates its tables and its mn_apply function the
-- first time a worker opens it). Replace the passwords; allow both roles from the cluster network in pg_hba.conf:
--   host  prefect  prefect  10.0.0.0/24  scram-sha-256
--   host  mnstore  mn       10.0.0.0/24  scram-sha-256
CREATE ROLE prefect LOGIN PASSWORD 'CHANGE-ME';
CREATE DATABASE prefect OWNER prefect;
CREATE ROLE mn LOGIN PASSWORD 'CHANGE-ME';
CREATE DATABASE mnstore OWNER mn;
-- Prefect's migrations create the pg_trgm extension (trusted since PostgreSQL 13: the owner may create it).
\connect prefect
CREATE EXTENSION IF NOT EXISTS pg_trgm;
