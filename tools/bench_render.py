"""The HTML viewer at scale: first draw and click latency in headless Chromium. Not a test: figures for
docs/render.md.

    python3 tools/bench_render.py                          # 10k and 100k nodes, every shape, and the 70B-like graph
    python3 tools/bench_render.py --nodes 10000 --shape long --repeat 5
    python3 tools/bench_render.py --no-llama               # skip the 70B-like capture (45 s of CPU on meta)
    python3 tools/bench_render.py --svg --nodes 2000       # also the SVG (graphviz) for the cells graph

Shapes (synthetic graphs built directly as ``torch.fx`` graphs whose nodes name their module in
``node.meta["fxdebug"]["module"]`` — what a capture writes — so 100k nodes cost seconds, not minutes):

* ``flat``: N ops, all owned by the root module (a long flat ``nn.Sequential`` of leaf modules);
* ``long``: a long sequential: N / 2 blocks ``0``, ``1``, ... of two ops each, children of the root;
* ``deep``: 100 levels of nesting (``l0.l1.….l99``), N / 100 ops at each level;
* ``residual``: like ``flat``, but every other op also reads the op three places back, so no run is
  a plain chain and every open run is a 100-node dagre layout (the slowest click there is);
* ``cells``: groups of 20 cells of 5 ops (``linear, relu, mul, add, layer_norm``), traced from nn.Modules;
* ``llama70b``: a LLaMA-like model with 80 layers and 70B dimensions (hidden 8192, 64 heads, 8 KV
  heads, MLP 28672), captured on ``meta`` (no memory, no weights) by ``fxdebug.instrument``.

For each graph: the page's size, the time Python takes to write it, the time Chromium takes from
navigation to the first drawn picture (``data-ready``), the boxes drawn, the largest single dagre
layout, and click latencies (median over ``--repeat`` clicks, wall time of the click's handler
measured in the page): expanding the closed box that holds the most nodes, then the biggest box
drawn after that (inside it, as a rule), collapsing the first again, and revealing the last node of
the graph (a search hit: opens its whole path).
"""

from __future__ import annotations

import argparse
import gc
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxdebug  # noqa: E402
from fxdebug.render.html import write_html  # noqa: E402
from fxdebug.render.view import build_view  # noqa: E402


# -- graphs -------------------------------------------------------------------------------------------
def chain_graph(paths: list[str], skip: int = 0) -> fx.GraphModule:
    """A chain of ``len(paths)`` relu ops, op ``i`` owned by module ``paths[i]`` (``""``: the root);
    with ``skip``, every other op is an add that also reads the op ``skip`` places back (residuals)."""
    g = fx.Graph()
    prev = g.placeholder("x")
    prev.meta["fxdebug"] = {"shape": (1, 8), "dtype": "torch.float32"}
    made: list[fx.Node] = []
    for i, path in enumerate(paths):
        if skip and i % 2 and i >= skip:
            node = g.call_function(torch.add, (prev, made[i - skip]))
        else:
            node = g.call_function(torch.relu, (prev,))
        made.append(node)
        node.meta["fxdebug"] = {"module": path, "module_type": "Block" if path else None, "shape": (1, 8),
                                "dtype": "torch.float32"}
        prev = node
    g.output(prev)
    return fx.GraphModule(nn.Module(), g)


