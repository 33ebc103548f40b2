"""The plan report's renderers: HTML (self-contained, parses, loads in headless Chromium without
console errors), the Chrome/Perfetto trace, the schedule timeline against the cost model, and the
predicted-against-measured comparison."""

import importlib.util
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_report import (compare, coordinates, group_ranks, mesh_summary, render_comparison,
                                 sharding_summary)
from autopar.report_html import SECTION_IDS, append_measured_section, render_html
from autopar.report_svg import DETAIL_NODES, mesh_svg, timeline_svg
from autopar.report_timeline import makespan_s, timeline
from autopar.cost_models.pipeline import estimate, rank_order

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model", "gpt", "--model-config", "layers=4,hidden=64,heads=4,vocab=100,seq_len=32", "--seq-len", "32"]
# Two nodes of 8: tp inside a node, pp across the two nodes; interleaved so chunks and p2p show.
PLAN = ["plan", *MODEL, "--global-batch", "16", "--cluster", "dgx-h100", "--gpus", "16",
        "--strategy", "tp=2,pp=2,dp=4,microbatch=1,schedule=interleaved,vp=2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One real `autopar plan --report --trace --json` run: (summary, html path, trace path)."""
    folder = tmp_path_factory.mktemp("report")
    paths = {name: folder / name for name in ("plan.html", "plan.trace.json", "plan.json")}
    code = main([*PLAN, "--report", str(paths["plan.html"]), "--trace", str(paths["plan.trace.json"]),
                 "--json", str(paths["plan.json"])])
    assert code == 0
    return json.loads(paths["plan.json"].read_text()), paths["plan.html"], paths["plan.trace.json"]


class _Structure(HTMLParser):
    """Collects ids, external references and unbalanced tags."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "wbr", "source", "area", "base", "embed"}
    SVG_LEAVES = {"rect", "line", "path", "circle", "polyline", "polygon", "ellipse"}

    def __init__(self):
        super().__init__()
        self.ids, self.external, self.stack, self.errors = set(), [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for key in ("src", "href"):
            if str(attrs.get(key, "")).startswith(("http:", "https:", "//")):
                self.external.append(attrs[key])
        if tag == "link" or (tag == "script" and "src" in attrs):
            self.external.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()


def _parse(text):
    parser = _Structure()
    parser.feed(text)
    parser.close()
    return parser


def test_report_is_self_contained_parses_and_has_every_section(written):
    _, html_path, _ = written
    text = html_path.read_text()
    parsed = _parse(text)
    assert parsed.errors == [] and parsed.stack == []
    assert parsed.external == []
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert set(SECTION_IDS) <= parsed.ids
    assert {"mesh-svg", "mesh-groups", "stage-table", "timeline-svg", "memory-svg", "memory-table", "breakdown-svg",
            "breakdown-table", "alternatives-table", "sharding-table"} <= parsed.ids
    assert "nvlink4" in text and "ib-ndr" in text  # tp inside a node, pp across the two nodes


def test_mesh_groups_match_the_runtime_layout(written):
    summary, _, _ = written
    mesh = summary["mesh"]
    assert mesh["axes"]["tp"]["within_node"] and mesh["axes"]["tp"]["link"] == "nvlink4"
    assert not mesh["axes"]["pp"]["within_node"] and mesh["axes"]["pp"]["link"] == "ib-ndr"
    for stage in summary["plan"]["stages"]:  # the plan's devices of a stage are exactly its pp rank's GPUs
        assert {coordinates(mesh, r)["pp"] for r in stage["device_ids"]} == {stage["index"] % 2}
    for axis in ("tp", "dp", "pp"):  # each axis's groups partition the world, and contain their members
        groups = {tuple(group_ranks(mesh, axis, r)) for r in range(16)}
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert all(r in group_ranks(mesh, axis, r) for r in range(16))


def test_timeline_makespan_equals_the_cost_models_pipeline_time(written):
    summary, _, _ = written
    passes = timeline(summary)
    pipeline = summary["pipeline"]
    assert pipeline["p2p_s"] > 0
    assert summary["strategy"]["num_microbatches"] == 4  # 16 sequences over dp 4, micro-batch 1
    assert len(passes) == 2 * 4 * 2 * 2  # F and B × 4 micro-batches × pp 2 × vp 2
    assert makespan_s(passes) == pytest.approx(pipeline["makespan_s"], rel=1e-9)
    c = pipeline["critical_rank"]
    step = pipeline["rank_end_s"][c] + pipeline["exposed_sync_s"][c] + pipeline["optimizer_s"][c]
    assert step == pytest.approx(summary["predicted"]["step_time_s"], rel=1e-9)


def _uniform_summary(schedule, pp, m, vp=1, forward_s=1.0, backward_s=2.0):
    stages = [{"index": i, "rank": i % pp, "units": [f"layers.{i}"], "forward_s": forward_s, "backward_s": backward_s}
              for i in range(pp * vp)]
    return {"strategy": {"dp": 1, "tp": 1, "pp": pp, "vp": vp, "schedule": schedule, "num_microbatches": m},
            "stages": stages, "predicted": {"step_time_s": 1.0, "breakdown": {}}}


@pytest.mark.parametrize("schedule, vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_timeline_follows_the_schedule_and_the_closed_form(schedule, vp):
    pp, m = 4, 8
    summary = _uniform_summary(schedule, pp, m, vp)
    passes = timeline(summary)
    # Without transfers and with uniform stages the cost model's closed form is exact.
    closed = estimate([1.0] * pp * vp, [2.0] * pp * vp, m, schedule, pp=pp, vp=vp).step_time_s
    assert makespan_s(passes) == pytest.approx(closed, rel=1e-12)
    for rank in range(pp):
        mine = [x for x in passes if x["rank"] == rank]
        assert all(a["end_s"] <= b["start_s"] + 1e-12 for a, b in zip(mine, mine[1:]))  # one pass at a time
        expected = [(kind, chunk * pp + rank, mb) for kind, chunk, mb in rank_order(schedule, rank, pp, m, vp)]
        assert [(x["kind"], x["stage"], x["microbatch"]) for x in mine] == expected
    # GPipe runs every forward first; 1F1B's first rank pp forwards (pp − 1 warm-up, then one F before each B).
    first_backward = [x["kind"] for x in passes if x["rank"] == 0].index("B")
    assert first_backward == {"gpipe": m, "1f1b": pp}.get(schedule, first_backward)


def test_trace_is_valid_and_each_track_is_sequential(written):
    summary, _, trace_path = written
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0, 1}
    tracks: dict = {}
    for e in complete:
        assert isinstance(e["name"], str) and e["dur"] >= 0 and e["ts"] >= 0
        assert (e["pid"], e["tid"]) in named
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        track.sort(key=lambda e: e["ts"])
        # ts and dur are each rounded to 1 ns (0.001 µs): an end can pass the next start by 1 ns and a float ulp
        assert all(a["ts"] + a["dur"] <= b["ts"] + 2e-3 for a, b in zip(track, track[1:]))
    assert {e["cat"] for e in complete} >= {"forward", "backward", "p2p", "optimizer"}
    pipeline = summary["pipeline"]
    for rank in (0, 1):
        busy_us = sum(e["dur"] for e in complete if e["pid"] == rank and e["cat"] in ("forward", "backward"))
        assert busy_us == pytest.approx(pipeline["rank_busy_s"][rank] * 1e6, rel=1e-6)
    step_us = summary["predicted"]["step_time_s"] * 1e6
    last = max(e["ts"] + e["dur"] for e in complete)
    assert last == pytest.approx(step_us, rel=1e-6)


@pytest.mark.parametrize("flag", ["--report", "--trace"])
def test_unwritable_report_paths_are_one_line_exit_2(capsys, tmp_path, flag):
    for target in (tmp_path / "missing" / "out.file", tmp_path):
        code = main([*PLAN, flag, str(target)])
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and err.startswith("autopar: error: ") and "Traceback" not in err
        assert flag in err and "tracing" not in err  # refused before the trace and search


def test_large_cluster_mesh_stays_compact(written):
    summary, _, _ = written
    cluster = load_cluster("dgx-h100", gpus=1024)
    big = dict(summary, mesh=mesh_summary({"dp": 64, "tp": 2, "pp": 8}, cluster))
    svg = mesh_svg(big)
    assert svg.count("<title>node ") == 128  # one cell per node
    assert svg.count("<title>GPU ") == DETAIL_NODES * 8  # only the first nodes GPU by GPU
    assert len(svg) < 60_000
    assert big["mesh"]["axes"]["dp"]["nodes_per_group"] == 16 and big["mesh"]["axes"]["tp"]["within_node"]


def test_long_schedules_are_drawn_as_paths():
    summary = _uniform_summary("1f1b", 8, 200)
    passes = timeline(summary)
    svg = timeline_svg(summary, passes)
    assert len(passes) == 3200 and "<path" in svg and svg.count("<rect") < 100
    assert len(svg) < 200_000


def test_sharding_folds_repeated_layers():
    placements = {"embed.weight": "RS(0)"}
    for i in range(4):
        placements[f"layers.{i}.fc.weight"] = "RS(1)" if i == 2 else "RS(0)"
        placements[f"layers.{i}.fc.bias"] = "RR"
    placements["head.weight"] = "RS(0)"
    rows = sharding_summary(placements, ["dp", "tp"])
    assert [(r["modules"], r["count"]) for r in rows] == [
        ("embed", 1), ("layers.0–1", 2), ("layers.2", 1), ("layers.3", 1), ("head", 1)]
    assert rows[1]["params"] == {"fc.weight": "RS(0)", "fc.bias": "RR"}


def test_compare_rows_and_terminal_table(written):
    summary, _, _ = written
    predicted = summary["predicted"]
    measured = {"step_time_s": predicted["step_time_s"] * 1.25, "peak_memory_bytes": [2**30, None],
                "compute_s": [predicted["compute_s_per_stage"][0] / 2],
                "communication_s": predicted["breakdown"]["exposed_communication"] / 2}
    rows = compare(summary, measured)
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["step time"]["error_pct"] == pytest.approx(-20.0)
    assert by_metric["compute, pp rank 0"]["error_pct"] == pytest.approx(100.0)
    assert "compute, pp rank 1" not in by_metric
    assert by_metric["exposed communication"]["error_pct"] == pytest.approx(100.0)
    assert "peak memory, pp rank 1" not in by_metric  # nothing measured there
    text = render_comparison(rows)
    assert "-20.0%" in text and "+100.0%" in text and "predicted vs measured" in text
    plan_rows = compare(Plan.model_validate(summary["plan"]), {"step_time_s": predicted["step_time_s"]})
    assert [r["metric"] for r in plan_rows] == ["step time"] and plan_rows[0]["error_pct"] == pytest.approx(0.0)


def test_measured_section_is_appended_once_and_replaced(written, tmp_path):
    summary, _, _ = written
    page = tmp_path / "plan.html"
    page.write_text(render_html(summary))
    append_measured_section(page, compare(summary, {"step_time_s": summary["predicted"]["step_time_s"] * 2}))
    append_measured_section(page, compare(summary, {"step_time_s": summary["predicted"]["step_time_s"] * 4}))
    text = page.read_text()
    parsed = _parse(text)
    assert text.count('id="measured"') == 1 and "-75.0%" in text and "-50.0%" not in text
    assert parsed.errors == [] and "measured-table" in parsed.ids
    with pytest.raises(AutoparError, match="not found"):
        append_measured_section(tmp_path / "none.html", [])


# --- in a real browser -------------------------------------------------------------------------------


def _screenshot_tool():
    spec = importlib.util.spec_from_file_location("report_screenshot", ROOT / "benchmarks" / "report_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def browser():
    """Chromium from the system, installed with apt-get when absent; the tests skip if neither works."""
    tool = _screenshot_tool()
    found = tool.find_chromium()
    if found is None and shutil.which("apt-get"):
        try:
            subprocess.run(["apt-get", "install", "-y", "chromium", "chromium-driver"], capture_output=True,
                           timeout=600, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
        found = tool.find_chromium()
    if found is None:
        pytest.skip("no chromium (and `apt-get install -y chromium chromium-driver` failed): browser checks skipped")
    return SimpleNamespace(path=found, tool=tool)


def test_browser_catches_a_console_error(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p id="x">x</p><script>noSuchFunction();</script></body></html>')
    _, console = browser.tool.headless(browser.path, page, "--dump-dom")
    assert any("noSuchFunction" in line for line in console), console


def test_report_renders_in_chromium_without_console_errors(browser, written, tmp_path):
    _, html_path, _ = written
    dom, console = browser.tool.headless(browser.path, html_path, "--dump-dom")
    assert console == []
    parsed = _parse(dom)
    assert set(SECTION_IDS) <= parsed.ids and {"mesh-svg", "timeline-svg", "memory-svg"} <= parsed.ids
    assert 'data-rendered="1"' in dom  # the inline script ran to its end
    png = tmp_path / "report.png"
    assert browser.tool.screenshot(browser.path, html_path, png, width_px=1200) == []
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    print(f"screenshot: {png}")


def test_written_files_get_the_umask_mode_not_mkstemps_0600(tmp_path):
    from autopar import io

    io.atomic_write_text(tmp_path / "r.html", "<html></html>")
    assert (tmp_path / "r.html").stat().st_mode & 0o777 == 0o666 & ~io._UMASK
