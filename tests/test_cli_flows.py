"""Flow control through the ``harel-store`` command (issue 49): ``flow ls|set|pause|resume|
clear``, ``workers`` and ``release --worker``, on a local file and over a fleet; a bad value
is a usage error (exit 2, one line) that writes nothing.

The commands run in subprocesses as in tests/test_cli.py, the usage errors in this process
(`main`: they stop at the parser, before any database is opened). The databases are read
and written here only through LibsqlStore (the library the CLI uses too), each store closed
before the command runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, TimerOp
from harel_store.cli import TOP_HELP, main
from harel_store.cli.flows import rate, span
from harel_store.cli.output import when
from harel_store.models import Flow
from tests.test_cli import CLI, cli, failed, ok
from tests.test_cli_fleet import lines_of, write_fleet
from tests.test_cli_read_only import digest, read_only, unprivileged

HEADER = ["KEY", "PRIORITY", "CONCURRENCY", "PAUSED", "RATE", "PENDING", "HELD"]


def seeded(path: Path, targets: tuple[str | None, ...] = ("A.1", "A.2", "B.1")) -> str:
    """A database whose execution "src" committed an outbox entry for each target (None: a
    publish, of the key "")."""
    database = str(path)
    with LibsqlStore(database) as store:
        store.commit(
            Execution(id="src", definition_id="d"),
            [(target, Event(name="go")) for target in targets],
        )
    return database


@pytest.fixture
def db(tmp_path: Path) -> str:
    return seeded(tmp_path / "state.db")


def flows_in(database: str) -> list[Flow]:
    with LibsqlStore(database) as store:
        return store.flows()


def rows(stdout: str) -> list[list[str]]:
    """A table's rows (header first), each cell split on the runs of spaces between them."""
    return [line.split() for line in stdout.splitlines()]


def docs(stdout: str) -> list[Any]:
    return [json.loads(line) for line in stdout.splitlines()]


# --- flow


def test_flow_set_prints_and_stores_every_setting(db: str) -> None:
    out = ok(
        cli(
            "flow", "set", "A", "--priority", "-3", "--concurrency", "2",
            "--rate", "10/1m", "--url", db,
        )
    )  # fmt: skip
    assert rows(out) == [HEADER, ["A", "-3", "2", "no", "10/1m", "2", "0"]]
    assert flows_in(db) == [Flow("A", -3, 2, False, (10, 60.0), 2, 0)]

    out = ok(cli("flow", "set", "B", "--paused", "--rate", "5/90", "--json", "--url", db))
    assert docs(out) == [
        {
            "key": "B",
            "priority": 0,
            "concurrency": None,
            "paused": True,
            "rate": {"count": 5, "seconds": 90.0},
            "pending": 1,
            "held": 0,
        }
    ]

    listed = ok(cli("flow", "ls", "--url", db))
    assert rows(listed) == [
        HEADER,
        ["A", "-3", "2", "no", "10/1m", "2", "0"],
        ["B", "0", "-", "yes", "5/90s", "1", "0"],
    ]
    assert [d["key"] for d in docs(ok(cli("flow", "ls", "--json", "--url", db)))] == ["A", "B"]


def test_flow_set_replaces_every_setting(db: str) -> None:
    ok(cli("flow", "set", "A", "--concurrency", "2", "--rate", "10/1s", "--paused", "--url", db))
    out = ok(cli("flow", "set", "A", "--priority", "5", "--url", db))
    assert rows(out) == [HEADER, ["A", "5", "-", "no", "-", "2", "0"]]
    assert flows_in(db) == [Flow("A", 5, None, False, None, 2, 0)]
    ok(cli("flow", "set", "A", "--url", db))  # every setting its default: still listed
    assert flows_in(db) == [Flow("A", 0, None, False, None, 2, 0)]


def test_pause_resume_and_clear_keep_or_drop_the_settings(db: str) -> None:
    ok(cli("flow", "set", "A", "--concurrency", "1", "--rate", "3/1h", "--url", db))
    out = ok(cli("flow", "pause", "A", "--url", db))
    assert rows(out) == [HEADER, ["A", "0", "1", "yes", "3/1h", "2", "0"]]
    out = ok(cli("flow", "pause", "B", "--json", "--url", db))  # no settings: the defaults
    assert docs(out)[0] | {"key": "B"} == {
        "key": "B",
        "priority": 0,
        "concurrency": None,
        "paused": True,
        "rate": None,
        "pending": 1,
        "held": 0,
    }
    out = ok(cli("flow", "resume", "A", "--url", db))
    assert rows(out) == [HEADER, ["A", "0", "1", "no", "3/1h", "2", "0"]]
    assert [f.paused for f in flows_in(db)] == [False, True]

    # resume and clear of a key with no settings: said so, exit 0, nothing written
    assert ok(cli("flow", "resume", "C", "--url", db)) == "C has no settings: not paused\n"
    assert docs(ok(cli("flow", "resume", "C", "--json", "--url", db))) == [None]
    assert ok(cli("flow", "clear", "C", "--url", db)) == "C had no settings: nothing cleared\n"
    assert [f.key for f in flows_in(db)] == ["A", "B"]

    assert ok(cli("flow", "clear", "A", "--url", db)) == "cleared A\n"
    assert docs(ok(cli("flow", "clear", "B", "--json", "--url", db))) == [
        {"key": "B", "cleared": True}
    ]
    assert docs(ok(cli("flow", "clear", "B", "--json", "--url", db))) == [
        {"key": "B", "cleared": False}
    ]
    assert flows_in(db) == []


