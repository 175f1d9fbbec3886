"""trace times: when each trace step was recorded"""

from harel_store.migrate import sql_revision

revision, down_revision = "0008", "0007"
upgrade, downgrade = sql_revision("0008_trace_times")
