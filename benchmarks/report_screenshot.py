"""Regenerate docs/plan-gpt3-175b-1024.png: the HTML plan report of GPT-3 175B on 1,024 H100s,
rendered by headless Chromium.

    python benchmarks/report_screenshot.py            # plans (1-2 minutes on 2 CPU cores), then screenshots
    python benchmarks/report_screenshot.py --html r.html --out /tmp/r.png   # screenshot a written report

Also the browser helpers tests/test_report.py uses: Chromium's own command line (--dump-dom,
--screenshot, console messages on stderr), no driver.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN_ARGS = ["--model", "gpt3-175b", "--cluster", "dgx-h100", "--gpus", "1024", "--global-batch", "1536",
             "--seq-len", "2048"]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--force-device-scale-factor=1"]
CONSOLE = re.compile(r":CONSOLE[:(]")  # Chromium logs page console messages as INFO:CONSOLE(line) / CONSOLE:line


def find_chromium() -> str | None:
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "chromium", "google-chrome"):
        found = shutil.which(name) or (name if Path(name).is_file() else None)
        if found:
            return found
    return None


def headless(browser: str, page: Path, *extra: str, timeout_s: float = 30) -> tuple[str, list[str]]:
    """Run Chromium on a local page with a fresh profile: (stdout, console messages)."""
    with tempfile.TemporaryDirectory(prefix="autopar-chromium-") as profile:
        result = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                                 *extra, page.resolve().as_uri()], capture_output=True, text=True, timeout=timeout_s)
    console = [line for line in result.stderr.splitlines() if CONSOLE.search(line)]
    return result.stdout, console


def page_height_px(browser: str, page: Path, width_px: int) -> int:
    """The report records its own scroll height (data-height-px on <body>) once rendered."""
    dom, _ = headless(browser, page, f"--window-size={width_px},1000", "--dump-dom")
    match = re.search(r'data-height-px="(\d+)"', dom)
    return int(match.group(1)) if match else 3000


def screenshot(browser: str, page: Path, png: Path, width_px: int = 1400) -> list[str]:
    """A full-page PNG; returns the console messages (a clean report has none)."""
    height = page_height_px(browser, page, width_px)
    _, console = headless(browser, page, f"--window-size={width_px},{height}", f"--screenshot={png.resolve()}")
    return console


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "plan-gpt3-175b-1024.png"))
    parser.add_argument("--html", help="screenshot this report instead of planning one")
    parser.add_argument("--width", type=int, default=1400)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {platform.system()} {platform.release()}, "
          f"python {platform.python_version()}")
    browser = find_chromium()
    if browser is None:
        print("chromium not found: apt-get install -y chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="autopar-report-") as work:
        page = Path(args.html) if args.html else Path(work) / "plan.html"
        if not args.html:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "autopar", "plan", *PLAN_ARGS, "--report", str(page)],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            print(f"plan + report: {time.perf_counter() - started:.1f} s, {page.stat().st_size / 1024:.0f} KiB")
        started = time.perf_counter()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        console = screenshot(browser, page, out, args.width)
        print(f"screenshot: {time.perf_counter() - started:.1f} s, {out} ({out.stat().st_size / 1024:.0f} KiB)")
    for line in console:
        print(f"console: {line}", file=sys.stderr)
    return 1 if console else 0


if __name__ == "__main__":
    sys.exit(main())
