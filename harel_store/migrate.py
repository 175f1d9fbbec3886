"""Alembic glue: the revisions run the same ``.sql`` files the store applies itself."""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harel_store.batch import Batch, Fresh, Request, drive, shape
from harel_store.checks import check_timeout
from harel_store.connection.local import why_not
from harel_store.connection.revision import KNOWN, ensure_schema, revision
from harel_store.connection.url import (
    DEFAULT_DATABASE,
    alembic_url,
    database_from_env,
    migration_hint,
    parse_database,
    token_from_env,
)
from harel_store.errors import translate
from harel_store.sql import _MIGRATION_FILE, SQL_DIR, resource, split_statements

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.operations.ops import MigrationScript
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import Connection

__all__ = [
    "DEFAULT_DATABASE",
    "DIE_WITH",
    "MIGRATIONS_DIR",
    "PARENT",
    "alembic_config",
    "alembic_in_child",
    "bounded_elsewhere",
    "command_in_child",
    "database_from_env",
    "deadline",
    "driver_failure",
    "killed",
    "migration_hint",
    "migration_timeout",
    "number_revision",
    "parse_database",
    "python_child",
    "refuse_unknown_revision",
    "run_bounded",
    "run_sql",
    "sql_revision",
    "sqlalchemy_execute",
    "sqlalchemy_url",
    "timed_out",
    "token_from_env",
]

MIGRATIONS_DIR = resource("migrations")


def run_sql(filename: str) -> None:
    """Run ``sql/migrations/<filename>`` statement by statement inside Alembic's transaction.

    Statements are literal (no bound parameters), so ``alembic upgrade head --sql`` prints a
    script fit for review.
    """
    from alembic import op
    from sqlalchemy import text

    script = (SQL_DIR / "migrations" / filename).read_text(encoding="utf-8")
    for statement in split_statements(script):
        op.execute(text(re.sub(r"(?<!\\):", r"\\:", statement)))  # a ':' is never a bind


