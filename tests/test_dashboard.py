"""experiments/dashboard.py: each group's W&B workspace and report, built with the real
wandb-workspaces from group.yaml, read back through the library's own models; saved through the
real `wandb.Api()` client to a local stand-in for W&B's GraphQL endpoint."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from experiments import dashboard
from experiments.programme import GROUPS
from runtime.errors import EXIT_USER_ERROR

README_KEY = re.compile(r"^- (.+?): ", re.M)


def readme_own_keys(group: str) -> list[str]:
    """The keys of the group README's W&B table (the lines under "Watch GROUP in W&B")."""
    text = (Path(dashboard.REPO_ROOT) / "experiments" / group / "README.md").read_text()
    block = text.split(f"**Watch {group} in W&B:**", 1)[1].split("\n\n", 2)
    lines = block[1] if len(block) > 1 and block[1].startswith("- ") else ""
    return [k for entry in README_KEY.findall(lines) for k in dashboard.watch_keys(entry)]


def panel_keys(panels) -> set[str]:
    """Every metric a list of the library's panels shows."""
    out: set[str] = set()
    for p in panels:
        for name in ("y", "metrics", "x", "metric"):
            value = getattr(p, name, None)
            for v in value if isinstance(value, list) else [value]:
                if v is not None:
                    out.add(v if isinstance(v, str) else v.name)
    return out


@pytest.mark.parametrize("name", list(GROUPS))
def test_offline_specs_read_back_through_the_library(name, tmp_path):
    from wandb_workspaces.reports.v2 import internal as report_internal
    from wandb_workspaces.reports.v2.interface import PanelGrid, Report
    from wandb_workspaces.workspaces import Workspace, internal

    assert dashboard.main([name, "--dry-run", "--root", str(tmp_path), "--entity", "team"]) == 0
    folder = tmp_path / name / "analysis"
    ws = Workspace._from_model(internal.View.model_validate_json((folder / "dashboard_workspace.json").read_text()))
    group = GROUPS[name]
    assert ws.name.startswith(name)
    assert f"'{name}'" in ws.runset_settings.filters and "Group" in ws.runset_settings.filters
    keys = [k if "." in k else f"{k}.name" for k in group.varies_keys]  # a preset swap: by the preset's name
    assert [g.name for g in ws.runset_settings.groupby] == keys
    shown = panel_keys(p for s in ws.sections for p in s.panels)
    wanted = {p.y for p in group.plots} | set(readme_own_keys(name)) | {k for k, _ in dashboard.WANDB_KEYS[
        dashboard.family(group)]} | {group.primary}
    assert wanted <= shown, f"no panel for {sorted(wanted - shown)}"
    assert set(readme_own_keys(name)) == set(dashboard.own_keys(group)), "README W&B table and group.yaml disagree"
    shared = (Path(dashboard.REPO_ROOT) / "docs/EXPERIMENTS.md").read_text().split("<!-- generated: WANDB_KEYS -->")[1]
    table = {m[1] for m in re.findall(r"^\| (\w+) \| `([^`]+)` \|", shared.split("<!-- end")[0], re.M)
             if m[0] == dashboard.family(group)}
    assert table and table <= shown, f"docs/EXPERIMENTS.md's W&B keys with no panel: {sorted(table - shown)}"

    spec = json.loads((folder / "dashboard_report.json").read_text())
    rp = Report._from_model(report_internal.ReportViewspec.model_validate(spec))
    grids = [b for b in rp.blocks if isinstance(b, PanelGrid)]
    in_report = panel_keys(p for g in grids for p in g.panels)
    assert wanted <= in_report, f"the report has no panel for {sorted(wanted - in_report)}"
    assert all(f"'{name}'" in r.filters for g in grids for r in g.runsets)
    # read back in W&B's stored form, config.<top>.value.<rest>
    assert all([k.replace(".value.", ".") for k in r.groupby] == [f"config.{k}" for k in keys]
               for g in grids for r in g.runsets)
    text = json.dumps(spec)
    assert json.dumps(group.readme["hypothesis"])[1:40] in text  # the README's hypothesis, verbatim


def test_programme_tag_narrows_the_run_set(tmp_path):
    assert dashboard.main(["exp01", "--dry-run", "--root", str(tmp_path), "--programme-tag", "spring"]) == 0
    spec = json.loads((tmp_path / "exp01/analysis/dashboard_workspace-spring.json").read_text())
    filters = spec["spec"]["section"]["runSets"][0]["filters"]["filters"]
    assert {f["key"]["name"] for f in filters} == {"group", "tags"}


