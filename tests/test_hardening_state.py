"""Hardening, round three: the programme's own state and inputs, and form settings.

A form setting (`arch.attention`, `arch.mixer`, `arch.grid_width`) on a model that has no such part
is one `error:` line (exit 2), before any compile, with every file that was there byte-identical
afterwards (test_hardening.refused). HRM, Gemma and the tiny transformer refuse theirs through their
schemas (an unknown key); the TRM variants share one schema, so their family checks which parts this
TRM has.

The run queue (`launch.py programme`, in this process), by class, each one `error:` line with its
exit code, no traceback, and every file of the state directory and the mirror byte-identical:
a damaged state file under every verb (exit 2, nothing written; `programme repair` restores the
mirror's); a state write that fails on a real small file system, full or read-only (exit 6, the
file as it was); a name or number that makes no sense (exit 2, before anything is read); one line
per fault (a command-line mistake; a request file that cannot be applied, said once in the
controller's log). The storage cases mount a tmpfs and are skipped, saying why, where that cannot be
done."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.launch import main as launch
from experiments.launcher import queue_state, supervise
from experiments.launcher.controller import Controller
from experiments.launcher.gcloud import Target
from experiments.launcher.ledger import LaunchRecord, Outcome, StateWriteError, Status
from helpers import base_overrides, cli_refused, compose_config, fill, raises_one_line, tree_hash
from runtime.config import check_path_names
from runtime.errors import EXIT_STORAGE, EXIT_USER_ERROR, UserError
from test_hardening import refused


@pytest.fixture
def data(sudoku_dir, tmp_path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(sudoku_dir, copy)
    return copy


@pytest.mark.parametrize("overrides,needles", [
    (["arch=trm_mlp", "arch.attention=xla"], ["arch.attention='xla'", "has no attention", "arch=trm_att"]),
    (["arch=trm_mlp", "arch.attention=splash"], ["arch.attention='splash'", "has no attention"]),
    (["arch=trm_att", "arch.mixer=pallas"], ["arch.mixer='pallas'", "has no mlp_t mixer", "arch=trm_mlp"]),
    (["arch=trm_att", "arch.mixer=xla"], ["arch.mixer='xla'", "has no mlp_t mixer"]),
    (["arch=trm_att", "arch.grid_width=9"], ["arch.grid_width=9", "arch.attention_window is not set"]),
    (["arch=hrm", "+arch.mixer=xla"], ["arch.mixer"]),  # HRM's schema has no mixer
    (["arch=tiny_transformer", "+arch.attention=xla"], ["arch.attention"]),
], ids=["trm_mlp attention=xla", "trm_mlp attention=splash", "trm_att mixer=pallas", "trm_att mixer=xla",
        "trm_att grid_width without window", "hrm mixer", "tiny attention"])
def test_a_form_setting_on_a_model_without_that_part_is_one_line(data, tmp_path, overrides, needles):
    runs = tmp_path / "runs"
    refused(tmp_path, base_overrides(data, runs, steps=2) + overrides, *needles)
    assert not runs.exists()


def test_the_forms_a_trm_has_are_accepted(data, tmp_path):
    """The same settings on the variant that has the part compose and validate."""
    base = base_overrides(data, tmp_path / "runs", steps=2)
    assert compose_config(base + ["arch=trm_mlp", "arch.mixer=xla"]).arch.mixer == "xla"
    assert compose_config(base + ["arch=trm_att", "arch.attention=xla"]).arch.attention == "xla"
    window = compose_config(base + ["arch=trm_att", "arch.attention_window=3", "arch.grid_width=9"]).arch
    assert (window.attention_window, window.grid_width) == (3, 9)


# ======================================================== the run queue's own state and inputs
# `launch.py programme ...` in this process (experiments/launcher/queue_state.py, controller.py): a damaged state file,
# a state write that fails, a name or number that makes no sense, each one `error:` line with its
# exit code, no traceback, and every file of the state directory and the mirror as it was.

V1 = Path(__file__).resolve().parent / "data" / "programme-v1"  # a programme's state (test_ledger.py)
NAME, DONE, QUEUED = "prog", "exp08/ema0.99", "exp08/off"


def programme(states: Path, verb: str, *args: str) -> list[str]:
    return ["programme", verb, NAME, *args, "--state-dir", str(states)]


def unchanged(capsys, root: Path, argv: list[str], code: int, *needles: str, added: bool = False) -> str:
    """`launch.py` with `argv` ends with `code` and one `error:` line (no traceback), and every file
    under `root` (state directories, mirror) is byte-identical afterwards; none is added unless
    `added` (what a lease leaves beside the state)."""
    before = tree_hash(root)
    line = cli_refused(capsys, launch, argv, code, *needles)
    after = tree_hash(root)
    assert {name: after.get(name) for name in before} == before
    assert added or after == before, sorted(set(after) - set(before))
    return line


@pytest.fixture
def states(tmp_path) -> Path:
    root = tmp_path / "states"
    shutil.copytree(V1, root / NAME)
    return root


@pytest.fixture
def mirrored(states, tmp_path) -> Path:
    """The programme with a mirror (as gs://, through fsspec) holding its snapshot; returns the mirror."""
    mirror = tmp_path / "bucket" / NAME
    state = queue_state.State(states / NAME, io.StringIO())
    state.load()
    state.sub.mirror = str(mirror)
    state.save_submission()
    state.save()
    return mirror


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _launch0(data: dict) -> dict:
    return data["variants"][DONE]["supervision"]["launches"][0]


# What each damage does to the state directory, and what the line says.
DAMAGE = {
    "ledger truncated": (lambda d: (d / "ledger.json").write_text((d / "ledger.json").read_text()[:300]),
                         ["ledger.json is truncated or garbled"]),
    "ledger empty": (lambda d: (d / "ledger.json").write_text(""), ["ledger.json is truncated or garbled"]),
    "ledger not JSON": (lambda d: (d / "ledger.json").write_bytes(b"\xff\xfe\x00garbage"),
                        ["ledger.json is truncated or garbled"]),
    "ledger a list": (lambda d: (d / "ledger.json").write_text("[]"), ["a JSON list, not an object"]),
    "ledger variants a list": (lambda d: edit(d / "ledger.json", lambda x: x.update(variants=[])),
                               ["variants: input should be an object"]),
    "ledger unknown key": (lambda d: edit(d / "ledger.json", lambda x: x.update(owner="me")),
                           ["owner: a field this version does not know"]),
    "ledger missing key": (lambda d: edit(d / "ledger.json", lambda x: _launch0(x).pop("started")),
                           ['variants["exp08/ema0.99"].supervision.launches[0].started: missing']),
    "ledger infinite number": (lambda d: (d / "ledger.json").write_text(
        (d / "ledger.json").read_text().replace('"ready_seconds": 0.0', '"ready_seconds": 1e400', 1)),
        ["input should be a finite number"]),
    "ledger of another programme": (lambda d: edit(d / "ledger.json", lambda x: x["variants"].pop(QUEUED)),
                                    ["ledger.json is not a ledger this code reads (variants: ['exp08/ema0.99'] where "
                                     "programme.json has"]),
    "ledger a folder": (lambda d: ((d / "ledger.json").unlink(), (d / "ledger.json").mkdir()),
                        ["ledger.json is a folder"]),
    "ledger missing": (lambda d: (d / "ledger.json").unlink(), ["ledger.json is missing beside its programme.json"]),
    "programme.json unknown key": (lambda d: edit(d / "programme.json", lambda x: x.update(owner="me")),
                                   ["programme.json is not a submission", "owner: a field this version does not know"]),
    "programme.json missing key": (lambda d: edit(d / "programme.json", lambda x: x.pop("zone")), ["zone: missing"]),
    "programme.json wrong type": (lambda d: edit(d / "programme.json", lambda x: x.update(variants="exp08/off")),
                                  ["variants: input should be a valid array"]),
    "programme.json budget 1e400": (lambda d: (d / "programme.json").write_text(
        (d / "programme.json").read_text().replace('"budget": 1.0', '"budget": 1e400')),
        ["budget: input should be a finite number"]),
    "programme.json a list": (lambda d: (d / "programme.json").write_text("[1]"), ["a JSON list, not an object"]),
    "programme.json unsafe slice": (lambda d: edit(d / "programme.json", lambda x: x.update(slices=["s1;reboot"])),
                                    ["slices: 's1;reboot' is no safe name"]),
    "programme.json no slices": (lambda d: edit(d / "programme.json", lambda x: x.update(slices=[])),
                                 ["slices: names no slice"]),
    "commands a file": (lambda d: (d / "commands").write_text("stop"),
                        ["commands is a file, where the folder of the controller's requests should be"]),
    "controller.log a folder": (lambda d: ((d / "controller.log").unlink(), (d / "controller.log").mkdir()),
                                ["controller.log is a folder, where its file should be"]),
    "ledger a pipe": (lambda d: ((d / "ledger.json").unlink(), os.mkfifo(d / "ledger.json")),
                      ["ledger.json is no regular file"]),  # reading it would wait forever
}
VERBS = {"status": [], "run": [], "stop": [], "skip": [QUEUED], "retry": [DONE], "budget": ["5"]}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_state_file_is_one_line_naming_it_and_nothing_is_written(capsys, states, tmp_path, damage):
    change, needles = DAMAGE[damage]
    change(states / NAME)
    unchanged(capsys, tmp_path, programme(states, "status"), EXIT_USER_ERROR, str(states / NAME), *needles)


@pytest.mark.parametrize("verb", [*VERBS, "submit"])
@pytest.mark.parametrize("damage", ["ledger truncated", "ledger variants a list", "programme.json missing key",
                                    "commands a file"])
def test_every_verb_refuses_a_damaged_state_before_writing(capsys, states, tmp_path, verb, damage):
    """Under run too: nothing written, not even controller.log or the lease. Submit over it: refused as a
    programme that exists (or the file in the way), before the preflight."""
    change, needles = DAMAGE[damage]
    change(states / NAME)
    if verb == "submit":
        argv = programme(states, "submit", "exp08", "--slice", "s1", "--zone", "z", "--accelerator-type", "v4-8",
                         "--runtime-version", "r")
        needles = ["commands is a file"] if damage == "commands a file" else [f"programme {NAME} exists"]
    else:
        argv = programme(states, verb, *VERBS[verb])
    unchanged(capsys, tmp_path, argv, EXIT_USER_ERROR, *needles)


def test_the_line_names_the_mirror_and_repair_restores_from_it(capsys, states, mirrored, tmp_path):
    """With a mirror the line names its snapshot and the command that restores it; `programme repair`
    then puts the mirror's state in place and keeps the damaged file beside it. Repair refuses a
    state that reads, and a mirror that holds none, changing nothing."""
    ledger = states / NAME / "ledger.json"
    ledger.write_text(ledger.read_text()[:200])
    damaged = ledger.read_bytes()
    repair = f"programme repair {NAME} --state-dir {states} --mirror {mirrored}"
    unchanged(capsys, tmp_path, programme(states, "status"), EXIT_USER_ERROR, f"restore it from {mirrored}/state.json",
              repair)

    assert launch(programme(states, "repair")) == 0  # the mirror programme.json names
    said = capsys.readouterr().out
    assert f"restored {states / NAME} from the mirror {mirrored}" in said, said
    aside = list((states / NAME).glob("damaged-*"))
    assert len(aside) == 1 and (aside[0] / "ledger.json").read_bytes() == damaged
    snapshot = json.loads((mirrored / "state.json").read_text())
    assert json.loads(ledger.read_text()) == snapshot["ledger"]
    queue_state.State(states / NAME, io.StringIO()).load()  # reads again

    unchanged(capsys, tmp_path, programme(states, "repair", "--mirror", str(mirrored)), EXIT_USER_ERROR,
              "nothing to repair", added=False)
    ledger.write_text("")
    unchanged(capsys, tmp_path, programme(states, "repair", "--mirror", str(tmp_path / "nowhere")), EXIT_USER_ERROR,
              "holds no programme")


@pytest.mark.parametrize("damage,needles", [
    ("truncated", ["state.json is truncated or garbled"]),
    ("ledger unknown key", ["ledger.owner: a field this version does not know"]),
    ("submission missing key", ["submission.zone: missing"]),  # as programme.json
    ("another programme's ledger", ["variants: ['exp08/ema0.99'] where programme.json has"]),
])
def test_a_damaged_mirror_is_one_line_and_nothing_is_taken_over(capsys, states, mirrored, tmp_path, damage, needles):
    snapshot = mirrored / "state.json"
    if damage == "truncated":
        snapshot.write_text(snapshot.read_text()[:500])
    else:
        edit(snapshot, {"ledger unknown key": lambda x: x["ledger"].update(owner="me"),
                        "submission missing key": lambda x: x["submission"].pop("zone"),
                        "another programme's ledger": lambda x: x["ledger"]["variants"].pop(QUEUED)}[damage])
    elsewhere = tmp_path / "elsewhere"  # another machine: nothing but the mirror
    for verb in ("status", "run", "stop"):
        unchanged(capsys, tmp_path, programme(elsewhere, verb, "--mirror", str(mirrored)), EXIT_USER_ERROR,
                  f"{mirrored}/state.json", *needles)
    assert not elsewhere.exists()


@pytest.mark.parametrize("damage,needles", [
    ("truncated", ["is truncated or garbled"]),
    ("not JSON", ["is truncated or garbled"]),
    ("a list", ["a JSON list, not an object"]),
    ("unknown key", ["owner: a field this version does not know"]),
    ("a folder", ["supervision.json is a folder"]),
])
def test_a_damaged_supervision_record_is_one_line(capsys, tmp_path, damage, needles):
    record = tmp_path / "logs" / "r1" / "supervision.json"
    record.parent.mkdir(parents=True)
    {"truncated": lambda: record.write_text('{"schema": 2, "run_id": "r1", "laun'),
     "not JSON": lambda: record.write_bytes(b"\x80\x81\x82"),
     "a list": lambda: record.write_text("[]"),
     "unknown key": lambda: record.write_text(json.dumps({"schema": 2, "run_id": "r1", "owner": "me"})),
     "a folder": lambda: record.mkdir()}[damage]()
    unchanged(capsys, tmp_path, ["supervise", "--status", "--run-id", "r1", "--log-dir", str(tmp_path / "logs")],
              EXIT_USER_ERROR, f"supervision record {record}", *needles)


# ------------------------------------------------- a state write that fails: a real small file system
@pytest.fixture
def disk(tmp_path):
    """A tmpfs of its own at tmp_path/disk (a real file system to fill or make read-only), unmounted
    afterwards. Skipped, saying why, where this machine cannot mount one."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                                 text=True)
    except FileNotFoundError:
        pytest.skip("no `mount` command here: the storage faults need a real small file system")
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the storage faults need a real small file "
                    "system, which takes root or CAP_SYS_ADMIN")
    yield where
    if subprocess.run(["umount", str(where)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # busy: detach now, freed when unused


def read_only(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)


@pytest.fixture
def on_disk(disk) -> Path:
    """The programme's state directories on the small file system, with a status page already there."""
    states = disk / "states"
    shutil.copytree(V1, states / NAME)
    (states / NAME / "status.html").write_text("<p>the page before</p>")
    return states


@pytest.mark.parametrize("verb", ["status", "budget", "stop", "skip", "run", "submit"])
def test_a_read_only_state_directory_is_one_line(capsys, on_disk, disk, verb):
    """status prints its table, then the line; submit refuses before its preflight; run at its lease."""
    read_only(disk)
    argv = {"status": programme(on_disk, "status"), "budget": programme(on_disk, "budget", "5"),
            "stop": programme(on_disk, "stop"), "skip": programme(on_disk, "skip", QUEUED),
            "run": programme(on_disk, "run"),
            "submit": ["programme", "submit", "new", "exp08", "--slice", "s1", "--zone", "z", "--accelerator-type",
                       "v4-8", "--runtime-version", "r", "--state-dir", str(on_disk)]}[verb]
    what = {"status": "status page", "run": "controller's lease", "submit": "programme's folder"}.get(verb, "request")
    line = unchanged(capsys, disk, argv, EXIT_STORAGE, f"cannot write the {what}", "(read-only file system)",
                     "writable", "run the same command again")
    assert ("or give --html a writable path" in line) == (verb == "status")


def test_a_full_disk_under_status_budget_and_submit_is_one_line_and_changes_nothing(capsys, on_disk, disk, tmp_path):
    """The state directory and its mirror (elsewhere) as they were; submit leaves nothing behind."""
    state = queue_state.State(on_disk / NAME, io.StringIO())
    state.load()
    state.sub.mirror = str(tmp_path / "bucket" / NAME)
    state.save_submission()
    state.save()
    fill(disk, leave=0)
    unchanged(capsys, tmp_path, programme(on_disk, "status"), EXIT_STORAGE,
              f"cannot write the status page {on_disk / NAME / 'status.html'} (no space left on device)",
              f"free space on {on_disk / NAME}")
    unchanged(capsys, tmp_path, programme(on_disk, "budget", "5"), EXIT_STORAGE, "cannot write the request",
              "(no space left on device)")
    unchanged(capsys, tmp_path, ["programme", "submit", "new", "exp08", "--variants", "off", "--slice", "s1", "--zone",
                             "z", "--accelerator-type", "v4-8", "--runtime-version", "r", "--state-dir", str(on_disk)],
              EXIT_STORAGE, "cannot write the submission", "(no space left on device)")
    assert not (on_disk / "new").exists()  # nothing left half-submitted


def test_a_log_line_or_record_that_cannot_be_written_leaves_the_file_whole(on_disk, disk):
    """controller.log and supervise's log take a line whole or not at all (an append cut back to
    where it was), supervise's record is replaced whole: a full or read-only disk leaves them
    byte-identical. The logs are padded to a block boundary first, so the next line needs a new
    block (a line that fits in the last block's slack is no fault: it is written)."""
    state = queue_state.State(on_disk / NAME, io.StringIO())
    state.load()
    sup = supervise.FileSupervision(supervise.Spec(Target("t", "z"), "r1", [], log_dir=disk / "logs"), io.StringIO())
    sup.event("started")
    sup.save()
    block = os.statvfs(disk).f_bsize
    for log in (on_disk / NAME / "controller.log", sup.log_path):
        with open(log, "a") as f:
            f.write("#" * (-log.stat().st_size % block))
    before = tree_hash(disk)
    fill(disk, leave=0)
    raises_one_line(StateWriteError, lambda: state.event("start", programme=NAME), "cannot write the controller log",
                    "(no space left on device)", code=EXIT_STORAGE)
    raises_one_line(StateWriteError, lambda: sup.event("launched"), "cannot write the supervisor's log",
                    "(no space left on device)", code=EXIT_STORAGE)
    (disk / "filler").unlink()
    read_only(disk)
    with sup.lock:
        sup.record.restarts += 1
    raises_one_line(StateWriteError, sup.save, f"cannot write the supervision record {disk / 'logs' / 'r1'}",
                    "(read-only file system)", code=EXIT_STORAGE)
    assert tree_hash(disk) == before


def test_a_ledger_save_that_fails_during_run_is_one_line_and_keeps_the_ledger(capsys, on_disk, disk, monkeypatch):
    """The disk fills once the controller holds its lease: its first save fails; the ledger and the
    controller's log stay byte-identical (what the lease leaves beside them may be added)."""
    recover = Controller.recover

    def fills_first(self):
        fill(disk, leave=0)
        return recover(self)

    monkeypatch.setattr(Controller, "recover", fills_first)
    unchanged(capsys, disk, programme(on_disk, "run"), EXIT_STORAGE,
              f"cannot write the ledger {on_disk / NAME / 'ledger.json'} (no space left on device)", added=True)
    assert not (on_disk / NAME / ".lease.json").exists()  # given back


# ------------------------------------------------------------ names and numbers that make no sense
SUBMIT = ["exp08", "--zone", "z", "--accelerator-type", "v4-8", "--runtime-version", "r"]


@pytest.mark.parametrize("argv,needles", [
    (["status", ".."], ["programme NAME='..' cannot name a folder", "without '/' and not '.' or '..'"]),
    (["status", ""], ["programme NAME='' cannot name a folder: it is empty"]),
    (["stop", "a/b"], ["programme NAME='a/b' cannot name a folder"]),
    (["status", "x" * 300], ["it is 300 characters long, and a folder name holds at most 255"]),
    (["budget", "$(reboot)", "5"], ["programme NAME='$(reboot)'", "gs:// URLs and shell commands"]),
    (["submit", "..", *SUBMIT, "--slice", "s1"], ["programme NAME='..'"]),
    (["submit", "x" * 300, *SUBMIT, "--slice", "s1"], ["300 characters long"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--slice", "s1"], ["--slice s1 is given twice"]),
    (["submit", "p", *SUBMIT, "--slice", "a b"], ["--slice='a b' cannot name a folder"]),
    (["submit", "p", *SUBMIT, "--slice=-x"], ["--slice='-x' cannot name a folder"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--variants", ""], ["--variants '' names no variant"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--variants", "off,,ema0.99"], ["holds '', which names no variant"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--variants", "../off"], ["holds '../off'", "'..': it must be one"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--variants", "a/b/c"], ["a variant is GROUP/VARIANT or VARIANT"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--budget", "1e400"], ["--budget inf is out of range: it must be a "
                                                                       "finite number"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--plan", "no-such.csv"], ["--plan no-such.csv cannot be read",
                                                                          "No such file"]),
    (["submit", "q" * 70, *SUBMIT, "--slice", "s1"], ["would share the run id", "choose a shorter programme NAME"]),
    (["budget", NAME, "1e400"], ["hours inf is out of range: it must be a finite number"]),
    (["budget", NAME, "inf"], ["hours inf is out of range"]),
    (["budget", NAME, "nan"], ["hours nan is out of range"]),
    (["budget", NAME, "1e308"], ["hours 1e+308 is out of range: it must be >= 0 and <= 1000000 (pod-hours)"]),
    (["submit", "p", *SUBMIT, "--slice", "s1", "--budget", "1e308"], ["--budget 1e+308 is out of range"]),
    (["skip", NAME, "../../x"], ["'../../x' names no variant", "a variant is GROUP/VARIANT"]),
    (["retry", NAME, "exp08/" + "v" * 300], ["names no variant", "300 characters long"]),
    (["skip", NAME, "exp08/nope"], ["programme prog has no variant 'exp08/nope'"]),
])
def test_a_name_or_number_that_makes_no_sense_is_one_line(capsys, states, tmp_path, argv, needles):
    """Names by the rules the trainer checks run.name with (runtime/ranges.py), before anything is
    read or written: no preflight, no folder made, the state as it was."""
    verb, rest = argv[0], argv[1:]
    unchanged(capsys, tmp_path, ["programme", verb, *rest, "--state-dir", str(states)], EXIT_USER_ERROR, *needles)


def test_a_budget_past_what_the_page_can_draw_already_in_a_ledger_is_shown_without_its_line(capsys, states):
    """A programme.json holding a budget `programme budget` now refuses (written before it did): status
    prints the table and writes the page, its picture without the budget's line."""
    edit(states / NAME / "programme.json", lambda data: data.update(budget=1e308))
    edit(states / NAME / "ledger.json", lambda data: data.update(history=[]))  # the budget's line alone: no scale
    assert launch(programme(states, "status")) == 0
    assert "budget 1e+308 pod-hours" in capsys.readouterr().out
    assert (states / NAME / "status.html").read_text().count("data:image/png;base64,") == 2


def test_the_trainer_refuses_a_name_longer_than_a_folder_name_as_the_programme_does(tmp_path):
    """One rule for both (runtime/ranges.py): a 300-character run.name was a traceback at its mkdir."""
    overrides = base_overrides(tmp_path / "data", tmp_path / "runs", steps=2) + ["run.name=" + "x" * 300]
    raises_one_line(UserError, lambda: check_path_names(compose_config(overrides)), "run.name=",
                    "it is 300 characters long, and a folder name holds at most 255", "choose another run.name")


def test_submit_over_the_mirror_of_another_programme_is_refused(capsys, states, mirrored, tmp_path):
    """A new programme's first save would replace the state the mirror holds."""
    unchanged(capsys, tmp_path, ["programme", "submit", "other", *SUBMIT, "--slice", "s1", "--mirror", str(mirrored),
                                 "--state-dir", str(states)], EXIT_USER_ERROR,
              f"the mirror {mirrored} already holds a programme's state", f"programme run other --mirror {mirrored}")


# ------------------------------------------------------------------------- one fault, one line
@pytest.mark.parametrize("argv,needles", [
    (["budget", NAME, "abc"], ["argument HOURS: invalid float value: 'abc'", "launch.py programme budget --help"]),
    (["budget", NAME], ["the following arguments are required: HOURS"]),
    (["skip", NAME], ["the following arguments are required: GROUP/VARIANT"]),
    (["submit", NAME, "exp08", "--slice", "s1"], ["the following arguments are required: --zone"]),
    (["status", NAME, "--no-such-option"], ["unrecognized arguments: --no-such-option"]),
    (["frobnicate", NAME], ["invalid choice: 'frobnicate'"]),
])
def test_a_command_line_mistake_is_one_error_line_not_usage_and_a_line(capsys, states, tmp_path, argv, needles):
    unchanged(capsys, tmp_path, ["programme", *argv, "--state-dir", str(states)], EXIT_USER_ERROR, *needles)


@pytest.mark.parametrize("request_,reason", [
    ({"verb": "budget", "value": "abc"}, 'value: input should be a valid number, got "abc"'),
    ({"verb": "budget"}, "value: missing (a budget request holds the pod-hours)"),
    ({"verb": "budget", "value": -2}, "value: -2 is out of range: it must be >= 0 and <= 1000000 (pod-hours)"),
    ({"verb": "budget", "value": "1e400"}, "value: input should be a finite number"),
    ({"verb": "skip"}, "variant: missing (a skip request names its variant)"),
    ({"verb": "explode"}, 'verb: input should be'),
    ("{not json", "not JSON"),
    ("a folder", "Is a directory"),
], ids=["budget abc", "budget without value", "budget -2", "budget 1e400", "skip without variant", "unknown verb",
        "not JSON", "a folder"])
def test_a_request_that_cannot_be_applied_is_one_ignored_line_once(states, mirrored, request_, reason):
    """A request file whose fields are wrong (left by hand, or by another version) is said once, in one
    `command-ignored` line of the controller's log, though a copy of it is in the state directory
    and one on the mirror; no `error:` line, the controller goes on, the budget is untouched."""
    here, there = states / NAME / "commands" / "r1.json", mirrored / "commands" / "r1.json"
    for path in (here, there):
        path.parent.mkdir(parents=True, exist_ok=True)
        if request_ == "a folder":
            path.mkdir()
        else:
            text = request_ if isinstance(request_, str) else json.dumps({"id": "r1", **request_})
            path.write_text(text.replace('"1e400"', "1e400"))
    said = io.StringIO()
    state = queue_state.State(states / NAME, said)
    state.load()
    budget = state.sub.budget
    assert state.commands(mirror=True) == [] and state.commands(mirror=True) == []  # the mirror polled twice
    lines = said.getvalue().splitlines()
    assert len(lines) == 1 and " command-ignored id=r1 " in lines[0] and reason in lines[0], lines
    assert not any(line.startswith("error:") for line in lines)
    log = (states / NAME / "controller.log").read_text().splitlines()
    assert log[-1] == lines[0] and sum("command-ignored" in line for line in log) == 1
    state.load()
    assert state.sub.budget == budget


def test_a_save_that_fails_in_a_slice_thread_stops_the_controller_in_one_line(capsys, on_disk, disk, monkeypatch):
    """The disk fills while a variant runs (its supervision ends, and the save of its end fails in the
    slice's thread): every thread stops, the controller ends with the write's one line, exit 6, and
    the ledger on disk is the one saved when the variant started."""
    edit(on_disk / NAME / "programme.json", lambda x: x.update(budget=5.0))
    monkeypatch.chdir(disk)  # its checkpoint directories are relative: nothing there
    state = on_disk / NAME
    at_fault: dict[str, bytes] = {}

    def completes(self):
        at_fault.update({name: (state / name).read_bytes() for name in ("ledger.json", "controller.log")})
        fill(disk, leave=0)
        with self.sup.changing() as record:
            record.launches.append(LaunchRecord(started=1.0, ended=2.0, code=0, outcome=Outcome.COMPLETED,
                                                cause="completed", last_step=10, total=10))
        return self.finish(Status.COMPLETED, 0)

    monkeypatch.setattr(supervise.Supervisor, "run", completes)
    cli_refused(capsys, launch, programme(on_disk, "run"), EXIT_STORAGE, "cannot write the ", f"{state}",
                "(no space left on device)")
    assert {name: (state / name).read_bytes() for name in at_fault} == at_fault  # as the fault found them
    assert json.loads(at_fault["ledger.json"])["variants"][QUEUED]["state"] == "running"