def sql_revision(name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A revision's ``upgrade`` and ``downgrade``: `run_sql` of ``sql/migrations/<name>.up.sql``
    and ``<name>.down.sql``. A revision script is its title, its numbers and this:

        revision, down_revision = "0009", "0008"
        upgrade, downgrade = sql_revision("0009_final_children")
    """

    def upgrade() -> None:
        run_sql(f"{name}.up.sql")

    def downgrade() -> None:
        run_sql(f"{name}.down.sql")

    upgrade.__doc__ = f"Run sql/migrations/{name}.up.sql."
    downgrade.__doc__ = f"Run sql/migrations/{name}.down.sql."
    return upgrade, downgrade


def alembic_config(database: str) -> Config:
    """An Alembic configuration over the packaged migrations (a checkout's or a wheel's),
    for ``database`` (any form `harel_store.connection.url` reads; the token is its
    ``authToken=``, else $HAREL_AUTH_TOKEN, else $TURSO_AUTH_TOKEN)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["url"] = database
    return config


sqlalchemy_url = alembic_url  # its older name


# ----------------------------------------------------------------- failures, in the store's words


def driver_failure(exc: BaseException, where: str, *, local: bool, secrets: tuple[str, ...]) -> str:
    """A driver's error under Alembic as the store says it (`translate`: a refused token, a
    busy database), and a local file that cannot be opened as the CLI says it (``cannot open
    WHERE: why``); never a secret."""
    text = str(translate(exc, secrets, quoted=where if local else ""))
    why = why_not(text, where) if local else text
    return text if why == text else f"cannot open {where}: {why}"


def sqlalchemy_execute(connection: Connection) -> Callable[[Request], Any]:
    """A plan's statements (`harel_store.batch`) run on an SQLAlchemy connection, Alembic's:
    a plan reads the database through the connection and transaction the migration uses."""

    def execute(request: Request) -> Any:
        if isinstance(request, Batch):
            raise TypeError("only a plan's single statements run on Alembic's connection")
        query, params = request.statement if isinstance(request, Fresh) else request
        result = connection.exec_driver_sql(query.sql, tuple(params))
        rows = [tuple(row) for row in result.fetchall()] if result.returns_rows else []
        return shape(query, rows, result.rowcount)

    return execute


def refuse_unknown_revision(execute: Callable[[Request], Any], where: str) -> None:
    """Raise the store's SchemaError (``WHERE is at schema revision '9999', which this
    version of harel-store does not know ...``) when the database is at a revision this
    version does not know; return when it is at a known one, or at none."""
    current = drive(execute, revision())
    if current is not None and current not in KNOWN:
        drive(execute, ensure_schema(where, migrate=False))  # raises it, in its words


# ---------------------------------------------------------------- a bound the GIL cannot stop
#
# The libsql driver Alembic runs on has no timeout and holds the GIL while it waits, so
# neither a thread nor a signal handler of the process it runs in can stop a run stuck on a
# server: another process must. The run goes to a child process (a fresh Python: libsql's
# runtime does not survive a fork) and the process that waits for it stays free: at the
# deadline it kills the child and fails as any other failure does (`harel-store migrate`:
# exit status 1; Alembic: FAILED:, 255), never by a kill of its own (137, an OOM kill's).

TIMEOUT = 30.0  # how long a run against a server may take, as a whole, unless told
# In a run's child process: the pid of the process that bounds it (`bounded_elsewhere`).
PARENT = "HAREL_MIGRATE_PARENT"
# In a child process of ours (`python_child`): the pid of the process it dies with, from its
# program's first lines. The child takes it out of its environment: none of its own
# children inherits it.
DIE_WITH = "HAREL_DIE_WITH"

# The first lines of every child's program. The current directory goes off its sys.path,
# where ``python -c`` puts it first (as ''), so that a folder holding a ``harel_store`` or an
# ``alembic`` of its own is never what the child imports. Not ``-I``, which would also drop
# the user site, where ``pip install --user`` puts the package; not ``-P``, new in 3.11.
# Then the child dies with the process named by $HAREL_DIE_WITH (SIGKILL when it ends, Linux;
# exit 1 now if it is gone already) before it imports anything else: importing takes seconds
# on a loaded machine, and a child still importing when its parent ended would otherwise
# outlive it for as long.
_PRELUDE = f"""import os, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
_parent = os.environ.pop("{DIE_WITH}", "")
if _parent.isascii() and _parent.isdigit():
    if sys.platform == "linux":
        import ctypes, signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
    if str(os.getppid()) != _parent:
        os._exit(1)
del _parent
"""


def python_child(code: str, *args: str) -> list[str]:
    """The command line of a child process of ours: this Python running ``code`` (with
    ``args`` as its sys.argv[1:]), importing nothing from the current directory. Started
    with ``HAREL_DIE_WITH=PID`` in its environment, it dies with that process (SIGKILL,
    Linux) from its first lines, or exits 1 at once if that process is gone already."""
    return [sys.executable, "-c", _PRELUDE + code, *args]


# Alembic's command line, run again in the child: the same command, options and files.
_ALEMBIC = """
import pickle, sys
from alembic.config import CommandLine, Config
files, options = pickle.loads(sys.stdin.buffer.read())
CommandLine(prog="alembic").run_cmd(Config(cmd_opts=options, **files), options)
"""


# A program's own call of Alembic's `command`, run again in the child: its one line, if it
# fails, on stdout (a failure of another kind shows its traceback on stderr).
_COMMAND = """
import pickle, sys
from alembic import command
from alembic.config import Config
from alembic.util import CommandError
files, options, attributes, name, revision, tag = pickle.loads(sys.stdin.buffer.read())
config = Config(**files)
for key, value in options:
    config.set_section_option(files["ini_section"], key, value)
config.attributes.update(attributes)
try:
    getattr(command, name)(config, revision, tag=tag)
except CommandError as exc:
    sys.stdout.write(str(exc))
    sys.exit(1)
"""


def migration_timeout(given: object = None) -> float:
    """Seconds a run against a server may take: ``given`` (seconds, or their text), else
    $HAREL_TIMEOUT, else 30. ValueError for anything but a number of seconds > 0."""
    value = given or os.environ.get("HAREL_TIMEOUT") or TIMEOUT
    try:
        return check_timeout(float(value), "timeout")  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ValueError(f"timeout must be a number of seconds > 0, not {value!r:.40}") from None


def timed_out(where: str, seconds: float) -> str:
    """The one line of a run stopped at its deadline (``where``: the database, no secret)."""
    return (
        f"{where} did not answer within {seconds:g} s: the migration was stopped, nothing of"
        " it committed (a longer bound: HAREL_TIMEOUT=SECONDS)"
    )


def killed(where: str, status: int) -> str:
    """The one line of a run whose process was killed by a signal (``status``: its negative
    exit status, as `subprocess` gives it), by no one of ours (an OOM kill): it may have
    committed or not (``where``: the database, no secret)."""
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return (
        f"{where}: the process of the migration was killed by {name}; where it got to is"
        " unknown: `harel-store status` shows the revision"
    )


def run_bounded(
    argv: list[str],
    seconds: float,
    *,
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
    capture: bool = False,
) -> tuple[int, bytes] | None:
    """Run ``argv`` (a run's child process, sharing this one's stderr, and its stdout unless
    ``capture``; ``stdin`` its input) and wait for it at most ``seconds``: its exit status
    and what it printed if captured, or None when the deadline came first; a negative status
    when a signal killed it (`killed` says so). A child not over by then, or when the wait
    is interrupted, is killed and reaped: none is left running."""
    child = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE if capture else None,
        env={
            **(os.environ if env is None else env),
            PARENT: str(os.getpid()),
            DIE_WITH: str(os.getpid()),
        },
    )
    try:
        out, _ = child.communicate(stdin, timeout=seconds)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if child.returncode is None:
            child.kill()
            child.communicate()
    return child.returncode, out or b""