def test_flow_ls_counts_what_is_held_and_pending(db: str) -> None:
    ok(cli("flow", "set", "A", "--concurrency", "1", "--url", db))
    ok(cli("flow", "pause", "B", "--url", db))
    with LibsqlStore(db) as store:
        claimed = store.claim_outbox("w1", limit=10)
    assert [e.target_id for e in claimed] == ["A.1"]  # A's limit, B paused
    assert rows(ok(cli("flow", "ls", "--url", db)))[1:] == [
        ["A", "0", "1", "no", "-", "1", "1"],
        ["B", "0", "-", "yes", "-", "1", "0"],
    ]


def test_the_empty_key_and_a_key_with_control_characters_are_shown_as_typed(
    tmp_path: Path,
) -> None:
    db = seeded(tmp_path / "state.db", (None, None, "A.1"))
    out = ok(cli("flow", "set", "", "--concurrency", "0", "--url", db))
    assert rows(out) == [HEADER, ['""', "0", "0", "no", "-", "2", "0"]]
    assert ok(cli("flow", "clear", "", "--url", db)) == 'cleared ""\n'
    out = ok(cli("flow", "pause", "a\x1b[31mb", "--url", db))
    assert "\x1b" not in out and "a\\x1b[31mb" in out
    assert [f.key for f in flows_in(db)] == ["a\x1b[31mb"]


def test_nothing_listed_is_said_on_stderr(db: str) -> None:
    for command in (["flow", "ls"], ["flow", "ls", "--json"], ["workers"], ["workers", "--json"]):
        result = cli(*command, "--url", db)
        assert ok(result) == ""
        assert result.stderr.startswith("harel-store: no ") and len(result.stderr.splitlines()) == 1


def test_the_database_options_go_before_or_after_the_action(db: str, tmp_path: Path) -> None:
    elsewhere = str(tmp_path / "missing.db")
    ok(cli("--url", elsewhere, "flow", "set", "A", "--url", db))  # after it wins
    ok(cli("flow", "--url", db, "pause", "B"))
    assert [f.key for f in flows_in(db)] == ["A", "B"]
    ok(cli("flow", "clear", "A", env={"HAREL_DATABASE_URL": db}))
    assert [f.key for f in flows_in(db)] == ["B"]
    line = failed(cli("flow", "ls", "--url", elsewhere))
    assert "missing.db does not exist" in line and not Path(elsewhere).exists()


