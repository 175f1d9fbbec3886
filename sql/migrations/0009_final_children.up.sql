-- 0009: purge_finished takes an execution whose parent row is gone (an orphan: its parent
-- purged alone, or a spawn made after gc took its parent) as the root of its own tree.
--
-- It finds them by walking the final children, least recently updated first, and keeps
-- those whose parent_id names no row (a primary-key probe each). A partial index holds the
-- final children alone, with their parent_id, so the walk reads no table row to decide: a
-- commit writes it only when a child enters a final status (or a final one is written
-- again), never on the commits of a running execution. NULL updated_at (rows written
-- before 0005) first, as in harel_executions_final_roots.
CREATE INDEX harel_executions_final_children ON harel_executions (updated_at, parent_id)
WHERE parent_id IS NOT NULL AND status IN ('finished', 'failed', 'cancelled');
