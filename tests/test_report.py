"""The plan report: the typed model and its JSON round trip, the terminal text (one line per pipeline
rank, plural wording, what MFU is relative to, why-not rows), the HTML page (self-contained, parses,
loads in headless Chromium without console errors), the Chrome/Perfetto trace, the schedule
timeline against the cost model, and the predicted-against-measured comparison."""

import contextlib
import importlib.util
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.plan_schema import Strategy
from autopar.report import Report, compare, load_report, render_comparison, render_html, render_text
from autopar.report.build import build_report, mesh_info, sharding_rows
from autopar.report.html_page import SECTION_IDS, append_measured_section
from autopar.report.model import Breakdown, EvaluationReport, MemoryParts, Predicted, StageRow
from autopar.report.svg import DETAIL_NODES, mesh_svg, timeline_svg
from autopar.report.timeline import makespan_s, timeline
from autopar.report.views import RankRow, plural, rank_rows, recompute_text
from autopar.cost_models.pipeline import estimate, rank_order

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model", "gpt", "--model-config", "layers=4,hidden=64,heads=4,vocab=100,seq_len=32", "--seq-len", "32"]
# Two nodes of 8: tp inside a node, pp across the two nodes; interleaved so chunks and p2p show.
PLAN = ["plan", *MODEL, "--global-batch", "16", "--cluster", "dgx-h100", "--gpus", "16",
        "--strategy", "tp=2,pp=2,dp=4,microbatch=1,schedule=interleaved,vp=2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One real `autopar plan --report --trace --json` run: (report loaded from the JSON, html path,
    trace path, what the terminal showed)."""
    folder = tmp_path_factory.mktemp("report")
    paths = {name: folder / name for name in ("plan.html", "plan.trace.json", "plan.json")}
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        code = main([*PLAN, "--report", str(paths["plan.html"]), "--trace", str(paths["plan.trace.json"]),
                     "--json", str(paths["plan.json"])])
    assert code == 0
    return load_report(paths["plan.json"]), paths["plan.html"], paths["plan.trace.json"], shown.getvalue()


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
    _, html_path, _, _ = written
    text = html_path.read_text()
    parsed = _parse(text)
    assert parsed.errors == [] and parsed.stack == []
    assert parsed.external == []
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert set(SECTION_IDS) <= parsed.ids
    assert {"mesh-svg", "mesh-groups", "stage-table", "timeline-svg", "memory-svg", "memory-table", "breakdown-svg",
            "breakdown-table", "alternatives-table", "sharding-table", "mfu-note"} <= parsed.ids
    assert "nvlink4" in text and "ib-ndr" in text  # tp inside a node, pp across the two nodes


def test_saved_json_loads_back_and_renders_the_same(written, tmp_path):
    report, html_path, trace_path, shown = written
    assert isinstance(report, Report) and report.report_version == 1
    assert render_text(report) == shown.rstrip("\n")  # what the terminal showed, from the saved file alone
    assert render_html(report) == html_path.read_text()
    again = Report.from_json(json.dumps(report.model_dump(mode="json")))
    assert again == report
    broken = tmp_path / "broken.json"
    for text, words in (('{"model": "gpt"}', "not an autopar plan report"), ("{nope", "not an autopar plan report")):
        broken.write_text(text)
        with pytest.raises(AutoparError, match=words) as error:
            load_report(broken)
        assert "\n" not in str(error.value) and "autopar plan --json" in str(error.value)
    with pytest.raises(AutoparError, match="not found"):
        load_report(tmp_path / "missing.json")


def test_mesh_groups_match_the_runtime_layout(written):
    report, _, _, _ = written
    mesh = report.mesh
    assert mesh.axes["tp"].within_node and mesh.axes["tp"].link == "nvlink4"
    assert not mesh.axes["pp"].within_node and mesh.axes["pp"].link == "ib-ndr"
    for stage in report.plan.stages:  # the plan's devices of a stage are exactly its pp rank's GPUs
        assert {mesh.coordinates(r)["pp"] for r in stage.device_ids} == {stage.index % 2}
    for axis in ("tp", "dp", "pp"):  # each axis's groups partition the world, and contain their members
        groups = {tuple(mesh.group_ranks(axis, r)) for r in range(16)}
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert all(r in mesh.group_ranks(axis, r) for r in range(16))


def test_timeline_makespan_equals_the_cost_models_pipeline_time(written):
    report, _, _, _ = written
    passes = timeline(report)
    pipeline = report.pipeline
    assert pipeline.p2p_s > 0
    assert report.strategy.num_microbatches == 4  # 16 sequences over dp 4, micro-batch 1
    assert len(passes) == 2 * 4 * 2 * 2  # F and B × 4 micro-batches × pp 2 × vp 2
    assert makespan_s(passes) == pytest.approx(pipeline.makespan_s, rel=1e-9)
    c = pipeline.critical_rank
    step = pipeline.rank_end_s[c] + pipeline.exposed_sync_s[c] + pipeline.optimizer_s[c]
    assert step == pytest.approx(report.predicted.step_time_s, rel=1e-9)


def _uniform(schedule, pp, m, vp=1, forward_s=1.0, backward_s=2.0) -> EvaluationReport:
    """A report of uniform stages (one layer each), no memory or breakdown to speak of."""
    stages = [StageRow(index=i, rank=i % pp, units=[f"layers.{i}"], forward_s=forward_s, backward_s=backward_s,
                       layers=1) for i in range(pp * vp)]
    zero = MemoryParts(parameters=0, gradients=0, optimizer_states=0, activations=0, buffers=0, margin=0)
    predicted = Predicted(step_time_s=1.0, tokens_per_s=1.0, tflops_per_gpu=1.0, mfu=0.1, peak_memory_bytes=0,
                          peak_memory_bytes_per_stage=[0] * pp, memory_breakdown_bytes=[zero] * pp,
                          breakdown=Breakdown(compute=1, recompute=0, exposed_communication=0, bubble=0, optimizer=0))
    strategy = Strategy(dp=1, tp=1, pp=pp, vp=vp, schedule=schedule, microbatch=1, num_microbatches=m)
    return EvaluationReport(strategy=strategy, fits=True, predicted=predicted, stages=stages)


@pytest.mark.parametrize("schedule, vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_timeline_follows_the_schedule_and_the_closed_form(schedule, vp):
    pp, m = 4, 8
    passes = timeline(_uniform(schedule, pp, m, vp))
    # Without transfers and with uniform stages the cost model's closed form is exact.
    closed = estimate([1.0] * pp * vp, [2.0] * pp * vp, m, schedule, pp=pp, vp=vp).step_time_s
    assert makespan_s(passes) == pytest.approx(closed, rel=1e-12)
    for rank in range(pp):
        mine = [x for x in passes if x.rank == rank]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))  # one pass at a time
        expected = [(kind, chunk * pp + rank, mb) for kind, chunk, mb in rank_order(schedule, rank, pp, m, vp)]
        assert [(x.kind, x.stage, x.microbatch) for x in mine] == expected
    # GPipe runs every forward first; 1F1B's first rank pp forwards (pp − 1 warm-up, then one F before each B).
    first_backward = [x.kind for x in passes if x.rank == 0].index("B")
    assert first_backward == {"gpipe": m, "1f1b": pp}.get(schedule, first_backward)


def test_trace_is_valid_and_each_track_is_sequential(written):
    report, _, trace_path, _ = written
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
    for rank in (0, 1):
        busy = [e["dur"] for e in complete if e["pid"] == rank and e["cat"] in ("forward", "backward")]
        # each duration is rounded to 1 ns: the sum may drift by half a nanosecond per event
        assert sum(busy) == pytest.approx(report.pipeline.rank_busy_s[rank] * 1e6, rel=1e-6, abs=5e-4 * len(busy))
    last = max(e["ts"] + e["dur"] for e in complete)
    assert last == pytest.approx(report.predicted.step_time_s * 1e6, rel=1e-6)


@pytest.mark.parametrize("flag", ["--report", "--trace"])
def test_unwritable_report_paths_are_one_line_exit_2(capsys, tmp_path, flag):
    for target in (tmp_path / "missing" / "out.file", tmp_path):
        code = main([*PLAN, flag, str(target)])
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and err.startswith("autopar: error: ") and "Traceback" not in err
        assert flag in err and "tracing" not in err  # refused before the trace and search


def test_large_cluster_mesh_stays_compact(written):
    report, _, _, _ = written
    cluster = load_cluster("dgx-h100", gpus=1024)
    big = report.model_copy(update={"mesh": mesh_info(
        Strategy(dp=64, tp=2, pp=8, microbatch=1, num_microbatches=8), cluster)})
    svg = mesh_svg(big)
    assert svg.count("<title>node ") == 128  # one cell per node
    assert svg.count("<title>GPU ") == DETAIL_NODES * 8  # only the first nodes GPU by GPU
    assert len(svg) < 60_000
    assert big.mesh.axes["dp"].nodes_per_group == 16 and big.mesh.axes["tp"].within_node


def test_long_schedules_are_drawn_as_paths():
    report = _uniform("1f1b", 8, 200)
    passes = timeline(report)
    svg = timeline_svg(report, passes)
    assert len(passes) == 3200 and "<path" in svg and svg.count("<rect") < 100
    assert len(svg) < 200_000


def test_sharding_folds_repeated_layers():
    placements = {"embed.weight": "RS(0)"}
    for i in range(4):
        placements[f"layers.{i}.fc.weight"] = "RS(1)" if i == 2 else "RS(0)"
        placements[f"layers.{i}.fc.bias"] = "RR"
    placements["head.weight"] = "RS(0)"
    rows = sharding_rows(placements, ["dp", "tp"])
    assert [(r.modules, r.count) for r in rows] == [
        ("embed", 1), ("layers.0–1", 2), ("layers.2", 1), ("layers.3", 1), ("head", 1)]
    assert rows[1].params == {"fc.weight": "RS(0)", "fc.bias": "RR"}


def test_compare_rows_and_terminal_table(written):
    report, _, _, _ = written
    predicted = report.predicted
    measured = {"step_time_s": predicted.step_time_s * 1.25, "peak_memory_bytes": [2**30, None],
                "compute_s": [predicted.compute_s_per_stage[0] / 2],
                "communication_s": predicted.breakdown.exposed_communication / 2}
    rows = compare(report, measured)
    by_metric = {r.metric: r for r in rows}
    assert by_metric["step time"].error_pct == pytest.approx(-20.0)
    assert by_metric["compute, pp rank 0"].error_pct == pytest.approx(100.0)
    assert "compute, pp rank 1" not in by_metric
    assert by_metric["exposed communication"].error_pct == pytest.approx(100.0)
    assert "peak memory, pp rank 1" not in by_metric  # nothing measured there
    text = render_comparison(rows)
    assert "-20.0%" in text and "+100.0%" in text and "predicted vs measured" in text
    plan_rows = compare(report.plan, {"step_time_s": predicted.step_time_s})
    assert [r.metric for r in plan_rows] == ["step time"] and plan_rows[0].error_pct == pytest.approx(0.0)


def test_measured_section_is_appended_once_and_replaced(written, tmp_path):
    report, _, _, _ = written
    page = tmp_path / "plan.html"
    page.write_text(render_html(report))
    append_measured_section(page, compare(report, {"step_time_s": report.predicted.step_time_s * 2}))
    append_measured_section(page, compare(report, {"step_time_s": report.predicted.step_time_s * 4}))
    text = page.read_text()
    parsed = _parse(text)
    assert text.count('id="measured"') == 1 and "-75.0%" in text and "-50.0%" not in text
    assert parsed.errors == [] and "measured-table" in parsed.ids
    with pytest.raises(AutoparError, match="not found"):
        append_measured_section(tmp_path / "none.html", [])


# --- the terminal report: per pipeline rank, wording, MFU, why not ----------------------------------


INTERLEAVED = {"dp": 4, "tp": 2, "pp": 2, "microbatch": 1, "schedule": "interleaved", "vp": 4, "zero": 1,
               "sp": False, "recompute": "full", "recompute_layers": (1, 1, 1, 1, 1, 0, 0, 0)}


@pytest.fixture(scope="module")
def interleaved(gpt_512):
    """An interleaved plan of 8 virtual stages on 2 pipeline ranks, recompute counts given per stage."""
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.search import search

    graph, facts = gpt_512
    cluster = load_cluster("dgx-h100", gpus=16)
    result = search(graph, facts, cluster, 16, fixed=INTERLEAVED, use_ilp=False)
    plan = build_plan(result.best, graph, facts, cluster)
    return build_report(result, model="gpt", cluster=cluster, global_batch=16, seq_len=facts.seq_len,
                        fixed=INTERLEAVED, precision=facts.precision, plan=plan)


def test_interleaved_plan_prints_one_line_per_pipeline_rank(interleaved):
    report = interleaved
    assert len(report.stages) == 8
    text = render_text(report)
    table = text[text.index("pipeline ranks:"):text.index("memory per GPU")].strip().splitlines()
    assert table[1].split() == ["rank", "stages", "modules", "fwd", "ms", "bwd", "ms", "recompute"]
    rows = table[2:]
    assert len(rows) == 2  # not 8 stage lines
    # rank 0 runs stages 0 2 4 6 (layers 0, 2, 4, 6 plus the embedding); its recompute counts 1/1/1/0
    assert re.match(r"\s*0\s+0 2 4 6\s+pre, layers\.\{0,2,4,6\}\s", rows[0]), rows[0]
    assert rows[0].endswith("3 of 4 layers (1/1/1/0)") and rows[1].endswith("2 of 4 layers (1/1/0/0)")
    assert re.match(r"\s*1\s+1 3 5 7\s+layers\.\{1,3,5,7\}, post\s", rows[1]), rows[1]
    ranks = rank_rows(report)
    for row, line in zip(ranks, rows):  # fwd/bwd: one micro-batch summed over the rank's stages
        fwd, bwd = (float(x) for x in re.findall(r"\s(\d+\.\d\d)\s", line + " ")[:2])
        assert fwd == pytest.approx(sum(st.forward_s for st in report.stages if st.rank == row.rank) * 1e3, abs=0.006)
        assert bwd == pytest.approx(sum(st.backward_s for st in report.stages if st.rank == row.rank) * 1e3, abs=0.006)
    assert "recompute     full, 5 of 8 layers" in text
    assert "recompute_layers=1/1/1/1/1/0/0/0" in text  # 8 counts: short enough for the --strategy line
    assert "stage 7" not in text and not re.search(r"\b1 layers\b", text)
    html = render_html(report)
    stage_table = html[html.index('id="stage-table"'):]
    stage_table = stage_table[:stage_table.index("</table>")]
    assert stage_table.count("<tr>") == 1 + 2 and "3 of 4 layers (1/1/1/0)" in stage_table


def test_plural_wording():
    assert [plural(n, "layer") for n in (0, 1, 2)] == ["0 layers", "1 layer", "2 layers"]
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    strategy = Strategy(dp=1, tp=1, pp=1, microbatch=1, num_microbatches=1, recompute="full")

    def row(*stages):
        return RankRow(0, [StageRow(index=i, rank=0, units=[], forward_s=0, backward_s=0, recomputed_layers=k,
                                    layers=n) for i, (k, n) in enumerate(stages)])

    assert recompute_text(row((1, 1)), strategy) == "1 of 1 layer"
    assert recompute_text(row((1, 2)), strategy) == "1 of 2 layers"
    assert recompute_text(row((1, None)), strategy) == "1 layer"
    assert recompute_text(row((0, 2)), strategy) == "none"
    assert recompute_text(row((1, 1), (0, 1)), strategy) == "1 of 2 layers (1/0)"
    assert recompute_text(row((0, 2)), strategy.model_copy(update={"recompute": "none"})) == "—"


def test_mfu_says_what_it_is_relative_to(interleaved, tiny_gpt_fp32):
    text = render_text(interleaved)
    assert "MFU = model FLOP/s per GPU, recompute not counted, over the H100-SXM5-80GB's dense bf16 peak of " \
           "989 TFLOP/s (NVIDIA H100 datasheet)" in text
    assert "MFU (nominal)" not in text
    assert "over the H100-SXM5-80GB&#x27;s dense bf16 peak" in render_html(interleaved)
    from autopar.searcher.search import search

    graph, facts = tiny_gpt_fp32
    cpu = load_cluster("local")
    local = build_report(search(graph, facts, cpu, 2, use_ilp=False), model="gpt", cluster=cpu, global_batch=2,
                         seq_len=facts.seq_len, fixed={}, precision=facts.precision)
    text = render_text(local)
    assert local.mfu_basis.nominal and "MFU (nominal)" in text
    assert "over a placeholder fp32 peak of 1 TFLOP/s for cpu, a device known only nominally" in text
    assert "MFU (nominal)" in render_html(local)


# --- in a real browser -------------------------------------------------------------------------------


def _screenshot_tool():
    spec = importlib.util.spec_from_file_location("report_screenshot", ROOT / "benchmarks" / "report_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def browser():
    """Chromium from the system (the README's test set-up names it; .ci/run installs it)."""
    tool = _screenshot_tool()
    found = tool.find_chromium()
    if found is None:
        pytest.skip("no chromium on PATH: the report's browser checks need it (Debian: apt-get install chromium)")
    return SimpleNamespace(path=found, tool=tool)


def test_browser_catches_a_console_error(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p id="x">x</p><script>noSuchFunction();</script></body></html>')
    _, console = browser.tool.headless(browser.path, page, "--dump-dom")
    assert any("noSuchFunction" in line for line in console), console


def test_report_renders_in_chromium_without_console_errors(browser, written, tmp_path):
    _, html_path, _, _ = written
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
    import os

    from autopar import io

    previous = os.umask(0o022)
    try:
        io.atomic_write_text(tmp_path / "r.html", "<html></html>")
    finally:
        os.umask(previous)
    assert (tmp_path / "r.html").stat().st_mode & 0o777 == 0o644


def test_kept_sequence_shards_are_shown_and_reproduced():
    """A plan keeping sequence shards says so: its `--strategy` line fixes `sp_inputs=regathered` (parsed
    back to the same keys) and its one-line label carries it; a plan keeping gathered inputs shows
    neither, as before."""
    from autopar.cost_models.strategy import parse_strategy
    from autopar.report.views import strategy_flag, strategy_label

    kept = Strategy(dp=2, tp=4, pp=1, sp=True, microbatch=2, num_microbatches=1, sp_inputs="regathered")
    flag, _ = strategy_flag(kept, {})
    assert parse_strategy(flag)["sp_inputs"] == "regathered"
    assert "sp_inputs=regathered" in strategy_label(kept)
    gathered = kept.model_copy(update={"sp_inputs": "gathered"})
    assert "sp_inputs" not in strategy_flag(gathered, {})[0] and "sp_inputs" not in strategy_label(gathered)


def test_a_compiled_plan_is_shown_and_reproduced_compiled():
    """A plan priced compiled says so: its `--strategy` line fixes `compile=true` (re-planned from it, the
    plan is priced compiled again) and its one-line label carries it; an eager one shows neither."""
    from autopar.cost_models.strategy import parse_strategy
    from autopar.report.views import strategy_flag, strategy_label

    compiled = Strategy(dp=1, tp=1, pp=1, microbatch=8, num_microbatches=1, compile=True)
    assert parse_strategy(strategy_flag(compiled, {})[0])["compile"] is True
    assert strategy_label(compiled).endswith(" compile=true")
    eager = compiled.model_copy(update={"compile": False})
    assert "compile" not in strategy_flag(eager, {})[0] and "compile" not in strategy_label(eager)
