"""The HTML viewer at scale, in headless chromium: long sequentials, deep nesting, repeated blocks, fans.

The graphs are synthetic ``torch.fx`` graphs whose nodes name their module in
``node.meta["fxdebug"]["module"]`` (what a capture writes), built in milliseconds: no model runs.
Figures (first draw, click latency at 10k / 100k nodes and on a 70B-like graph) are in
docs/render.md, from tools/bench_render.py; these tests check behaviour only.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

from fxdebug.render.html import html_data, write_html
from fxdebug.render.view import build_view

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="chromium and chromedriver are not installed (tools/setup.sh installs them)")


@pytest.fixture(scope="module")
def browser() -> Any:
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900",
                "--disable-gpu"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def graph(ops: list[tuple[str, list[int]]], types: dict[str, str] | None = None) -> fx.GraphModule:
    """Op ``i`` is ``(module path, inputs as op indices; -1 is the graph input)``; the last op is returned."""
    collecting = gc.isenabled()
    gc.disable()  # 10k fx nodes build in 0.2 s; with the collector scanning the heap as it grows, several seconds
    try:
        return _graph(ops, types)
    finally:
        if collecting:
            gc.enable()


def _graph(ops: list[tuple[str, list[int]]], types: dict[str, str] | None) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["fxdebug"] = {"shape": (1, 8), "dtype": "torch.float32"}
    made: list[fx.Node] = []
    for path, inputs in ops:
        args = [x if i < 0 else made[i] for i in inputs] or [x]
        node = g.call_function(torch.add, (args[0], args[-1])) if len(args) > 1 else g.call_function(torch.relu, (args[0],))
        node.meta["fxdebug"] = {"module": path, "module_type": (types or {}).get(path, "Block" if path else None),
                                "shape": (1, 8), "dtype": "torch.float32"}
        made.append(node)
    g.output(made[-1])
    return fx.GraphModule(nn.Module(), g)


def chain(paths: list[str]) -> fx.GraphModule:
    return graph([(p, [i - 1]) for i, p in enumerate(paths)])


def open_page(browser: Any, path: str | Path) -> Any:
    browser.get(Path(path).resolve().as_uri())
    assert browser.execute_script("return document.body.getAttribute('data-ready')") == "1"
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR", "WARNING")]
    assert errors == [], errors
    return browser


def js(browser: Any, expr: str) -> Any:
    return browser.execute_script(f"return {expr};")


def drawn(browser: Any) -> set[str]:
    return set(js(browser, "window.fxdebugViewer.drawnNodes()"))


def click(browser: Any, cluster: str) -> None:
    """A user's click on the closed box of ``cluster`` (dispatched: the box may be scrolled off screen)."""
    browser.execute_script("document.querySelector('.cluster.box[data-cluster=\"' + arguments[0] + '\"]')"
                           ".dispatchEvent(new MouseEvent('click', {bubbles: true}))", cluster)


def boxes(browser: Any) -> list[str]:
    return js(browser, "window.fxdebugViewer.drawnClusters()")


def test_long_sequential_of_ten_thousand_children(browser: Any, tmp_path: Path) -> None:
    # 6,667 blocks of one and two ops in turn (no two neighbours alike, so nothing folds), children of
    # the root: dagre's recursive ranking overflowed the stack (a blank page) past ~2,000 children
    # when they were laid out in one graph.
    paths = [str(k) for k in range(6667) for _ in range(1 + k % 2)][:10_000]
    gm = chain(paths)
    open_page(browser, write_html(build_view(gm), tmp_path / "long.html"))
    assert int(browser.find_element(By.ID, "node-count").text) == 10_002
    first = boxes(browser)
    assert first and len(first) + len(drawn(browser)) <= 100  # a few run boxes, not 5,000 blocks
    assert js(browser, "window.fxdebugViewer.layoutStats().largest") <= 100  # no layout sees more than a run
    run = next(b for b in first if "(items 1–" in b)
    click(browser, run)  # a click opens a run
    inner = [b for b in boxes(browser) if b not in first]
    assert inner, "the run's children are drawn after the click"
    assert js(browser, "window.fxdebugViewer.layoutStats().largest") <= 100
    assert js(browser, "window.fxdebugViewer.reveal('relu_9999')")  # the last op, through runs of runs
    assert "relu_9999" in drawn(browser)
    assert js(browser, "window.fxdebugViewer.clusterOf('relu_9999')") == paths[-1]
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_long_flat_graph_chunks_its_own_nodes_in_runs_of_runs(browser: Any, tmp_path: Path) -> None:
    gm = chain([""] * 10_000)  # all owned by the root
    open_page(browser, write_html(build_view(gm), tmp_path / "flat.html"))
    top = boxes(browser)
    assert "(nodes 1–10000)" in top  # runs of 100 runs
    js(browser, "window.fxdebugViewer.expand('(nodes 1–10000)')")
    assert "(nodes 101–200)" in boxes(browser)
    click(browser, '(nodes 101–200)')
    shown = drawn(browser)  # items 101–200 of the root: the input is item 1, relu item 2, relu_k item k + 2
    assert {"relu_99", "relu_198"} <= shown and not {"relu_98", "relu_199"} & shown