def test_flow_ls_and_workers_read_a_file_they_may_not_write(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    db = seeded(media / "state.db")
    with LibsqlStore(db) as store:
        store.set_flow("A", concurrency=1)
        store.claim_outbox("w1", limit=10, lease=3600.0)
    try:
        read_only(media)
        probe = unprivileged(sys.executable, "-c", f"open({db!r}, 'a')")
        if "PermissionError" not in probe.stderr:
            pytest.skip(f"file modes cannot be made to hold here: {probe.stderr[-200:]}")
        before = digest(media)
        listed = unprivileged(str(CLI), "flow", "ls", "--url", db)
        assert rows(ok(listed))[1:] == [["A", "0", "1", "no", "-", "1", "1"]]
        held = unprivileged(str(CLI), "workers", "--url", db)
        assert [r[:4] for r in rows(ok(held))[1:]] == [["w1", "2", "0", "0"]]  # B.1 and A's one
        refused = unprivileged(str(CLI), "flow", "pause", "A", "--url", db)
        assert "read-only" in failed(refused) or "not writable" in failed(refused)
        assert digest(media) == before  # nothing written, nothing created
    finally:
        media.chmod(0o755)


# --- bad values: exit 2, one line, nothing written


BAD = [
    (["flow", "set", "A", "--concurrency", "-1"], "argument --concurrency: must be at least 0"),
    (["flow", "set", "A", "--concurrency", "two"], "not a number: 'two'"),
    (["flow", "set", "A", "--concurrency", str(2**63)], "signed 64-bit"),
    (["flow", "set", "A", "--priority", "1.5"], "argument --priority: not a number"),
    (["flow", "set", "A", "--priority", str(-(2**63) - 1)], "signed 64-bit"),
    (["flow", "set", "A", "--rate", "10"], "argument --rate: not a rate"),
    (["flow", "set", "A", "--rate", "x/1s"], "not a rate"),
    (["flow", "set", "A", "--rate", "0/1s"], "must be at least 1, not 0"),
    (["flow", "set", "A", "--rate=-1/1s"], "not a rate"),
    (["flow", "set", "A", "--rate", "-1/1s"], "--rate: expected one argument"),
    (["flow", "set", "A", "--rate", "10/"], "not a duration"),
    (["flow", "set", "A", "--rate", "10/1s/2"], "not a duration"),
    (["flow", "set", "A", "--rate", "10/1w"], "not a duration"),
    (["flow", "set", "A", "--rate", "10/0"], "more than 0"),
    (["flow", "set", "A", "--rate", "10/0s"], "more than 0"),
    (["flow", "set", "A", "--rate", "10/366d"], "at most 365d"),
    (["flow", "set", "A", "--rate", f"{2**63}/1s"], "signed 64-bit"),
    (["flow", "set", "x" * 513], "flow key must be at most 512 characters, not 513"),
    (["flow", "pause", "\udc80"], "lone surrogate"),
    (["flow", "resume", "y" * 600], "at most 512 characters"),
    (["flow", "clear", "z" * 600], "at most 512 characters"),
    (["flow", "set"], "required: KEY"),
    (["flow", "pause"], "required: KEY"),
    (["flow"], "required: ACTION"),
    (["flow", "stop", "A"], "invalid choice: 'stop'"),
    (["flow", "ls", "A"], "unrecognized arguments: A"),
    (["flow", "pause", "A", "--priority", "1"], "unrecognized arguments: --priority"),
    (["release"], "required: --worker"),
    (["release", "--worker", ""], "worker must be 1 to 512 characters, not 0"),
    (["release", "--worker", "w" * 513], "worker must be 1 to 512 characters"),
    (["workers", "--worker", "w1"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "said"), BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_a_bad_value_exits_2_with_one_line_and_writes_nothing(
    argv: list[str], said: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with LibsqlStore(db) as store:
        store.set_flow("A", priority=1, concurrency=1)
        store.claim_outbox("w", limit=1)
        before = store.flows(), store.workers()
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--url", db])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("harel-store"), err
    assert said in err, err
    with LibsqlStore(db) as store:
        assert (store.flows(), store.workers()) == before


def test_a_bad_value_in_a_subprocess_is_one_line_too(db: str) -> None:
    line = failed(cli("flow", "set", "A", "--rate", "ten/1s", "--url", db), 2)
    assert line.startswith("harel-store flow set: error: argument --rate: not a rate"), line
    assert "see `harel-store flow set --help`" in line
    assert flows_in(db) == []


def test_the_rate_forms() -> None:
    assert rate("10/1s") == (10, 1.0)
    assert rate("10/60") == (10, 60.0)
    assert rate(" 600 / 1h ") == (600, 3600.0)
    assert rate("3/1.5m") == (3, 90.0)
    assert rate("1/0.25") == (1, 0.25)
    assert rate("7/365d") == (7, 365 * 86400.0)
    # shown as typed back: in the largest whole unit
    assert [span(s) for s in (1.0, 60.0, 90.0, 3600.0, 86400.0 * 2, 0.25, 7200.5)] == [
        "1s",
        "1m",
        "90s",
        "1h",
        "2d",
        "0.25s",
        "7200.5s",
    ]
    for seconds in (1.0, 90.0, 0.25, 7200.5, 86400.0 * 2):
        assert rate(f"1/{span(seconds)}") == (1, seconds)


# --- workers and release


def test_workers_and_release_worker_hand_the_items_back(db: str) -> None:
    with LibsqlStore(db) as store:
        claimed = store.claim_outbox("w1", limit=10)
        assert len(claimed) == 3
        holds = store.workers()
    assert [h.worker for h in holds] == ["w1"]

    out = ok(cli("workers", "--url", db))
    (header, row) = rows(out)
    assert header == ["WORKER", "OUTBOX", "SPAWNS", "TIMERS", "LEASE", "UNTIL", "LEFT"]
    assert row[:5] == ["w1", "3", "0", "0", when(holds[0].lease_until)]
    assert row[5].endswith("s")  # the time left, about 30 s
    assert docs(ok(cli("workers", "--json", "--url", db))) == [
        {"worker": "w1", "held": {"outbox": 3}, "lease_until": holds[0].lease_until}
    ]

    assert ok(cli("release", "--worker", "w2", "--url", db)) == "released 0\n"
    with LibsqlStore(db) as store:
        assert [h.worker for h in store.workers()] == ["w1"]  # another's release: not w1's
        assert store.claim_outbox("w2", limit=10) == []

    assert ok(cli("release", "--worker", "w1", "--url", db)) == "released 3\n"
    with LibsqlStore(db) as store:
        assert store.workers() == []
        again = store.claim_outbox("w2", limit=10)
        assert [e.seq for e in again] == [e.seq for e in claimed]  # claimable at once
        assert store.attempts_of(again) == [1, 1, 1]  # w1's attempt given back
    assert docs(ok(cli("release", "--worker", "w2", "--json", "--url", db))) == [
        {"worker": "w2", "released": 3}
    ]


def test_workers_counts_every_kind(tmp_path: Path) -> None:
    db = str(tmp_path / "state.db")

    with LibsqlStore(db) as store:
        exe = Execution(id="order-1", definition_id="order")
        store.commit(
            exe,
            [("order-1", Event(name="ping"))],
            timers=(TimerOp.schedule("t", time.time() - 5),),
            spawns=(("order-1.kid", "r", {}),),
        )
        store.claim_outbox("w1", limit=10)
        store.claim_spawns("w1", limit=10)
        store.claim_due_timers("w2", time.time(), limit=10)
    assert [r[:4] for r in rows(ok(cli("workers", "--url", db)))[1:]] == [
        ["w1", "1", "1", "0"],
        ["w2", "0", "0", "1"],
    ]
    assert ok(cli("release", "--worker", "w1", "--url", db)) == "released 2\n"
    assert [r[0] for r in rows(ok(cli("workers", "--url", db)))[1:]] == ["w2"]


# --- fleet


def test_the_help_names_the_commands_and_their_fleet() -> None:
    top = " ".join(ok(cli("--help")).split())
    assert "--fleet FILE runs migrate, status, schema --check, gc, ls, flow, workers or" in top
    assert "flow set order-1a2b3c4d" in TOP_HELP
    for action in ("ls", "set", "pause", "resume", "clear"):
        assert ok(cli("flow", action, "--help")).startswith(f"usage: harel-store flow {action}")


@pytest.mark.slow
def test_flow_workers_and_release_over_a_fleet(tmp_path: Path) -> None:
    databases = {name: seeded(tmp_path / f"{name}.db") for name in ("east", "west")}
    fleet = str(write_fleet(tmp_path / "fleet.txt", databases))

    result = cli("--fleet", fleet, "flow", "set", "A", "--concurrency", "1", "--rate", "5/1s")
    assert result.returncode == 0, result.stderr
    for name, database in databases.items():
        assert rows("\n".join(lines_of(result, name))) == [
            HEADER,
            ["A", "0", "1", "no", "5/1s", "2", "0"],
        ]
        assert flows_in(database) == [Flow("A", 0, 1, False, (5, 1.0), 2, 0)]
    assert result.stdout.splitlines()[-1] == "harel-store flow: 2 databases, 2 ok, 0 failed"

    listed = cli("flow", "ls", "--json", "--fleet", fleet)  # --fleet after the command too
    assert listed.returncode == 0, listed.stderr
    assert {d["database"]: [f["key"] for f in d["output"]] for d in docs(listed.stdout)} == {
        "east": ["A"],
        "west": ["A"],
    }

    # a bad value stops the run before any database: one line, nothing written
    bad = cli("--fleet", fleet, "flow", "set", "A", "--concurrency", "-2")
    assert failed(bad, 2).startswith("harel-store flow set: error: argument --concurrency")
    bad = cli("--fleet", fleet, "release", "--worker", "")
    assert "worker must be 1 to 512 characters" in failed(bad, 2)
    assert all(flows_in(d) == [Flow("A", 0, 1, False, (5, 1.0), 2, 0)] for d in databases.values())

    for database in databases.values():
        with LibsqlStore(database) as store:
            assert len(store.claim_outbox("w1", limit=10)) == 2  # B.1, and A's one
    held = cli("--fleet", fleet, "workers")
    assert held.returncode == 0, held.stderr
    for name in databases:
        assert [r[:4] for r in rows("\n".join(lines_of(held, name)))] == [
            ["WORKER", "OUTBOX", "SPAWNS", "TIMERS"],
            ["w1", "2", "0", "0"],
        ]
    released = cli("--fleet", fleet, "release", "--worker", "w1")
    assert released.returncode == 0, released.stderr
    assert all(lines_of(released, name) == ["released 2"] for name in databases)
    for database in databases.values():
        with LibsqlStore(database) as store:
            assert store.workers() == []

    ok(cli("--fleet", fleet, "flow", "pause", "B"))
    cleared = cli("--fleet", fleet, "flow", "clear", "A")
    assert all(lines_of(cleared, name) == ["cleared A"] for name in databases)
    assert all([f.key for f in flows_in(d)] == ["B"] for d in databases.values())
