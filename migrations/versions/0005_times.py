"""times: created_at and updated_at of executions, the outbox's source, the age of spawns"""

from harel_store.migrate import sql_revision

revision, down_revision = "0005", "0004"
upgrade, downgrade = sql_revision("0005_times")
