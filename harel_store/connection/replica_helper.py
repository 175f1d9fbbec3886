"""The helper process that keeps an embedded replica's file in step with its primary.

libsql's replica sync has no timeout and holds the GIL while it waits on the network, so
it runs here, in a process of its own that the store can end at a deadline (see
`replica.Syncer`), never in the store's process. Run as a script (no harel_store import),
it reads one line of JSON from stdin (``path``, ``url``, ``token``, ``parent``,
``retry_for``), opens the
replica and syncs it, then syncs once for every line that follows; it answers each with one
line of JSON on the file descriptor it was started with as stdout: ``{}`` when the file is in
step, ``{"error": text, "type": name}`` when not. libsql's own log (it writes to stdout)
goes to stderr. It exits at the end of stdin, and with its parent (Linux).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

# sqld answers this while it compacts its replication log: the snapshot a replica that is
# behind the log's start needs comes within seconds (libsql issue 1310), so it is retried.
RETRIED = "snapshot not found"


def _die_with(parent: int) -> None:
    """Be killed when the parent dies, even in the middle of a sync (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with_errno = ctypes.CDLL(None, use_errno=True)
        with_errno.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that took effect
        os._exit(1)


def _sync(db: Any, retry_for: float) -> None:
    """One sync; one that fails with RETRIED is tried again for up to ``retry_for`` seconds,
    from where it got to (the file keeps the frames it applied)."""
    until = time.monotonic() + retry_for
    pause = 0.02
    while True:
        try:
            db.sync()
            return
        except Exception as exc:
            if RETRIED not in str(exc) or time.monotonic() + pause > until:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # this folder holds http.py: no stdlib module may be shadowed
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libsql's Rust log goes to stdout: keep it out of the answers
    config = json.loads(sys.stdin.readline() or "null")
    if not isinstance(config, dict):
        return
    _die_with(config["parent"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    os.environ.setdefault("RUST_LOG", "off")  # libsql reads it once, when imported

    def answer(exc: BaseException | None = None) -> None:
        reply: dict[str, Any] = {}
        if exc is not None:
            reply = {"error": str(exc) or type(exc).__name__, "type": type(exc).__name__}
        answers.write(json.dumps(reply) + "\n")

    try:
        import libsql

        db = libsql.connect(config["path"], sync_url=config["url"], auth_token=config["token"])
        _sync(db, config["retry_for"])
    except BaseException as exc:  # a Rust panic is a BaseException
        answer(exc)
        return
    answer()
    for _ in sys.stdin:
        try:
            _sync(db, config["retry_for"])
        except BaseException as exc:
            answer(exc)
        else:
            answer()
    db.close()


if __name__ == "__main__":
    main()
