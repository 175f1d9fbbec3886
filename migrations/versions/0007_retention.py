"""retention: the dedupe markers' time, the final roots' index"""

from harel_store.migrate import sql_revision

revision, down_revision = "0007", "0006"
upgrade, downgrade = sql_revision("0007_retention")
