"""A replica process that syncs without end, to be killed with -9 in the middle of a sync.

Args: primary URL, replica file. The token comes from ``HAREL_AUTH_TOKEN``. It prints its
sync helper's pid, then "syncing", then syncs until it is killed.
"""

from __future__ import annotations

import os
import sys

from harel_store import LibsqlStore


def main() -> None:
    url, path = sys.argv[1:3]
    store = LibsqlStore(path, sync_url=url, auth_token=os.environ["HAREL_AUTH_TOKEN"])
    helper = store._conn._syncer._helper  # type: ignore[attr-defined]
    print(helper.pid, flush=True)
    print("syncing", flush=True)
    while True:
        store.sync()


if __name__ == "__main__":
    main()