def alembic_in_child(config: Config, seconds: float) -> int | None:
    """Alembic's command line (``config.cmd_opts``) run again in a child process, bounded by
    ``seconds`` (`run_bounded`): its exit status (it says why it failed, unless a signal
    killed it: a negative status, see `killed`), or None at the deadline. The options go
    through a pipe: a token in ``-x url=`` is never on a command line that this process did
    not already have."""
    files = {"file_": config.config_file_name, "ini_section": config.config_ini_section}
    toml = getattr(config, "toml_file_name", None)
    if toml is not None:
        files["toml_file"] = toml
    payload = pickle.dumps((files, config.cmd_opts))
    done = run_bounded(python_child(_ALEMBIC), seconds, stdin=payload)
    return None if done is None else done[0]


def command_in_child(
    config: Config, command: tuple[str, str, str | None], seconds: float, where: str
) -> str | None:
    """A program's own ``alembic.command.upgrade`` or ``downgrade`` (``command``: its name,
    revision and tag) run again in a child process on the same configuration (its file,
    its main options, its attributes that are plain values), bounded by ``seconds``
    (`run_bounded`). None when it succeeded, else the one line of its failure: its
    CommandError's, at the deadline `timed_out`, or `killed` when a signal killed its
    process (``where``: the database, no secret)."""
    section = config.config_ini_section
    files = {"file_": config.config_file_name, "ini_section": section}
    toml = getattr(config, "toml_file_name", None)
    if toml is not None:
        files["toml_file"] = toml
    options = (
        config.file_config.items(section, raw=True)
        if config.file_config.has_section(section)
        else []
    )
    plain = (str, int, float, bool, type(None))
    attributes = {k: v for k, v in config.attributes.items() if isinstance(v, plain)}
    payload = pickle.dumps((files, options, attributes, *command))
    done = run_bounded(python_child(_COMMAND), seconds, stdin=payload, capture=True)
    if done is None:
        return timed_out(where, seconds)
    status, out = done
    if status == 0:
        return None
    if status < 0:
        return killed(where, status)
    return out.decode("utf-8", "replace").strip() or f"the migration failed (exit status {status})"


def bounded_elsewhere() -> bool:
    """Whether this process is a run's child, bounded by its parent (`run_bounded`); it then
    dies with that parent (Linux), so that no run goes on unbounded once it is gone. Read
    once: $HAREL_MIGRATE_PARENT then goes out of the environment, so that no process this
    one starts inherits it. A ValueError (that once; the variable is gone after it) when the
    variable does not name this process's parent: the parent is gone already, or the
    variable was left in an environment it does not belong to; either way no run goes on."""
    global _bounded
    if _bounded is None:
        parent = os.environ.pop(PARENT, "")
        _bounded = False
        if parent:
            # Linked first, then checked: a parent that ends in between is seen gone.
            _on_parent_death(int(signal.SIGKILL))
            _bounded = parent == str(os.getppid())
            if not _bounded:
                _on_parent_death(0)  # linked to nothing again
                shown = repr(parent[:20]) + ("..." if len(parent) > 20 else "")
                raise ValueError(
                    f"${PARENT} ({shown}) does not name the parent of this process: it is"
                    " harel-store's own, set for the process of a migration whose command"
                    " ended since, or left in this environment (unset it)"
                )
    return _bounded


_bounded: bool | None = None  # what bounded_elsewhere() read


def _on_parent_death(signal_number: int) -> None:
    """The signal this process gets when its parent ends (0: none); Linux only."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal_number)  # PR_SET_PDEATHSIG


# The watchdog: a second Python, waiting for its stdin to close (the work is over, or this
# process died) at most SECONDS; then it says MESSAGE on stderr and kills this process.
_WATCHDOG = """
import os, select, signal, sys
parent, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    os.write(2, message.encode() + b"\\n")
    os.kill(parent, signal.SIGKILL)