def test_unknown_group_is_one_error_line(tmp_path, capsys):
    assert dashboard.main(["exp99", "--dry-run", "--root", str(tmp_path)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown group(s) ['exp99']")
    assert not (tmp_path / "exp99").exists()


# --------------------------------------------------------------------------- saving to W&B


class FakeWandb(ThreadingHTTPServer):
    """Stands in for W&B's GraphQL endpoint (api.wandb.ai/graphql) on 127.0.0.1: it keeps the views
    it was sent and the runs a test gives it, answers the queries the real client sends, records each
    request, and answers every upsert with 403 when `refuse` is set. The client is the real library."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, dict]] = []
        self.views: dict[str, dict] = {}
        self.summaries: list[dict] = []  # one per run of the group
        self.refuse = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def upserts(self) -> list[dict]:
        return [v for op, v in self.requests if op in ("UpsertView2", "upsertView")]

    def answer(self, query: str, v: dict) -> tuple[int, dict]:
        op = re.search(r"(?:query|mutation)\s+(\w+)", query)
        name = op.group(1) if op else ""
        self.requests.append((name, v))
        if name in ("UpsertView2", "upsertView"):
            if self.refuse:
                return 403, {"errors": [{"message": "permission denied"}]}
            view_id = v.get("id") or f"view{len(self.views) + 1}"
            inserted = view_id not in self.views
            self.views[view_id] = {"id": view_id, "name": v["name"], "displayName": v["displayName"],
                                   "type": v["type"], "spec": v["spec"], "description": v.get("description", ""),
                                   "project": {"id": "p1", "name": v["projectName"], "entityName": v["entityName"]},
                                   "updatedAt": "2026-01-01T00:00:00"}
            return 200, {"data": {"upsertView": {"view": self.views[view_id], "inserted": inserted}}}
        if name == "DashboardViews":
            edges = [{"node": view} for view in self.views.values() if view["type"] == v["viewType"]]
            return 200, {"data": {"project": {"allViews": {"edges": edges}}}}
        if name == "Runs":
            edges = [{"node": {"id": f"r{i}", "name": f"run{i}", "displayName": f"run{i}", "state": "finished",
                               "config": "{}", "summaryMetrics": json.dumps(s), "group": v.get("group"),
                               "tags": [], "createdAt": "2026-01-01T00:00:00", "historyLineCount": 0}}
                     for i, s in enumerate(self.summaries)]
            return 200, {"data": {"project": {"internalId": "p1", "readOnly": False, "runCount": len(edges),
                                              "runs": {"edges": edges, "pageInfo": {"endCursor": None,
                                                                                   "hasNextPage": False}}}}}
        if name == "GetProjects":
            node = {"__typename": "Project", "id": "p1", "name": "podrunner", "entityName": "team",
                    "createdAt": "2026-01-01T00:00:00", "isBenchmark": False, "user": None}
            return 200, {"data": {"models": {"edges": [{"node": node}],
                                             "pageInfo": {"__typename": "PageInfo", "endCursor": None,
                                                           "hasNextPage": False}}}}
        viewer = {"id": "u1", "entity": "team", "username": "me", "email": "me@example.com", "admin": False,
                  "flags": "{}", "teams": {"edges": []}}
        return 200, {"data": {"viewer": viewer}}


class _Handler(BaseHTTPRequestHandler):
    server: FakeWandb

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, out = 200, {}
        if self.path.rstrip("/").endswith("graphql"):  # the rest (the client's own telemetry): 200, empty
            req = json.loads(body)
            status, out = self.server.answer(req.get("query", ""), req.get("variables") or {})
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    server = FakeWandb()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no netrc of the user's
    yield server
    server.shutdown()
    server.server_close()


def test_first_run_creates_second_updates_in_place(fake_wandb, tmp_path, capsys):
    root = str(tmp_path / "out")
    fake_wandb.summaries = [{k: 0.5 for k in ("eval/exact_accuracy", "perf/examples_per_sec", "train/exact_accuracy")}]
    assert dashboard.main(["exp01", "--root", root, "--entity", "team"]) == 0
    first = fake_wandb.upserts()
    assert [u["type"] for u in first] == ["project-view", "runs"] and not any(u.get("id") for u in first)
    registry = json.loads((tmp_path / "out/exp01/analysis/dashboard.json").read_text())
    assert registry["workspace"]["id"] == "view1" and registry["report"]["id"] == "view2"
    assert "exp01" in capsys.readouterr().out

    assert dashboard.main(["exp01", "--root", root, "--entity", "team"]) == 0
    second = fake_wandb.upserts()[2:]
    assert [u.get("id") for u in second] == ["view1", "view2"]  # the same views, updated
    assert len(fake_wandb.views) == 2

    (tmp_path / "out/exp01/analysis/dashboard.json").unlink()  # lost: found again by name
    assert dashboard.main(["exp01", "--root", root, "--entity", "team"]) == 0
    assert [u.get("id") for u in fake_wandb.upserts()[4:]] == ["view1", "view2"] and len(fake_wandb.views) == 2


def test_key_no_run_logs_is_a_warning_naming_it_and_no_panel(fake_wandb, tmp_path, capsys):
    fake_wandb.summaries = [{"eval/exact_accuracy": 0.5}]
    assert dashboard.main(["exp01", "--root", str(tmp_path), "--entity", "team"]) == 0
    err = capsys.readouterr().err
    assert "warning: exp01: no run of the group logs 'train/exact_accuracy', so it has no panel" in err
    assert "'eval/exact_accuracy'" not in err
    spec = next(v["spec"] for v in fake_wandb.views.values() if v["type"] == "project-view")
    assert '"train/exact_accuracy"' not in spec and '"eval/exact_accuracy"' in spec  # no dead panel


def test_refused_is_one_error_line_and_nothing_saved(fake_wandb, tmp_path, capsys):
    fake_wandb.refuse = True
    assert dashboard.main(["exp01", "--root", str(tmp_path), "--entity", "team"]) == EXIT_USER_ERROR
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "refused" in err[0] and "team/podrunner" in err[0]
    assert not (tmp_path / "exp01/analysis/dashboard.json").exists()


def test_online_without_a_key_is_one_error_line(monkeypatch, tmp_path, capsys):
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert dashboard.main(["exp01", "--root", str(tmp_path)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: W&B is online but has no key") and len([e for e in err if "error" in e]) == 1


def test_programme_makes_each_group_view_at_its_first_variant_and_status_links_it(fake_wandb, tmp_path):
    import threading

    from experiments.launcher import controller, queue_state, queue_status
    from experiments.launcher.ledger import LaunchRecord, Outcome, SupervisionRecord

    first, second = "exp08/ema0.99", "exp08/off"
    sub = queue_state.Submission(name="spring", variants=[first, second], slices=["s1", "s2"], zone="z",
                                 accelerator_type="v4-8", runtime_version="v")
    state = queue_state.State(tmp_path / "spring")
    state.create(sub)
    dashboard.opt_in(state.dir, {"entity": "team", "project": "podrunner", "app_url": fake_wandb.url})
    ctl = controller.Controller(state, alert=lambda title, text: None)
    for variant, slice_name in ((first, "s1"), (second, "s2")):
        ctl._start(variant, slice_name)
        for thread in [t for t in threading.enumerate() if t.name.startswith("dashboard-")]:
            thread.join()
    assert [u["type"] for u in fake_wandb.upserts()] == ["project-view", "runs"]  # once for the group
    view = next(v for v in fake_wandb.views.values() if v["type"] == "project-view")
    assert view["displayName"] == dashboard.view_name(GROUPS["exp08"], "spring")
    assert "spring" in view["spec"] and "tags" in view["spec"]  # the run set: the programme's runs only

    links = dashboard.links(state.dir)
    workspace_url = links["groups"]["exp08"]
    state.ledger.variants[first].supervision = SupervisionRecord(launches=[LaunchRecord(
        0.0, 1.0, 0, Outcome.COMPLETED, "completed", last_step=1, total=1, wandb_run_id="w1")])
    text = queue_status.text(state.sub, state.ledger, links=links)
    assert f"{fake_wandb.url}/team/podrunner/runs/w1" in text and workspace_url in text
    page = queue_status.page(state.sub, state.ledger, links=links)
    assert f"<a href='{fake_wandb.url}/team/podrunner/runs/w1'>w1</a>" in page
    assert f"<a href='{workspace_url}'>workspace</a>" in page


def test_dashboards_need_the_runs_online(tmp_path):
    from types import SimpleNamespace

    with pytest.raises(dashboard.UserError, match="run.wandb.mode=online"):
        dashboard.programme_settings(SimpleNamespace(mode="offline", entity=None, project="podrunner"))


def test_dashboards_settings_resolve_the_default_entity(fake_wandb):
    from types import SimpleNamespace

    settings = dashboard.programme_settings(SimpleNamespace(mode="online", entity=None, project="podrunner"))
    assert settings["entity"] == "team" and settings["project"] == "podrunner" and settings["app_url"]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="no chromium on this machine")
def test_status_page_links_in_headless_chromium(tmp_path):
    """The page as a browser reads it: its DOM, dumped by headless Chromium, holds the two links."""
    import subprocess

    from experiments.launcher import queue_state, queue_status
    from experiments.launcher.ledger import LaunchRecord, Outcome, SupervisionRecord

    sub = queue_state.Submission(name="spring", variants=["exp08/ema0.99"], slices=["s1"], zone="z",
                                 accelerator_type="v4-8", runtime_version="v")
    state = queue_state.State(tmp_path / "spring")
    state.create(sub)
    state.ledger.variants["exp08/ema0.99"].supervision = SupervisionRecord(launches=[LaunchRecord(
        0.0, 1.0, 0, Outcome.COMPLETED, "completed", last_step=1, total=1, wandb_run_id="w1")])
    links = {"runs": "https://wandb.example/team/podrunner/runs/", "groups": {"exp08": "https://wandb.example/w?nw=a"}}
    page = tmp_path / "status.html"
    page.write_text(queue_status.page(state.sub, state.ledger, links=links))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert '<a href="https://wandb.example/team/podrunner/runs/w1">w1</a>' in dom
    assert '<a href="https://wandb.example/w?nw=a">workspace</a>' in dom