def synthetic(shape: str, n: int, levels: int = 100) -> fx.GraphModule:
    if shape == "flat":
        return chain_graph([""] * n)
    if shape == "long":
        return chain_graph([str(i // 2) for i in range(n)])
    if shape == "residual":
        return chain_graph([""] * n, skip=3)
    if shape == "deep":
        per = max(1, n // levels)
        prefixes = [".".join(f"l{j}" for j in range(d + 1)) for d in range(levels)]
        return chain_graph([prefixes[min(i // per, levels - 1)] for i in range(n)])
    raise ValueError(shape)


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)) * 0.5)


def cells(nodes: int, group: int = 20) -> nn.Module:
    count = max(group, nodes // 5)
    return nn.Sequential(*[nn.Sequential(*[Cell() for _ in range(group)]) for _ in range(count // group)])


def llama70b() -> object:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    return fxdebug.instrument(model, [], example_inputs=(ids,))


# -- chromium -----------------------------------------------------------------------------------------
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        return None
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900", "--disable-gpu"):
        opts.add_argument(arg)
    opts.binary_location = chromium
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


CLICK = """
var v = window.fxdebugViewer, what = arguments[0], arg = arguments[1];
var t = performance.now();
var ok = what === "expand" ? v.expand(arg) : what === "collapse" ? v.collapse(arg) : v.reveal(arg);
return [performance.now() - t, ok];
"""


BIGGEST = """
var best = null, most = -1;
document.querySelectorAll('#canvas .cluster.box').forEach(function (e) {
  var m = /(\\d+) nodes/.exec(e.textContent), path = e.getAttribute('data-cluster');
  if (m && +m[1] > most) { most = +m[1]; best = path; }
});
return best;
"""


def measure(driver, path: Path, repeat: int, last: str) -> dict[str, object]:
    uri = path.resolve().as_uri()
    opens = []
    for _ in range(repeat):
        driver.get("about:blank")
        t = time.perf_counter()
        driver.get(uri)  # returns after the load event: the viewer has drawn by then (it draws synchronously)
        opens.append(time.perf_counter() - t)
        assert driver.execute_script("return document.body.getAttribute('data-ready')") == "1", "no picture"
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    drawn = driver.execute_script("return window.fxdebugViewer.drawnNodes().length + window.fxdebugViewer.drawnClusters().length")
    clicks: dict[str, list[float]] = {"expand": [], "inner": [], "collapse": [], "reveal": []}
    target = driver.execute_script(BIGGEST)  # the closed box holding the most nodes
    for _ in range(repeat):
        if target is not None:
            clicks["expand"].append(driver.execute_script(CLICK, "expand", target)[0])
            inner = driver.execute_script(BIGGEST)  # then the biggest box inside (or anywhere) now
            if inner is not None:
                clicks["inner"].append(driver.execute_script(CLICK, "expand", inner)[0])
            clicks["collapse"].append(driver.execute_script(CLICK, "collapse", target)[0])
        clicks["reveal"].append(driver.execute_script(CLICK, "reveal", last)[0])
        driver.execute_script("var v = window.fxdebugViewer; v.openClusters().forEach(function (p) { v.collapse(p); });")
    stats = driver.execute_script("return window.fxdebugViewer.layoutStats()")
    return {"open": opens, "drawn": drawn, "clicks": clicks, "largest": stats["largest"], "errors": errors,
            "target": target}


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    if not values:
        return "n/a"
    m = statistics.median(values) * scale
    return f"{m:.2f} {unit} ({min(values) * scale:.2f}–{max(values) * scale:.2f})" if unit == "s" else \
        f"{m:.0f} ms ({min(values):.0f}–{max(values):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, action="append", help="graph size (repeatable; default 10000 and 100000)")
    ap.add_argument("--shape", action="append", choices=["flat", "long", "deep", "residual", "cells"],
                    help="graph shape (repeatable; default flat, long, deep; and cells at 10k)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true", help="skip the 70B-like graph")
    ap.add_argument("--svg", action="store_true", help="also time the SVG of the cells graph")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = args.nodes or [10_000, 100_000]
    shapes = args.shape or ["flat", "long", "deep"]
    driver = browser()
    out = Path(tempfile.mkdtemp(prefix="fxdebug-render-"))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, chromium headless; "
          f"median of {args.repeat} (min–max)")
    print("| graph | nodes | HTML write | HTML size | first draw in chromium | boxes drawn | largest layout "
          "| expand the biggest box | then the biggest inside | collapse | reveal the last node |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    jobs: list[tuple[str, object]] = [(f"{s} {n:,}", (s, n)) for n in sizes for s in shapes]
    if not args.shape:
        jobs.append(("cells 10,000 (traced nn.Modules)", ("cells", 10_000)))
    if not args.no_llama:
        jobs.append(("LLaMA-like 70B (80 layers, meta)", ("llama", 0)))
    for label, (shape, n) in jobs:
        gc.disable()  # building the graph and its view: not what is measured, and the collector makes it minutes
        if shape == "llama":
            t = time.process_time()
            dbg = llama70b()
            capture = time.process_time() - t
            label += f" (capture {capture:.0f} s CPU)"
            gm = dbg.parts()[""] if hasattr(dbg, "parts") else dbg
            view = build_view(gm, dbg.report() if hasattr(dbg, "report") else None)
        elif shape == "cells":
            gm = fxdebug.trace(cells(n))
            view = build_view(gm)
        else:
            gm = synthetic(shape, n)
            view = build_view(gm)
        gc.enable()
        count = len(view.nodes)
        last = [v.name for v in view.nodes.values() if v.kind not in ("output", "get_attr")][-1]
        path = out / f"{shape}{n}.html"
        t = time.perf_counter()
        write_html(view, path)
        write = time.perf_counter() - t
        size = path.stat().st_size / 1e6
        if driver is None:
            print(f"| {label} | {count:,} | {write:.2f} s | {size:.1f} MB | n/a (no selenium/chromium) | | | | | | |")
            continue
        m = measure(driver, path, args.repeat, last)
        c = m["clicks"]
        err = f" **{len(m['errors'])} JS errors**" if m["errors"] else ""
        print(f"| {label} | {count:,} | {write:.2f} s | {size:.1f} MB | {spread(m['open'])}{err} | {m['drawn']} "
              f"| {m['largest']} | {spread(c['expand'], 'ms')} | {spread(c['inner'], 'ms')} | {spread(c['collapse'], 'ms')} "
              f"| {spread(c['reveal'], 'ms')} |", flush=True)
    if args.svg:
        for n in sizes:
            gm = fxdebug.trace(cells(n))
            t = time.perf_counter()
            fxdebug.render(gm, out / f"cells{n}.svg")
            print(f"SVG, cells {n:,}: {time.perf_counter() - t:.2f} s")
    if driver is not None:
        driver.quit()


if __name__ == "__main__":
    main()
