"""claims: outbox entries, spawns and timers claimable by one worker for a lease"""

from harel_store.migrate import sql_revision

revision, down_revision = "0004", "0003"
upgrade, downgrade = sql_revision("0004_claims")
