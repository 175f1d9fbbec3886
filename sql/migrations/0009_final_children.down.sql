-- 0009 downgrade: drop the final children's index.

DROP INDEX harel_executions_final_children;
