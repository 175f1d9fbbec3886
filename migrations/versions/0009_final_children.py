"""final children: the index that finds orphaned final executions"""

from harel_store.migrate import sql_revision

revision, down_revision = "0009", "0008"
upgrade, downgrade = sql_revision("0009_final_children")
