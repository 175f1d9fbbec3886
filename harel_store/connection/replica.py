"""An embedded replica: reads from a local libsql replica file, writes to its primary.

A write goes to the primary as one Hrana batch (`HranaConnection`), so the version CAS is
decided there, in one round trip. Right after a write lands (or loses its CAS) the replica
syncs, while the primary is known to be answering, so the next read sees the write, or the
version that won. If that sync fails, the next read syncs first and fails if it cannot.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any

from harel_store.batch import Batch, Conflicted, Request, statement
from harel_store.connection.hrana import HranaConnection
from harel_store.connection.local import LibsqlConnection, LocalConnection, import_libsql
from harel_store.errors import StoreError, is_driver_error, translate


class ReplicaConnection:
    def __init__(self, local: LocalConnection, primary: HranaConnection) -> None:
        self.where = f"{local.where} (replica of {primary.where})"
        self.key = primary.key  # its writes land on the primary
        self._local = local
        self._primary = primary
        self._behind = False  # a write of ours landed that the local file may not hold yet

    def execute(self, request: Request) -> Any:
        if not isinstance(request, Batch):
            if self._behind:
                self.sync()
            return self._local.execute(request)
        try:
            result = self._primary.execute(request)
        except Conflicted:
            self._catch_up()  # the caller's reload then sees the version that won
            raise
        self._catch_up()
        return result

    def _catch_up(self) -> None:
        self._behind = True
        with suppress(StoreError):
            self.sync()

    def sync(self) -> None:
        """Pull the primary's latest state into the local file."""
        self._local.sync()
        self._behind = False

    def close(self) -> None:
        self._local.close()
        self._primary.close()


def open_replica(
    path: str | Path,
    sync_url: str,
    where: str,
    *,
    auth_token: str,
    sync_interval: float | None,
    timeout: float,
    busy_timeout: float,
) -> ReplicaConnection:
    """Open (or create) the replica file and pull the primary's state into it."""
    secrets = (auth_token,) if auth_token else ()
    primary = HranaConnection(
        sync_url, where, auth_token=auth_token, timeout=timeout, busy_timeout=busy_timeout
    )
    options: dict[str, Any] = {
        "_check_same_thread": False,
        "sync_url": sync_url,
        "auth_token": auth_token,
    }
    if sync_interval is not None:
        options["sync_interval"] = sync_interval
    try:
        db = import_libsql().connect(str(path), **options)
    except BaseException as exc:
        primary.close()
        if not is_driver_error(exc):
            raise
        raise translate(exc, secrets, quoted=str(path)) from exc
    local = LibsqlConnection(db, str(path), replica=True, secrets=secrets)
    try:
        try:
            local.sync()  # opening a replica pulls nothing by itself
        except StoreError:
            # A refused token shows in the sync only as a handshake timeout (the cause goes
            # to the Rust log): ask the primary, which says so.
            primary.execute(statement("ping"))
            raise
    except BaseException:
        local.close()
        primary.close()
        raise
    return ReplicaConnection(local, primary)