def test_deep_nesting_opens_bounded_and_reveals(browser: Any, tmp_path: Path) -> None:
    levels = 100
    prefixes = [".".join(f"l{j}" for j in range(d + 1)) for d in range(levels)]
    gm = chain([prefixes[i // 3] for i in range(3 * levels)])  # three ops at every level of 100
    open_page(browser, write_html(build_view(gm), tmp_path / "deep.html"))
    opened = js(browser, "window.fxdebugViewer.openClusters()")
    assert 1 <= len(opened) <= 8  # auto-open stops at a bounded depth instead of opening the whole chain
    assert drawn(browser) and boxes(browser)  # something drawn, and the rest closed
    assert js(browser, "window.fxdebugViewer.reveal('relu_299')")  # the deepest op
    assert "relu_299" in drawn(browser)
    assert len(js(browser, "window.fxdebugViewer.openClusters()")) == levels
    js(browser, "window.fxdebugViewer.collapse('l0')")
    assert boxes(browser) == ["l0"] and "relu_299" not in drawn(browser)


def _blocks(count: int, failed: int | None = None) -> tuple[fx.GraphModule, list[str]]:
    """A LLaMA-like trunk: ``layers.i`` blocks (norm, attention-ish add with the rotary table, mlp), the
    rotary table made once at the root and read by every block (a fan)."""
    ops: list[tuple[str, list[int]]] = [("rotary", [-1])]  # op 0: the table every layer reads
    prev = -1
    for i in range(count):
        base = len(ops)
        ops += [(f"layers.{i}.norm", [prev]), (f"layers.{i}.attn", [base, 0]), (f"layers.{i}.mlp", [base + 1])]
        prev = base + 2
    ops.append(("norm", [prev]))
    gm = graph(ops, {f"layers.{i}": "DecoderLayer" for i in range(count)} | {"layers": "ModuleList"})
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    return gm, names


def test_repeated_blocks_fold_and_the_problem_block_stays_out(browser: Any, tmp_path: Path) -> None:
    gm, names = _blocks(80)
    bad = names[1 + 3 * 37 + 1]  # layers.37's attention
    view = build_view(gm, failed=bad)
    data = html_data(build_view(gm, failed=bad))
    assert ["layers.0", "layers.36"] == [data["folds"][0][0], data["folds"][0][-1]]  # the run stops before 37
    open_page(browser, write_html(view, tmp_path / "blocks.html"))
    assert not [p for p in js(browser, "window.fxdebugViewer.openClusters()") if "×" in p]  # folds open on demand
    js(browser, "window.fxdebugViewer.collapse('layers')")
    js(browser, "window.fxdebugViewer.expand('layers')")
    shown = boxes(browser)
    assert {"layers.(0–36 ×37)", "layers.37", "layers.(38–79 ×42)"} <= set(shown)
    title = browser.find_element(By.CSS_SELECTOR, '.cluster.box[data-cluster="layers.(0–36 ×37)"]').text
    assert "layers.0–36 ×37" in title and "37 identical blocks" in title
    assert "failed" in browser.find_element(By.CSS_SELECTOR, '.cluster.box[data-cluster="layers.37"]').get_attribute("class")
    click(browser, 'layers.(38–79 ×42)')
    assert {"layers.38", "layers.79"} <= set(boxes(browser))  # the fold opens into its blocks
    assert js(browser, "window.fxdebugViewer.layoutStats().largest") <= 100


def test_a_fan_is_drawn_once(browser: Any, tmp_path: Path) -> None:
    # One mask feeds 30 sibling blocks (no two alike: each has a different op count, so nothing folds).
    ops: list[tuple[str, list[int]]] = [("mask", [-1])]
    outs = []
    for i in range(30):
        first = len(ops)
        ops.append((f"b{i}", [-1, 0]))
        for _ in range(i % 3):
            ops.append((f"b{i}", [len(ops) - 1]))
        outs.append(len(ops) - 1)
    ops.append(("", outs[:2]))
    gm = graph(ops)
    open_page(browser, write_html(build_view(gm), tmp_path / "fan.html"))
    mask = browser.find_element(By.CSS_SELECTOR, '[data-cluster="mask"], [data-node="relu"]')
    assert "feeds 30 of these (drawn once)" in mask.text
    assert js(browser, "document.querySelectorAll('#canvas .edge').length") < 30 + 10


def test_unconnected_parts_stack_in_execution_order(browser: Any, tmp_path: Path) -> None:
    # Parts with no data edge between them (a model captured in parts around an eager forward: MoE
    # layers) stood side by side, in any order, and the picture was thousands of points wide.
    ops: list[tuple[str, list[int]]] = []
    for i in range(8):
        ops += [(f"part{i}", [-1]), (f"part{i}", [len(ops)])]  # each part reads only the graph input
    gm = graph(ops)
    open_page(browser, write_html(build_view(gm), tmp_path / "parts.html"))
    tops = [js(browser, f"document.querySelector('[data-cluster=\"part{i}\"]').getBBox().y") for i in range(8)]
    assert tops == sorted(tops) and len(set(tops)) == 8  # one below the other, in order
    width = int(browser.find_element(By.ID, "canvas").get_attribute("data-width"))
    assert width < 600


def test_expanding_a_chain_of_one_child_boxes_opens_a_bounded_part_of_it(browser: Any, tmp_path: Path) -> None:
    # a box of one item opens with its parent (nothing hidden by it), but a deep chain of one-child modules stops
    # a few levels down: one click never lays out a hundred nested clusters
    levels = 100
    prefixes = [".".join(f"l{j}" for j in range(d + 1)) for d in range(levels)]
    gm = chain([prefixes[-1]] * 3)  # three ops at the bottom of 100 levels, each level one child of the last
    open_page(browser, write_html(build_view(gm), tmp_path / "chain.html"))
    js(browser, "window.fxdebugViewer.collapse('l0')")
    assert boxes(browser) == ["l0"]
    js(browser, "window.fxdebugViewer.expand('l0')")
    opened = js(browser, "window.fxdebugViewer.openClusters()")
    assert 2 <= len(opened) <= 10 and "relu_2" not in drawn(browser)
