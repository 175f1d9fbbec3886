-- 0008 downgrade: the steps' times are forgotten (SQLite >= 3.35).

ALTER TABLE harel_trace DROP COLUMN recorded_at;
