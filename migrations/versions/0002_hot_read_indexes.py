"""hot read indexes: execution summary columns, listing/timer/relay indexes, outbox created_at"""

from harel_store.migrate import sql_revision

revision, down_revision = "0002", "0001"
upgrade, downgrade = sql_revision("0002_hot_read_indexes")