"""


@contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """End this process (SIGKILL, after ``message`` on stderr) if the block is not over
    within ``seconds``: the bound of a command a program started with Alembic's ``command``
    functions that cannot be run again in a child (not an upgrade or a downgrade).
    ``message`` shows on the watchdog's command line: never put a secret in it."""
    watchdog = subprocess.Popen(
        [sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid()), repr(seconds), message],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # its select wakes, and it ends
        watchdog.wait()


# ------------------------------------------------------------------------ alembic revision

FILE_TEMPLATE = "%(rev)s_%(slug)s"  # alembic.ini's file_template (and Alembic's default)
_NUMBER = re.compile(r"\d{4}")


def _slug(message: str, limit: int) -> str:
    """The name Alembic gives a revision's file from its message (``add a thing``:
    ``add_a_thing``), cut as Alembic cuts it."""
    slug = "_".join(re.findall(r"\w+", message)).lower()
    if len(slug) > limit:
        slug = slug[:limit].rsplit("_", 1)[0] + "_"
    return slug


def number_revision(
    context: MigrationContext, _revision: object, directives: list[MigrationScript]
) -> None:
    """Alembic's ``process_revision_directives`` for ``alembic revision -m "what it does"``:
    the new revision is the next four-digit number after the head (``0008`` after ``0007``),
    its file ``versions/0008_what_it_does.py``, and the two SQL files it runs are made, holding
    only a comment, as ``sql/migrations/0008_what_it_does.up.sql`` and ``.down.sql`` beside
    the scripts' folder. Anything that would break the numbered chain is a CommandError, and
    then nothing is written."""
    from alembic.util import CommandError

    scripts = context.script
    if scripts is None or not directives:
        raise CommandError("alembic revision: no script directory to number the revision in")
    new = directives[0]
    if scripts.file_template != FILE_TEMPLATE:
        raise CommandError(
            f"file_template must be {FILE_TEMPLATE.replace('%', '%%')} in alembic.ini, not "
            f"{scripts.file_template.replace('%', '%%')}: a revision's file is NNNN_name.py"
        )
    heads = scripts.get_heads()
    if len(heads) > 1:
        raise CommandError(
            f"the revisions have {len(heads)} heads ({', '.join(sorted(heads))}): the chain"
            " must be one line, each revision after the one before it"
        )
    if new.head not in (None, "head", *heads):
        raise CommandError(f"a new revision follows the head ({', '.join(heads)}), not {new.head}")
    revisions = [script.revision for script in scripts.walk_revisions()]
    odd = [rev for rev in revisions if not _NUMBER.fullmatch(rev)]
    if odd:
        raise CommandError(f"revision {odd[0]!r} is not numbered NNNN like the others")
    number = max(map(int, revisions), default=0) + 1
    rev = f"{number:04d}"
    if number > 9999:
        raise CommandError("the revisions are numbered 0001 to 9999: there is no next one")
    if new.rev_id is not None and _NUMBER.fullmatch(new.rev_id) and new.rev_id != rev:
        raise CommandError(
            f"the next revision is {rev}, not {new.rev_id}: they are numbered in order"
        )
    message = new.message or ""
    slug = _slug(message, scripts.truncate_slug_length)
    name = f"{rev}_{slug}"
    if not slug:
        raise CommandError(
            "a revision is named from its message: alembic revision -m 'what it does'"
        )
    if _MIGRATION_FILE.match(f"{name}.up.sql") is None:
        raise CommandError(
            f"a revision is named from its message in ASCII letters, digits and _ "
            f"({message!r} makes {slug!r}): alembic revision -m 'what it does'"
        )
    template_args = context.opts.get("template_args")
    if template_args is None:
        raise CommandError("alembic revision: Alembic gave env.py no template arguments")
    folder = Path(scripts.dir).parent / "sql" / "migrations"
    if not folder.is_dir():
        raise CommandError(f"no folder {folder} for the revision's SQL files")
    files = [folder / f"{name}.{way}.sql" for way in ("up", "down")]
    for path in files:
        if path.exists():
            raise CommandError(f"{path} is there already")
    for path, what in zip(files, ("upgrade", "downgrade, undoing the .up.sql"), strict=True):
        path.write_text(
            f"-- {name}: {' '.join(message.split())}\n"
            f"-- The {what}: plain SQL, run in the migration's transaction.\n",
            encoding="utf-8",
        )
    template_args["migration_name"] = name  # script.py.mako names the two files
    new.rev_id = rev
