"""``harel-store --fleet FILE COMMAND``: every database of a fleet file, several at once, one
failing without stopping the others, the worst exit status, no token shown (issue 39)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harel_store import HEAD, Execution, Fleet
from tests.test_cli import cli

SECRET = "fleet-secret-" + "k" * 24  # a token the server refuses


def lines_of(
    result: subprocess.CompletedProcess[str], name: str, stream: str = "stdout"
) -> list[str]:
    text = result.stdout if stream == "stdout" else result.stderr
    return [line[len(name) + 2 :] for line in text.splitlines() if line.startswith(f"{name}: ")]


def no_secret(result: subprocess.CompletedProcess[str], *secrets: str) -> None:
    for secret in (SECRET, *secrets):
        assert secret not in result.stdout and secret not in result.stderr


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    block = Path(f"/proc/{pid}/environ").read_bytes().decode("utf-8", "replace")
    return dict(entry.partition("=")[::2] for entry in block.split("\0") if entry)


def write_fleet(path: Path, entries: dict[str, str]) -> Path:
    body = ["# the fleet of this test", ""]
    body += [f"{name}   {database}" for name, database in entries.items()]
    path.write_text("\n".join(body) + "\n\n  # the end\n")
    return path


@pytest.mark.slow
def test_migrate_runs_on_every_database_past_a_broken_one(tmp_path: Path, sqld: Any) -> None:
    from tests.proxy import Proxy

    files = {name: str(tmp_path / f"{name}.db") for name in ("a", "b", "c")}
    with Proxy(sqld.port) as other:  # another origin: one server under two names is refused
        fleet = write_fleet(
            tmp_path / "fleet.txt",
            {
                **files,
                "broken": str(tmp_path / "no-such-dir" / "x.db"),
                "refused": f"{other.url()}?authToken={SECRET}",
                "server": sqld.url,  # its token from the environment, as for --url
            },
        )
        env = {"HAREL_AUTH_TOKEN": sqld.token}
        result = cli("--fleet", str(fleet), "--jobs", "3", "migrate", "--create", env=env)
    assert result.returncode == 1, result.stderr
    no_secret(result, sqld.token)
    for name, path in files.items():
        assert lines_of(result, name) == [f"{path}: schema at revision {HEAD} (head {HEAD})"]
        assert Path(path).exists()
    assert lines_of(result, "server") == [f"{sqld.url}: schema at revision {HEAD} (head {HEAD})"]
    assert "cannot be opened or created" in lines_of(result, "broken", "stderr")[-1]
    assert "refused" in result.stderr and "***" not in result.stdout
    summary = result.stdout.splitlines()[-1]
    assert summary == (
        "harel-store migrate: 6 databases, 4 ok, 2 failed:"
        " broken (exit status 1), refused (exit status 1)"
    )

    # run again once the broken one is mended: it picks up where it stopped
    (tmp_path / "no-such-dir").mkdir()
    write_fleet(fleet, {**files, "broken": str(tmp_path / "no-such-dir" / "x.db")})
    again = cli("--fleet", str(fleet), "migrate", "--create")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == "harel-store migrate: 4 databases, 4 ok, 0 failed"
    checked = cli("--fleet", str(fleet), "schema", "--check")
    assert checked.returncode == 0, checked.stderr
    assert len(checked.stdout.splitlines()) == 5  # a line per database, then the summary


@pytest.mark.slow
def test_status_check_gc_and_ls_over_a_fleet(tmp_path: Path) -> None:
    databases = {name: str(tmp_path / f"{name}.db") for name in ("east", "west")}
    with Fleet(databases) as fleet:
        for i in range(6):
            exe = Execution(id=f"order-{i}", definition_id="order", status="finished")
            fleet.store_for(exe.id).save(exe)
        placed = {
            name: [s.id for s in fleet.store(name).list_executions().items] for name in fleet.names
        }
    assert all(placed.values())
    fleet_file = write_fleet(tmp_path / "fleet.txt", databases)

    status = cli("--fleet", str(fleet_file), "status", "--check")
    assert status.returncode == 0, status.stderr
    for name in databases:
        assert f"{len(placed[name])} total" in "\n".join(lines_of(status, name))

    listed = cli("--fleet", str(fleet_file), "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    docs = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(d["database"] for d in docs) == ["east", "west"]
    for doc in docs:
        assert doc["exit_status"] == 0
        assert [item["id"] for item in doc["output"]] == placed[doc["database"]]
    assert "2 databases, 2 ok, 0 failed" in listed.stderr  # the summary, off the JSON

    gc = cli("--fleet", str(fleet_file), "gc", "--finished-older-than", "1d", "--dry-run")
    assert gc.returncode == 0, gc.stderr
    for name in databases:
        assert lines_of(gc, name) == ["would remove 0 executions"]

    # one database behind head: its check fails, the other's still runs; the worst status
    cli("migrate", "--to", "0001", "--url", databases["west"])
    behind = cli("--fleet", str(fleet_file), "status", "--check")
    assert behind.returncode == 1
    assert lines_of(behind, "east")  # printed its status
    assert f"schema: at revision 0001, behind head {HEAD}" in behind.stderr
    assert behind.stdout.splitlines()[-1].endswith("1 failed: west (exit status 1)")


@pytest.mark.slow
def test_bad_fleet_files_and_usage(tmp_path: Path) -> None:
    good = write_fleet(tmp_path / "good.txt", {"a": str(tmp_path / "a.db")})
    cases = [
        (
            "three.txt",
            f"a {tmp_path / 'a.db'} http://h:1?authToken={SECRET}\n",
            "line 1: expected NAME DATABASE",
        ),
        ("twice.txt", "a x.db\n# c\na y.db\n", "line 3: the name 'a' is given twice"),
        ("memory.txt", "a :memory:\n", ":memory:"),
        ("scheme.txt", f"a ftp://h/x?authToken={SECRET}\n", "unknown scheme"),
        ("empty.txt", "# nothing\n\n", "at least one database"),
    ]
    for file_name, body, message in cases:
        path = tmp_path / file_name
        path.write_text(body)
        result = cli("--fleet", str(path), "status")
        assert result.returncode == 2, (file_name, result.stderr)
        assert message in result.stderr, (file_name, result.stderr)
        no_secret(result)
    for args, message in [
        (["--fleet", str(good), "show", "x"], "--fleet runs migrate, status, schema, gc, ls"),
        (["--fleet", str(good), "schema"], "schema takes --check"),
        (["--fleet", str(good), "migrate", "--sql"], "no --sql"),
        (["--fleet", str(good), "status", "--url", "x.db"], "no --url"),
        (["--jobs", "2", "status"], "--jobs is for --fleet"),
        (["--fleet", str(good), "--jobs", "0", "status"], "at least 1"),
    ]:
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    missing = cli("--fleet", str(tmp_path / "nope.txt"), "status")
    assert missing.returncode == 1 and "cannot read the fleet file" in missing.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["good.txt", *(c[0] for c in cases)]
    )  # no database was made


@pytest.mark.slow
def test_a_database_whose_run_is_killed_stops_no_other(tmp_path: Path, sqld: Any) -> None:
    """migrate --timeout stops that database's run at the deadline (exit status 1, one
    line), and the databases after it still run."""
    from tests.proxy import Proxy

    with Proxy(sqld.port) as slow:
        slow.delay = 1.0  # each request: Alembic's several take longer than --timeout 1
        fleet = write_fleet(
            tmp_path / "fleet.txt",
            {"a": str(tmp_path / "a.db"), "b-slow": slow.url(), "c": str(tmp_path / "c.db")},
        )
        result = cli(
            "--fleet", str(fleet), "--jobs", "1", "migrate", "--create", "--timeout", "1",
            env={"HAREL_AUTH_TOKEN": sqld.token},
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "did not answer within 1 s" in "\n".join(lines_of(result, "b-slow", "stderr"))
    for name in ("a", "c"):
        assert lines_of(result, name) == [
            f"{tmp_path / name}.db: schema at revision {HEAD} (head {HEAD})"
        ]
    assert result.stdout.splitlines()[-1] == (
        "harel-store migrate: 3 databases, 2 ok, 1 failed: b-slow (exit status 1)"
    )
    no_secret(result, sqld.token)


# -- issue 48: one database twice, a missing file, comments, order, one usage error --------


def test_a_fleet_file_naming_one_database_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for body in [
        f"east {tmp_path / 'real' / 'x.db'}\nwest {tmp_path / 'link' / 'x.db'}\n",
        f"east x.db\nwest {tmp_path / 'x.db'}\n",  # relative (from the cwd) and absolute
        f"east http://db.example:8080?authToken={SECRET}\nwest http://DB.example:8080/\n",
    ]:
        fleet = tmp_path / "fleet.txt"
        fleet.write_text(body)
        result = cli("--fleet", str(fleet), "migrate", "--create", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert "one database under two names" in result.stderr
        assert "'east'" in result.stderr and "'west'" in result.stderr
        no_secret(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.txt", "link", "real"]
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.slow
def test_a_fleet_command_creates_no_missing_database_unless_asked(tmp_path: Path) -> None:
    there = str(tmp_path / "there.db")
    assert cli("migrate", "--url", there).returncode == 0
    typo = tmp_path / "thre.db"
    fleet = write_fleet(tmp_path / "fleet.txt", {"a": there, "b": str(typo)})
    for args in (
        ["migrate"],
        ["status"],
        ["ls"],
        ["schema", "--check"],
        ["gc", "--finished-older-than", "1d"],
    ):
        result = cli("--fleet", str(fleet), *args)
        assert result.returncode == 1, (args, result.stderr)
        said = "\n".join(lines_of(result, "b", "stderr"))
        assert f"{typo} does not exist" in said and "migrate --create" in said, args
        # the other still ran
        assert result.stdout.splitlines()[-1].endswith("1 ok, 1 failed: b (exit status 1)")
        assert not typo.exists(), args

    created = cli("--fleet", str(fleet), "migrate", "--create")
    assert created.returncode == 0, created.stderr
    assert lines_of(created, "b") == [f"{typo}: schema at revision {HEAD} (head {HEAD})"]
    assert typo.exists()


@pytest.mark.slow
def test_a_comment_may_end_a_line_and_a_hash_inside_a_path_is_kept(tmp_path: Path) -> None:
    (tmp_path / "no#1").mkdir()
    databases = {"a": str(tmp_path / "a.db"), "b": str(tmp_path / "no#1" / "b#2.db")}
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(
        "# name  database\n"
        f"a  {databases['a']}  # the first\n"
        f"b\t{databases['b']}\t# a '#' inside a path is the path's\n"
        "   # indented comment\n"
    )
    result = cli("--fleet", str(fleet), "migrate", "--create")
    assert result.returncode == 0, result.stderr
    for name, path in databases.items():
        assert lines_of(result, name) == [f"{path}: schema at revision {HEAD} (head {HEAD})"]
        assert Path(path).exists()


@pytest.mark.slow
def test_sections_print_by_name_whatever_order_they_finish_in(tmp_path: Path, sqld: Any) -> None:
    from tests.proxy import Proxy

    fast = str(tmp_path / "fast.db")
    assert cli("migrate", "--url", fast).returncode == 0
    with Proxy(sqld.port) as slow:
        slow.delay = 0.5  # "a-slow" finishes well after "b-fast", "c-fast"
        fleet = write_fleet(tmp_path / "fleet.txt", {"a-slow": slow.url(), "b-fast": fast})
        result = cli(
            "--fleet", str(fleet), "--jobs", "2", "status", env={"HAREL_AUTH_TOKEN": sqld.token}
        )
    assert result.returncode == 0, result.stderr
    names = [line.split(": ", 1)[0] for line in result.stdout.splitlines()[:-1]]
    assert names and names == sorted(names), result.stdout
    assert set(names) == {"a-slow", "b-fast"}


@pytest.mark.slow
def test_gc_without_an_age_prints_its_usage_error_once(tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path / "fleet.txt", {n: str(tmp_path / f"{n}.db") for n in "abcdef"})
    assert cli("--fleet", str(fleet), "migrate", "--create").returncode == 0
    result = cli("--fleet", str(fleet), "--jobs", "3", "gc")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "harel-store: error: nothing to collect: give --finished-older-than,"
        " --markers-older-than or --dead-older-than"
    ]
    assert result.stdout == ""


def test_what_a_child_of_the_command_prints_is_its_output() -> None:
    """A command that runs a child process (migrate against a server does, to bound it):
    what the child writes to its stdout is the database's output, not its stderr."""
    import sys

    code = (
        "import subprocess, sys\n"
        "from harel_store.cli.fleet import serve\n"
        "def main(argv):\n"
        "    print('from the command')\n"
        "    sys.stdout.flush()\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n"
        "    print('oops', file=sys.stderr)\n"
        "    return 0\n"
        "serve(main)\n"
    )
    job = json.dumps({"database": "x.db", "argv": ["status"]}) + "\n"
    run = subprocess.run(
        [sys.executable, "-c", code], input=job * 2, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert (
        answers == [{"status": 0, "out": "from the command\nfrom a child\n", "err": "oops\n"}] * 2
    )


@pytest.mark.sqld
@pytest.mark.slow
def test_sigterm_to_a_fleet_migrate_leaves_no_worker_or_migration_running(
    tmp_path: Path,
) -> None:
    """SIGTERM to ``harel-store --fleet FILE migrate`` (as systemd or kubectl stop it) while
    a database's migration waits on a server that does not answer: its workers and their
    migration children end with it, not at --timeout (against a slow server they would
    commit after the operator stopped the command)."""
    import os
    import signal
    import sys
    import time
    import uuid

    from tests.sqld import SqldServer
    from tests.test_migrate_timeout import descendant, kill_tagged, tagged

    server = SqldServer(auth=True).start()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    tag = uuid.uuid4().hex
    try:
        fleet = write_fleet(tmp_path / "fleet.txt", {"b": server.url})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
        env.update(HAREL_AUTH_TOKEN=server.token, HAREL_TEST_TAG=tag)
        # Come from outside (an environment that kept it): the worker bounds its migration
        # all the same.
        env.update(HAREL_MIGRATE_PARENT="4242", HAREL_DIE_WITH="4242")
        command = [str(Path(sys.executable).with_name("harel-store")), "--fleet", str(fleet)]
        proc = subprocess.Popen(
            [*command, "migrate", "--timeout", "60"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            child = descendant(proc.pid, 2)  # a worker's migration child
            time.sleep(1.0)  # it waits on the server now
            assert len(tagged(tag)) == 3  # the command, its worker, the migration
            # Each dies with its parent from its first lines (`python_child`), whatever
            # the command's environment said: not once its imports are done.
            worker = descendant(proc.pid, 1)
            assert environ(worker)["HAREL_DIE_WITH"] == str(proc.pid)
            assert "HAREL_MIGRATE_PARENT" not in environ(worker)
            assert environ(child)["HAREL_DIE_WITH"] == str(worker)
            assert environ(child)["HAREL_MIGRATE_PARENT"] == str(worker)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            end = time.monotonic() + 2.0
            while tagged(tag) and time.monotonic() < end:
                time.sleep(0.05)
            assert tagged(tag) == [], "a worker or its migration outlived the command"
        finally:
            proc.kill()
            proc.wait()
            kill_tagged(tag)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.close()


@pytest.mark.slow
@pytest.mark.sqld
def test_a_migrate_parent_come_from_outside(tmp_path: Path, sqld: Any) -> None:
    """$HAREL_MIGRATE_PARENT (a run's child's marker) and $HAREL_DIE_WITH left in the
    environment of a command: a fleet's workers run their jobs as without them (the command
    passes neither on: each worker bounds its own migrations, a server's too); one
    migration against a server is refused in one line that names the variable (before,
    it ended at once with exit status 1 and nothing said, or went on). A value that is
    digits only to `str.isdigit` (``²``) names no process either; an empty one is none."""
    from tests.helpers import ALEMBIC

    fleet = write_fleet(tmp_path / "fleet.txt", {"a": str(tmp_path / "a.db"), "b": sqld.url})
    for value in ("0", "\u00b2"):
        leaked = {"HAREL_MIGRATE_PARENT": value, "HAREL_DIE_WITH": value}
        with_token = {**leaked, "HAREL_AUTH_TOKEN": sqld.token}
        result = cli("--fleet", str(fleet), "migrate", "--create", env=with_token)
        assert result.returncode == 0, result.stderr
        assert "2 ok, 0 failed" in result.stdout.splitlines()[-1]
        on_server = cli("migrate", "--url", sqld.url, env=with_token)
        assert on_server.returncode == 1, on_server.stderr
        (line,) = on_server.stderr.splitlines()
        assert line.startswith("harel-store: error: $HAREL_MIGRATE_PARENT (")
        assert line.endswith("(unset it)")
    empty = cli(
        "migrate",
        "--url",
        sqld.url,
        env={"HAREL_MIGRATE_PARENT": "", "HAREL_AUTH_TOKEN": sqld.token},
    )
    assert empty.returncode == 0, empty.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAREL_")}
    env.update(HAREL_MIGRATE_PARENT="0", HAREL_AUTH_TOKEN=sqld.token)
    alembic = subprocess.run(
        [*ALEMBIC, "-x", f"url={sqld.url}", "upgrade", "head"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert alembic.returncode == 255, alembic.stderr
    assert "FAILED: $HAREL_MIGRATE_PARENT ('0') does not name" in alembic.stdout
