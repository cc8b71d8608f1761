SELECT aggregate_type, count(*) FILTER (
  WHERE status = 'pending'
  AND available_at <= now()), count(*) FILTER (
  WHERE status = 'pending'
  AND available_at > now()), count(*) FILTER (
  WHERE status = 'processing'), count(*) FILTER (
  WHERE status = 'sent'), count(*) FILTER (
  WHERE status = 'failed'), coalesce(extract(epoch
    FROM now() - min(created_at) FILTER (
      WHERE status IN ('pending', 'processing'))), 0)::float8, count(*) FILTER (
  WHERE status = 'expired')
FROM outbox_messages
GROUP BY aggregate_type
ORDER BY aggregate_type
