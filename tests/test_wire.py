"""runtime/wire.py: each kind of tagged line read back from what its emit wrote, as the launcher
finds it (gcloud's prefix, other lines around), in the exact bytes older trees print; and no other
source file that writes or matches those tags."""

from __future__ import annotations

import re
from pathlib import Path


from runtime import wire

REPO = Path(__file__).resolve().parents[1]
PREFIX = "t1v-n-my-tpu-w-3: "  # what gcloud puts before a worker's line


def test_an_event_round_trips_in_the_format_on_disk():
    record = {"event": "checkpoint", "time": 1.5, "process": 0, "step": 7}
    line = wire.event_line(record)
    assert line == 'podrunner-event {"event": "checkpoint", "time": 1.5, "process": 0, "step": 7}'
    assert wire.event(PREFIX + line) == record
    assert wire.replayed(PREFIX + line)
    for not_one in ("step 7 done", 'podrunner-event {"step": 7}', "podrunner-event [1]", "podrunner-event {torn"):
        assert wire.event(not_one) is None


def test_a_start_line_round_trips_in_the_format_on_disk():
    start = wire.Start(host="t1v-n-my-tpu-w-0", log="/home/u/podrunner-logs/r/worker-w-0.log", commit="0123456789ab",
                       launch="launch_id=r")
    line = start.line()
    assert line == ("podrunner-start host=t1v-n-my-tpu-w-0 commit=0123456789ab launch_id=r "
                    "log=/home/u/podrunner-logs/r/worker-w-0.log")
    assert wire.start(PREFIX + line) == start and start.version == "0123456789ab"
    shipped = wire.Start(host="h", log="L", tree="f00d", launch="launch_id=r")
    assert shipped.line() == "podrunner-start host=h tree=f00d launch_id=r log=L"
    assert wire.start(shipped.line()) == shipped and shipped.version == "f00d"
    assert wire.replayed(line) and not wire.replayed("podrunner: h: this launch started here already")
    assert wire.start("podrunner-start no host here") is None


def test_a_versions_line_round_trips():
    row = {"host": "h", "commit": "c", "python": "3.11.9", "jax": "0.4.38", "ok": True, "problem": None}
    line = wire.versions_line(row)
    assert line.startswith('podrunner-versions {"host": "h", "commit": "c"')
    assert wire.versions(PREFIX + line) == row
    assert wire.versions(wire.event_line({"event": "started"})) is None


def test_a_status_line_round_trips_in_the_format_on_disk():
    status = wire.Status(host="h", worker="0", processes=[[41, 120]], step=5, step_from="log", metrics=None,
                         log="/l/worker-h.log")
    line = status.line()
    assert line == ('podrunner-status {"host": "h", "worker": "0", "processes": [[41, 120]], "step": 5, '
                    '"step_from": "log", "metrics": null, "log": "/l/worker-h.log"}')
    assert wire.status(PREFIX + line) == status and status.alive
    older = wire.status('podrunner-status {"host": "h", "processes": []}')  # fields a tree may lack read as None
    assert older == wire.Status("h", None, [], None, None, None, None) and not older.alive


def test_no_other_source_file_writes_or_matches_the_tags():
    """Only runtime/wire.py names a tag (or reaches for its private ones): every other module reads
    and writes tagged lines through its functions."""
    tags = re.compile(r"podrunner-(event|start|versions|status)\b|wire\._[A-Z]")
    files = [REPO / "pretrain_jax.py", *(REPO / "runtime").rglob("*.py"), *(REPO / "experiments").rglob("*.py"),
             *(REPO / "bench").rglob("*.py")]
    found = [f"{f.relative_to(REPO)}:{n}: {text.strip()}" for f in files if f != REPO / "runtime" / "wire.py"
             for n, text in enumerate(f.read_text().splitlines(), 1) if tags.search(text)]
    assert not found, "\n".join(found)


def test_events_reach_stdout_only_for_a_launcher_that_asks(tmp_path, capsys, monkeypatch):
    """A person at a terminal sees no event lines; a launch guard that sets EVENTS_ENV reads them;
    events.jsonl has them either way."""
    from runtime import events

    monkeypatch.delenv(wire.EVENTS_ENV, raising=False)
    events.attach(str(tmp_path), process=0)
    try:
        events.emit("checkpoint", step=3)
        assert capsys.readouterr().out == ""
        monkeypatch.setenv(wire.EVENTS_ENV, "1")
        events.emit("checkpoint", step=4)
        said = [wire.event(line) for line in capsys.readouterr().out.splitlines()]
    finally:
        events.detach()
    assert [e["step"] for e in said if e] == [4]
    assert [e["step"] for e in events.read(str(tmp_path / events.FILE))] == [3, 4]


def test_a_launchers_console_shows_people_lines_only():
    shown = ["step 3/10  loss 0.5", "error: the one line", "[launch] run id r1"]
    hidden = [PREFIX + wire.event_line({"event": "checkpoint", "step": 3}), wire.versions_line({"host": "h"}),
              "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"]
    assert [line for line in shown + hidden if wire.for_people(line)] == shown
