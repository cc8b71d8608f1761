SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0), extract(epoch
  FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8, current_setting('autovacuum') = 'on'
AND coalesce((
    SELECT option_value
    FROM pg_options_to_table(c.reloptions)
    WHERE option_name = 'autovacuum_enabled'), 'true')::bool, pg_total_relation_size(c.oid) + coalesce((
    SELECT sum(pg_total_relation_size(p.relid))
    FROM pg_partition_tree(c.oid) p
    WHERE p.relid <> c.oid), 0)::bigint, pg_has_role(c.relowner, 'MEMBER')
OR (
  SELECT rolsuper
  FROM pg_roles
  WHERE rolname = current_user)
OR CASE WHEN current_setting('server_version_num')::int >= 170000 THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END, EXISTS (
  SELECT 1
  FROM pg_stat_progress_vacuum v
  WHERE v.relid = c.oid)
OR EXISTS (
  SELECT 1
  FROM pg_stat_progress_analyze a
  WHERE a.relid = c.oid), CASE WHEN c.reltuples >= 0 THEN c.reltuples::float8 END, CASE WHEN NOT s.unanalyzed THEN extract(epoch
  FROM now() - s.analyzed_at)::float8 END
FROM pg_class c
LEFT JOIN LATERAL (
  SELECT sum(t.n_dead_tup)::bigint AS n_dead_tup, sum(t.n_live_tup)::bigint AS n_live_tup, max(t.last_vacuum) AS last_vacuum, max(t.last_autovacuum) AS last_autovacuum, coalesce(bool_or(t.n_live_tup + t.n_dead_tup > 0
      AND t.last_analyze IS NULL
      AND t.last_autoanalyze IS NULL), false) AS unanalyzed, min(greatest(t.last_analyze, t.last_autoanalyze)) FILTER (
    WHERE t.n_live_tup + t.n_dead_tup > 0) AS analyzed_at
  FROM pg_stat_user_tables t
  WHERE t.relid = c.oid
  OR t.relid IN (
    SELECT p.relid
    FROM pg_partition_tree(c.oid) p)) s ON true
WHERE c.oid = coalesce(to_regclass('outbox_messages')::oid, $1)
