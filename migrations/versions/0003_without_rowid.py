"""without rowid: dedupe markers, timers and trace ring keyed by their primary key alone"""

from harel_store.migrate import sql_revision

revision, down_revision = "0003", "0002"
upgrade, downgrade = sql_revision("0003_without_rowid")
