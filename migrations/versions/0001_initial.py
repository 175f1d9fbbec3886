"""initial: the seven tables of the store"""

from harel_store.migrate import sql_revision

revision, down_revision = "0001", None
upgrade, downgrade = sql_revision("0001_initial")
