"""Render times for large graphs: the SVG (graphviz) and the HTML viewer (writing it, and opening it in
chromium until the first picture is drawn). Not a test: figures for docs/performance.md.

    python3 tools/bench_render.py            # 2,000 and 10,000 nodes
    python3 tools/bench_render.py --nodes 2000 --repeat 3

The graph is ``SyntheticGraph``-like: cells of 5 ops (linear, relu, mul, add, layer norm) in groups
of 20 cells, so collapsing has modules to work with. Each figure is the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import fxdebug


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)) * 0.5)


def synthetic(nodes: int, group: int = 20) -> nn.Module:
    cells = max(group, nodes // 5)
    return nn.Sequential(*[nn.Sequential(*[Cell() for _ in range(group)]) for _ in range(cells // group)])


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        return None
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        opts.add_argument(arg)
    opts.binary_location = chromium
    return webdriver.Chrome(service=Service(driver), options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, action="append", help="graph size (repeatable; default 2000 and 10000)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sizes = args.nodes or [2000, 10000]
    browser = _browser()
    out = Path(tempfile.mkdtemp(prefix="fxdebug-render-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeat}")
    print("| graph nodes | SVG (default: folded, auto depth) | boxes drawn | SVG, every node drawn (once) | HTML write "
          "| HTML size | open in chromium (to first draw) | boxes drawn at open | layout after expanding one module |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        gm = fxdebug.trace(synthetic(n))
        count = len(gm.graph.nodes)
        svg = _median(lambda: fxdebug.render(gm, out / f"g{n}.svg"), args.repeat)
        boxes = (out / f"g{n}.dot").read_text().count("id=\"node/") + (out / f"g{n}.dot").read_text().count("id=\"module/")
        full = _median(lambda: fxdebug.render(gm, out / f"full{n}.svg", depth=10**6, fold=False), 1)
        html = _median(lambda: fxdebug.render(gm, out / f"g{n}.html"), args.repeat)
        size = (out / f"g{n}.html").stat().st_size / 1e6
        if browser is not None:
            uri = (out / f"g{n}.html").resolve().as_uri()

            def open_page() -> None:
                browser.get("about:blank")
                browser.get(uri)  # returns after the load event: the viewer has drawn by then
                assert browser.execute_script("return document.body.getAttribute('data-ready')") == "1"

            opened = f"{_median(open_page, args.repeat):.2f} s"
            drawn = str(browser.execute_script("return window.fxdebugViewer.drawnNodes().length + "
                                               "window.fxdebugViewer.drawnClusters().length"))
            expand = browser.execute_script("var v = window.fxdebugViewer; v.expand(v.drawnClusters()[0]); "
                                            "return v.lastLayoutMs();")
            expanded = f"{expand:.0f} ms"
        else:
            opened, drawn, expanded = "n/a (no selenium/chromium)", "n/a", "n/a"
        print(f"| {count:,} | {svg:.2f} s | {boxes} | {full:.1f} s | {html:.2f} s | {size:.1f} MB | {opened} | {drawn} "
              f"| {expanded} |")
    if browser is not None:
        browser.quit()


if __name__ == "__main__":
    main()
