"""flows: flow keys on relay items, flow settings, and what claims need to honour them"""

from harel_store.migrate import sql_revision

revision, down_revision = "0011", "0010"
upgrade, downgrade = sql_revision("0011_flows")
