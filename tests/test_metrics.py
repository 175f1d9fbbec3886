"""``harel-store metrics``: the database's gauges in the Prometheus text format, read back with
prometheus-client's own parser, on a file and on sqld; served at /metrics with --listen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import tomllib
from prometheus_client.parser import text_string_to_metric_families

from harel_store import Event, Execution, LibsqlStore, TimerOp
from tests.test_cli import cli, failed, ok
from tests.test_metrics_listen import listening

DAY = 86400.0


def gauges(text: str) -> dict[tuple[str, str], float]:
    """Each sample by (name, its label other than the database) (the database: checked)."""
    samples: dict[tuple[str, str], float] = {}
    databases = set()
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge" and family.name.startswith("harel_store_"), family
        for sample in family.samples:
            labels = dict(sample.labels)
            databases.add(labels.pop("database"))
            samples[sample.name, next(iter(labels.values()), "")] = sample.value
    assert len(databases) == 1, databases
    return samples


def setup(database: str, auth_token: str = "") -> None:
    """Two running executions, one finished, one failed; three outbox entries (one claimed,
    one dead), a spawn; a timer due a day ago and one due in a day."""
    now = time.time()
    with LibsqlStore(database, auth_token=auth_token) as s:
        for i, status in enumerate(("running", "running", "finished", "failed")):
            s.save(Execution(id=f"exe-{i}", definition_id="d", status=status))
        exe = s.load("exe-0")
        assert exe is not None
        s.commit(
            exe,
            [(None, Event(name=f"e{i}")) for i in range(3)],
            timers=[TimerOp.schedule("late", now - DAY), TimerOp.schedule("soon", now + DAY)],
            spawns=[("kid", "root", {})],
        )
        (dead,) = s.claim_outbox("w", limit=1, max_attempts=1)
        s.fail("w", [dead], error="gave up")  # one attempt spent: dead at the next claim
        s.claim_outbox("w", limit=1, max_attempts=1)  # marks it dead, holds the next one


EXPECTED = {
    ("harel_store_executions", "running"): 2,
    ("harel_store_executions", "finished"): 1,
    ("harel_store_executions", "failed"): 1,
    ("harel_store_executions", "cancelled"): 0,
    ("harel_store_pending_items", "outbox"): 2,
    ("harel_store_pending_items", "spawn"): 1,
    ("harel_store_pending_items", "timer"): 1,
    ("harel_store_claimed_items", "outbox"): 1,
    ("harel_store_claimed_items", "spawn"): 0,
    ("harel_store_claimed_items", "timer"): 0,
    ("harel_store_dead_items", "outbox"): 1,
    ("harel_store_dead_items", "spawn"): 0,
    ("harel_store_dead_items", "timer"): 0,
    ("harel_store_timers_scheduled", ""): 1,
    ("harel_store_oldest_pending_age_seconds", "spawn"): 0,  # checked below
}


def check(found: dict[tuple[str, str], float]) -> None:
    for key, value in EXPECTED.items():
        if key != ("harel_store_oldest_pending_age_seconds", "spawn"):
            assert found[key] == value, (key, found[key])
    assert 0 <= found["harel_store_oldest_pending_age_seconds", "outbox"] < 60
    assert 0 <= found["harel_store_oldest_pending_age_seconds", "spawn"] < 60
    assert DAY <= found["harel_store_timer_lag_seconds", ""] < DAY + 60
    assert len(found) == len(EXPECTED) + 2


def test_the_gauges_of_a_known_file(tmp_path: Path) -> None:
    db = str(tmp_path / "m.db")
    setup(db)
    out = ok(cli("metrics", "--url", db))
    assert f'database="{db}"' in out
    check(gauges(out))


@pytest.mark.sqld
def test_the_gauges_of_a_server_never_show_its_token(server: Any) -> None:
    setup(server.url, server.token)
    result = cli("metrics", "--url", server.url, env={"HAREL_AUTH_TOKEN": server.token})
    out = ok(result)
    assert server.token not in out + result.stderr
    assert f'database="{server.url}"' in out
    check(gauges(out))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(reply.read().decode())


def test_listen_serves_each_scrape_anew_and_stops_on_sigterm(tmp_path: Path) -> None:
    db = str(tmp_path / "m.db")
    setup(db)
    with listening(db) as (_, url):  # SIGTERM at the end: exit 0, no traceback
        assert url.endswith("/metrics")
        check(gauges(scrape(url)))
        with LibsqlStore(db) as s:  # another writer moves on: the next scrape sees it
            s.save(Execution(id="exe-9", definition_id="d", status="cancelled"))
        assert gauges(scrape(url))["harel_store_executions", "cancelled"] == 1
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url.removesuffix("metrics"), timeout=10)
        assert missing.value.code == 404
        missing.value.close()


def test_without_prometheus_client_it_says_what_to_install(tmp_path: Path) -> None:
    db = str(tmp_path / "m.db")
    LibsqlStore(db).close()
    code = (
        "import sys; sys.modules['prometheus_client'] = None; from harel_store.cli import main;"
        " sys.argv = ['harel-store', 'metrics', '--url', sys.argv[1]]; sys.exit(main())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, db], capture_output=True, text=True, timeout=60
    )
    line = failed(result)
    # harel-store is on no registry: the extra's own requirement, or the checkout's extra
    assert f"pip install '{EXTRAS['prometheus'][0]}'" in line, line
    assert "pip install -e '.[prometheus]'" in line and "harel-store[" not in line, line


EXTRAS = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]


def test_the_install_the_docs_give_is_one_that_works() -> None:
    """docs/how-to/metrics.md installs an extra the way that works without a registry
    entry for harel-store: the requirements themselves, or the extra of a checkout."""
    text = (Path(__file__).parents[1] / "docs/how-to/metrics.md").read_text()
    assert "harel-store[" not in text
    for extra in ("prometheus", "otel"):
        assert f"pip install -e '.[{extra}]'" in text, extra
        assert f"pip install '{EXTRAS[extra][0]}'" in text, extra


# The Prometheus names of the otel extra's instruments, as OpenTelemetry's Prometheus
# exporter (and the Collector's) writes them: the unit as a suffix, a counter's _total.
OTEL_NAMES = {
    "harel_store_commit_duration_seconds_bucket",
    "harel_store_commit_duration_seconds_count",
    "harel_store_relay_items_total",
    "harel_store_relay_lag_seconds_bucket",
}


def test_the_grafana_dashboard_reads_only_names_there_are(tmp_path: Path) -> None:
    """contrib/grafana/harel-store.json: valid JSON, and every series its panels query is a
    gauge `harel-store metrics` prints or an instrument of the otel extra."""
    db = str(tmp_path / "m.db")
    setup(db)
    printed = {name for name, _ in gauges(ok(cli("metrics", "--url", db)))}
    dashboard = json.loads(
        (Path(__file__).parents[1] / "contrib/grafana/harel-store.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"harel_store_\w+", expr)}
    assert len(exprs) >= 8 and queried - printed <= OTEL_NAMES
    assert printed <= queried | {"harel_store_timers_scheduled"}  # every gauge but one shown
