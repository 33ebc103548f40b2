"""What `autopar plan` reports, as one typed model and its renderers.

    report = build_report(search_result, ...)       # autopar.report.build: the model (autopar.report.model)
    render_text(report)                              # the terminal (autopar.report.text)
    render_html(report)                              # one self-contained page (html_page, svg, timeline)
    render_trace(report)                             # the predicted step for Perfetto (perfetto)
    report.model_dump(mode="json")                   # `--json`; load_report(path) reads it back
    compare(plan_or_report, measured)                # predicted against measured (compare)
"""

from autopar.report.build import build_report
from autopar.report.compare import ComparisonRow, Measured, compare, render_comparison
from autopar.report.html_page import append_measured_section, render_html
from autopar.report.model import Report, load_report
from autopar.report.perfetto import render_trace, trace_events
from autopar.report.text import render_text

__all__ = ["ComparisonRow", "Measured", "Report", "append_measured_section", "build_report", "compare",
           "load_report", "render_comparison", "render_html", "render_text", "render_trace", "trace_events"]
