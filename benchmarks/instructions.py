"""Instructions per commit on an in-memory store, counted by valgrind's callgrind: unlike
wall time on a shared machine, the count repeats to a fraction of a percent, so a change of
a few percent in the write path shows. Not a test.

    python -m benchmarks.instructions                 # this tree against HEAD~1
    python -m benchmarks.instructions --against REV   # this tree against another revision
    python -m benchmarks.instructions --smoke         # that it works: one row, two runs (~10 s)

Each figure is (instructions of 400 commits - those of 100) / 300, so start-up and imports
cancel out; a commit is the CAS update, one emit, the dedupe marker, one timer schedule and
(with trace) one trace step. The other revision, exported with ``git archive``, runs on the
same interpreter. ``--smoke``: sqlite without trace only, one run of 2 commits, this
tree's, under callgrind with its instrumentation off (that it runs), and a bare
interpreter's start counted (that callgrind counts): no figure of a commit; HEAD's tree is
exported all the same; this tree without OpenTelemetry runs once, not under valgrind.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, archive, parser

COMMITS = """
import os, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[5:] == ["no-otel"]:
    sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
os.environ.setdefault("RUST_LOG", "off")
from harel_store import Event, Execution, LibsqlStore, SqliteStore, TimerOp
store = {"libsql": LibsqlStore, "sqlite": SqliteStore}[sys.argv[2]](":memory:")
trace, n = sys.argv[3] == "trace", int(sys.argv[4])
exes = [Execution(id=f"e{i}", definition_id="d", active_path="a", context={"k": "x" * 40})
        for i in range(100)]
for exe in exes:
    store.save(exe)
events = [Event(name="tick") for _ in range(n)]
timers = [[TimerOp.schedule("main", 1e9 + i)] for i in range(n)]
for i in range(n):
    exe = exes[i % 100]
    store.commit(exe, [(exe.id, events[i])], processed_event_id=f"in-{i}", timers=timers[i],
                 trace={"state": "a"} if trace else None)
"""
ROWS = [(driver, trace) for driver in ("sqlite", "libsql") for trace in ("trace", "no-trace")]


def callgrind(argv: list[str], counted: bool = True) -> int:
    """The instructions callgrind counts for the command ``argv``; uncounted (its
    instrumentation off: a run of the commits takes ~5 s of a core, not ~23), its totals
    line is still read, and says 0."""
    options = [] if counted else ["--instr-atstart=no"]
    with tempfile.NamedTemporaryFile(suffix=".out") as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}", *options, *argv],
            check=True,
            capture_output=True,
        )
        totals = re.search(r"^(?:summary|totals): (\d+)", Path(out.name).read_text(), re.M)
    assert totals is not None, "callgrind wrote no totals"
    return int(totals[1])


def instructions(
    tree: Path, driver: str, trace: str, commits: int, *more: str, counted: bool = True
) -> int:
    """Instructions of a run of ``commits`` commits."""
    argv = [sys.executable, "-c", COMMITS, str(tree), driver, trace, str(commits), *more]
    return callgrind(argv, counted)


def per_commit(tree: Path, driver: str, trace: str, runs: tuple[int, int], *more: str) -> float:
    """Instructions of the larger run less the smaller one's, a commit."""
    fewer = instructions(tree, driver, trace, runs[0], *more)
    most = instructions(tree, driver, trace, runs[1], *more)
    return (most - fewer) / (runs[1] - runs[0])


def main() -> None:
    args = parser(__doc__, quick=None)
    args.add_argument("--against", metavar="REV", help="the revision to compare (HEAD~1)")
    ns = args.parse_args()
    against = ns.against or ("HEAD" if ns.smoke else "HEAD~1")
    runs, rows = ((0, 2), [("sqlite", "no-trace")]) if ns.smoke else ((100, 400), ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = archive(against, Path(tmp))
        print(f"instructions per commit, in memory: this tree / {against}")
        for driver, trace in rows:
            label = f"{driver} {trace}"
            if ns.smoke:
                # That callgrind runs the commits (this tree's, uncounted; the revision's
                # tree is still made) and counts (a bare interpreter's start: 2 to 4 s of
                # a core): no figure of a commit.
                instructions(ROOT, driver, trace, runs[1], counted=False)
                bare = callgrind([sys.executable, "-S", "-c", "pass"])
                if bare <= 0:
                    raise RuntimeError("callgrind counted no instruction of a bare interpreter")
                shown = f"{bare:,} instructions to start a bare interpreter"
                print(f"  {label:<16} (smoke: not counted; {shown})", flush=True)
                continue
            new = per_commit(ROOT, driver, trace, runs)
            old = per_commit(old_tree, driver, trace, runs)
            print(f"  {label:<16} {new:>9,.0f} / {old:>9,.0f} = {new / old:.3f}", flush=True)
        # The otel extra installed and no provider set, against the API absent (target
        # <= 1.02): what the store's telemetry costs an application that does not use it
        # (and does not import the API: one that does pays for its import's objects in
        # every garbage collection, ~3 % of a commit here, whatever the store does).
        driver, trace = rows[-1]
        print(f"instructions per commit, {driver} {trace}: OpenTelemetry API, no provider / none")
        if ns.smoke:  # that the run without the API works, not its count: no valgrind
            plain = subprocess.run([sys.executable, "-c", COMMITS, str(ROOT), driver, trace,
                                    "2", "no-otel"], capture_output=True, text=True)  # fmt: skip
            if plain.returncode:
                raise RuntimeError(f"the run without OpenTelemetry failed:\n{plain.stderr}")
            print("  this tree        (smoke: run without valgrind, not counted)", flush=True)
            return
        on = new  # this tree's figure for that row, measured above
        off = per_commit(ROOT, driver, trace, runs, "no-otel")
        print(f"  this tree        {on:>9,.0f} / {off:>9,.0f} = {on / off:.3f}", flush=True)


if __name__ == "__main__":
    main()
