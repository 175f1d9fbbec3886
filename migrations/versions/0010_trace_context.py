"""trace context: the W3C traceparent of the commit that wrote a relay item"""

from harel_store.migrate import sql_revision

revision, down_revision = "0010", "0009"
upgrade, downgrade = sql_revision("0010_trace_context")
