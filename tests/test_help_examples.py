"""Every example of every command's --help, and every `harel-store` line of the operator
guide (docs/how-to/operate.md), runs as written against a database that holds what they
name: one shell line each, on its own copy, with `jq` at the end of a pipe (a small
stand-in that reads JSON documents and picks a path, so a pipe of anything but JSON fails).
Where the guide shows a command's output (`$ harel-store status`), the output has the rows
it shows. migrate's --help examples also run in order in tests/test_migrate_sql.py."""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore, TimerOp
from harel_store.cli import COMMANDS
from harel_store.cli.output import PROG
from tests.helpers import shell_env

# The examples that are meant to fail on a store holding dead letters: a health check.
FAILS_ON_PURPOSE = {f"{PROG} status --max-dead 0"}

JQ = '''#!PYTHON
"""jq's path filter (`.a.b`, `-r`) over a stream of JSON documents; anything else fails."""
import json, sys

args = sys.argv[1:]
raw = "-r" in args
(path,) = [a for a in args if a != "-r"]
text, decoder, at = sys.stdin.read(), json.JSONDecoder(), 0
while text[at:].strip():
    at += len(text[at:]) - len(text[at:].lstrip())
    doc, at = decoder.raw_decode(text, at)
    for key in filter(None, path.split(".")):
        doc = doc[key]
    print(doc if raw and isinstance(doc, str) else json.dumps(doc))
'''


def examples() -> list[str]:
    found = []
    for command in COMMANDS:
        if command.name == "migrate":
            continue
        text = command.epilog or ""
        lines = text[text.index("examples:") :].splitlines()[1:] if "examples:" in text else []
        found += [line.split("#")[0].strip() for line in lines if line.startswith(f"  {PROG} ")]
    return found


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "operate.md"


def guide() -> tuple[list[str], dict[str, list[str]]]:
    """The guide's command lines, and for a `$ ` line the first word of each output row."""
    lines, shown = [], {}
    for block in re.findall(r"```sh\n(.*?)```", GUIDE.read_text(), re.S):
        rows = block.splitlines()
        for number, row in enumerate(rows):
            if row.startswith(f"$ {PROG} "):
                lines.append(row[2:])
                shown[row[2:]] = [r.split()[0] for r in rows[number + 1 :] if r.strip()]
            elif row.startswith(f"{PROG} "):
                lines.append(row.split("#")[0].strip())
    return lines, shown


GUIDE_LINES, SHOWN = guide()
EXAMPLES = examples()


def seed(path: Path) -> None:
    """What the examples name: order-1a2b3c4d (a finished tree, with a trace, outbox entries
    it emitted and for it, spawns it made), invoice-9f8e7d6c (a leaf with a due timer),
    stuck-42 at version 7 (last updated on 2026-12-01 at 10:30 UTC), the outbox entry 42, the
    spawn 7 and the timer main.remind of order-1a2b as dead letters; relay-1 holds three
    outbox entries for an hour."""
    now = time.time()
    with LibsqlStore(path) as s:
        order = Execution(id="order-1a2b3c4d", definition_id="order", status="finished")
        s.save(order)
        s.commit(
            order,
            [("order-1a2b3c4d", Event(name=f"e{n}")) for n in range(45)],
            timers=(TimerOp.schedule("main.remind", now + 3600),),
            spawns=tuple((f"order-1a2b3c4d.k{n}", "r", {}) for n in range(8)),
            trace={"event": "pay", "transition": "placed -> paid"},
        )
        kid = Execution(id="order-1a2b3c4d.k0", definition_id="k", parent_id="order-1a2b3c4d")
        kid.status = "finished"
        s.save(kid)
        invoice = Execution(id="invoice-9f8e7d6c", definition_id="invoice", status="failed")
        s.save(invoice)
        s.commit(invoice, [], timers=(TimerOp.schedule("main.retry", now - 5),))
        stuck = Execution(id="stuck-42", definition_id="order")
        for _ in range(7):
            s.save(stuck)
        other = Execution(id="order-1a2b", definition_id="order")
        s.save(other)
        s.commit(other, [], timers=(TimerOp.schedule("main.remind", now - 5),))
        s.claim_outbox("relay-1", limit=3, lease=3600)  # what `workers` shows, `release` frees
    with closing(sqlite3.connect(path)) as conn, conn:  # the store is closed
        dead = "dead_at = 1.0, attempts = 5, last_error = 'boom'"
        conn.execute(f"UPDATE harel_outbox SET seq = -seq, {dead} WHERE seq = 42")
        conn.execute(f"UPDATE harel_spawns SET seq = -seq, {dead} WHERE seq = 7")
        conn.execute(f"UPDATE harel_timers SET {dead} WHERE execution_id = 'order-1a2b'")
        at = datetime(2026, 12, 1, 10, 30, tzinfo=timezone.utc).timestamp()  # ls --since
        conn.execute("UPDATE harel_executions SET updated_at = ? WHERE id = 'stuck-42'", (at,))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seed") / "seed.db"
    seed(path)
    return path


def test_every_command_with_examples_is_covered() -> None:
    named = {example.split()[1] for example in EXAMPLES}
    assert named == {c.name for c in COMMANDS if c.epilog and "examples:" in c.epilog} - {"migrate"}
    assert any("| jq" in example for example in EXAMPLES)


def test_the_guide_has_commands_and_shows_an_output() -> None:
    assert len(GUIDE_LINES) > 20 and SHOWN


@pytest.mark.parametrize("example", EXAMPLES + [g for g in GUIDE_LINES if g not in EXAMPLES])
def test_the_example_runs_as_written(example: str, seeded: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    jq = bin_dir / "jq"
    jq.write_text(JQ.replace("PYTHON", sys.executable), encoding="utf-8")
    jq.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    database = work / "state.db"
    shutil.copy(seeded, database)
    with closing(sqlite3.connect(database)) as conn, conn:  # due, and for a second only
        conn.execute(
            "UPDATE harel_timers SET fire_at = ? WHERE path = 'main.retry'", (time.time() - 1,)
        )
    env = shell_env(bin_dir, HAREL_DATABASE_URL=str(database))
    if example.startswith(f"{PROG} ui"):
        serve(example, work, env)
        return
    run = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {example}"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=120,
    )
    assert "Traceback" not in run.stderr, run.stderr
    if example in FAILS_ON_PURPOSE:
        assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
        return
    assert run.returncode == 0, (run.stdout, run.stderr)
    if ">" not in example and not example.startswith(f"{PROG} migrate"):
        assert run.stdout.strip(), "an example that prints nothing shows nothing"
    if example in SHOWN:
        assert [row.split()[0] for row in run.stdout.splitlines()] == SHOWN[example]
    if "--json" in example and "|" not in example:
        for line in run.stdout.splitlines():
            json.loads(line)


def serve(example: str, work: Path, env: dict[str, str]) -> None:
    """A console example: it serves (on a free port: its own may be taken by another test)
    until SIGTERM, which it exits on with 0 and no traceback; its page answers meanwhile."""
    (work / "fleet.txt").write_text("main state.db\n")
    command = re.sub(r"--listen \S+", "", example) + " --listen 127.0.0.1:0"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=work, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "it never said where it serves"
        line = proc.stdout.readline().decode()
        assert re.fullmatch(r"serving http://127\.0\.0\.1:\d+/\n", line), line
        with urllib.request.urlopen(line.split()[1], timeout=30) as page:
            assert page.status == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and b"Traceback" not in err, err
