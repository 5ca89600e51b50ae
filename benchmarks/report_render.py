"""Render kvtier's HTML reports in a real browser (headless Chromium) and check what a reader sees.

For each result given (a bench result JSON, a replay folder, a sweep folder; with none, a 10 s bench is run here
first), ``kvtier report RESULT --html`` writes the page, Chromium renders it at ``--width`` pixels and screenshots the
whole page (``--outdir``/NAME.png: look at them), and the page is checked as the browser laid it out: every plot image
loaded and drawn at least ``--min-plot-px`` wide (a plot squeezed into a narrow column cannot be read), and no raw
mathtext (``$``, ``mathdefault``) in the page's text. Chromium comes from ``scripts/install-tools.sh chromium``.

Last line: ``report_render pages=<n> plots=<images drawn> narrowest_plot_px=<min drawn width> broken=<images not
loaded> mathtext=<pages with raw mathtext> ok=true|false``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_tool

PROBE = """
<script>
window.addEventListener('load', () => {
  const imgs = [...document.images].map(i => ({w: i.getBoundingClientRect().width,
                                                ok: i.complete && i.naturalWidth > 0}));
  const out = document.createElement('pre');
  out.id = 'kvtier-probe';
  out.textContent = 'KVTIER-PROBE ' + JSON.stringify({imgs, text: document.body.innerText.length,
    mathtext: /mathdefault|\\$\\\\/.test(document.body.innerText)});
  document.body.appendChild(out);
});
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    return ensure_tool("chromium")


def render(browser: str, html: Path, png: Path, width: int) -> dict:
    """Screenshot the page, then dump the DOM after load with the probe's measurements."""
    probed = html.with_suffix(".probe.html")
    probed.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={width},1000"]
    dom = subprocess.run([*base, "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout  # fmt: skip
    m = re.search(r"KVTIER-PROBE (\{.*?\})\s*</pre>", dom, re.S)
    if m is None:
        raise SystemExit(f"{html}: the page did not load in {browser} (no probe in its DOM)")
    probe = json.loads(m.group(1).replace("&quot;", '"'))
    # the whole page: as tall as its text needs (Chromium's screenshot is the window)
    height = max(1000, min(40000, probe["text"] // 2 + 400 * len(probe["imgs"])))
    subprocess.run([*base[:-1], f"--window-size={width},{height}", f"--screenshot={png}", html.as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    return probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", help="results to render (default: a 10 s bench run here)")
    ap.add_argument("--outdir", default="report-render", help="where the HTML and the screenshots go")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--min-plot-px", type=int, default=900)
    a = ap.parse_args()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    browser = chromium()
    kvtier = [sys.executable, "-m", "kvtier"]
    results = [Path(r) for r in a.results]
    if not results:
        r = out / "bench.json"
        with tempfile.TemporaryDirectory(prefix="kvtier-render-", dir="/var/tmp") as d:
            subprocess.run([*kvtier, "bench", "--model", "llama3.1-8b", "--num-users", "4", "--duration", "10",
                            "--gpu-mem-gb", "0", "--cpu-mem-gb", "1", "--cache-dir", d, "--progress", "none",
                            "--output", str(r)], check=True, cwd=REPO, capture_output=True)  # fmt: skip
        results = [r]
    plots, broken, narrow, math = 0, 0, [], 0
    for res in results:
        name = res.stem if res.is_file() else res.name
        html = out / f"{name}.html"
        subprocess.run([*kvtier, "report", str(res), "--html", str(html)], check=True, capture_output=True)
        probe = render(browser, html, out / f"{name}.png", a.width)
        drawn = [i for i in probe["imgs"] if i["ok"]]
        plots += len(drawn)
        broken += len(probe["imgs"]) - len(drawn)
        narrow += [i["w"] for i in drawn]
        math += bool(probe["mathtext"])
        widths = sorted(round(i["w"]) for i in drawn)
        print(f"{name}: {len(drawn)} plots drawn, widths {widths[:3]}..{widths[-1:]} px; "
              f"screenshot {out / (name + '.png')}", flush=True)  # fmt: skip
    low = min(narrow) if narrow else 0
    ok = broken == 0 and math == 0 and plots > 0 and low >= a.min_plot_px
    print(f"report_render pages={len(results)} plots={plots} narrowest_plot_px={low:.0f} broken={broken} "
          f"mathtext={math} ok={'true' if ok else 'false'}")  # fmt: skip


if __name__ == "__main__":
    main()
