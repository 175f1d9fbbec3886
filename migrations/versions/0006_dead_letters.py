"""dead letters: attempts, last errors and dead letters of outbox entries, spawns and timers"""

from harel_store.migrate import sql_revision

revision, down_revision = "0006", "0005"
upgrade, downgrade = sql_revision("0006_dead_letters")
