"""marker trigger: a marker's insert keeps its execution's markers_since"""

from harel_store.migrate import sql_revision

revision, down_revision = "0012", "0011"
upgrade, downgrade = sql_revision("0012_marker_trigger")
