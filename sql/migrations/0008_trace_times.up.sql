-- 0008: each trace step's time, epoch seconds on the database's clock when the step was
-- recorded (the engine's entry need not carry one); NULL for steps recorded before 0008.

ALTER TABLE harel_trace ADD COLUMN recorded_at REAL;
