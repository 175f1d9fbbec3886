<% name = context.get("migration_name", up_revision + "_NAME") %>\
"""${message}"""

from harel_store.migrate import sql_revision

revision, down_revision = "${up_revision}", ${'"%s"' % down_revision if down_revision else "None"}
upgrade, downgrade = sql_revision("${name}")
