"""The interactive HTML viewer, driven in a real browser (Debian's chromium + chromium-driver, selenium).

Each test writes a viewer with ``render("x.html")``, opens it from disk (offline: the page has no
external reference) and checks what a user sees: no console error, the node count of the graph,
clusters that expand on click, search, and the NaN origin / failed check one click away. Skipped
with a message when selenium or chromium is missing (``tools/setup.sh`` installs both).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

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


def open_page(browser: Any, path: str) -> Any:
    browser.get(Path(path).resolve().as_uri())
    assert browser.execute_script("return document.body.getAttribute('data-ready')") == "1"
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == [], errors
    return browser


def js(browser: Any, expr: str) -> Any:
    return browser.execute_script(f"return {expr};")


def drawn(browser: Any) -> set[str]:
    return {e.get_attribute("data-node") for e in browser.find_elements(By.CSS_SELECTOR, "#canvas [data-node]")}


def test_page_is_self_contained(tmp_path: Path) -> None:
    from fxdebug.cli.demo import demo_model

    path = fxdebug.render(demo_model(), tmp_path / "demo.html", torch.randn(2, 3, 16, 16))
    text = Path(path).read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # no CDN, nothing fetched
    assert "sourceMappingURL" not in text
    assert "dagre" in text and "Permission is hereby granted" in text  # the library and its licence


@pytest.fixture(scope="module")
def demo(tmp_path_factory: Any) -> tuple[Any, str]:
    from fxdebug.cli.demo import demo_batches, demo_model

    xs = demo_batches(2)
    dbg = fxdebug.instrument(demo_model(), [NaNCheck(), StatCollector()], example_inputs=(xs[0],))
    with torch.no_grad():
        for x in xs:
            dbg(x)
    return dbg, dbg.render(str(tmp_path_factory.mktemp("demo") / "demo.html"))


def test_demo_viewer(browser: Any, demo: tuple[Any, str]) -> None:
    dbg, path = demo
    open_page(browser, path)
    graph = fxdebug.to_networkx(dbg)
    assert int(browser.find_element(By.ID, "node-count").text) == graph.number_of_nodes()
    origin = dbg.report().first_nonfinite  # head's log: `log` (symbolic) or `head_log` (Dynamo)
    assert origin in ("log", "head_log") and {"stage2_act", origin} <= drawn(browser)  # small graph: opened fully
    # Collapse a module by its title, expand it again by clicking its box.
    browser.execute_script("document.querySelector('[data-cluster=\"stage2\"] .ctitle')"
                           ".dispatchEvent(new MouseEvent('click', {bubbles: true}))")
    assert "stage2_conv" not in drawn(browser)
    box = browser.find_element(By.CSS_SELECTOR, '.cluster.box[data-cluster="stage2"]')
    assert "dead" in box.get_attribute("class")  # the dead ReLU inside colours the collapsed box
    box.click()
    assert {"stage2_conv", "stage2_act"} <= drawn(browser)
    # The NaN origin is one click away and highlighted; its panel shows statistics and provenance.
    button = browser.find_element(By.CSS_SELECTOR, "button.finding.origin")
    assert button.get_attribute("data-finding") == origin
    button.click()
    node = browser.find_element(By.CSS_SELECTOR, f'[data-node="{origin}"]')
    assert "origin" in node.get_attribute("class").split()
    panel = browser.find_element(By.ID, "details").text
    assert "NaN/Inf ORIGIN" in panel and "head" in panel and "observed by" in panel
    assert "torch.log" in panel
    # Colour by a report column: a heat map over the nodes that have it.
    browser.execute_script("window.fxdebugViewer.colourBy('std')")
    styled = browser.find_element(By.CSS_SELECTOR, '[data-node="stage1_conv"] rect').get_attribute("style")
    assert "fill" in styled and "std:" in browser.find_element(By.ID, "scale").text


def test_search_finds_a_node(browser: Any, demo: tuple[Any, str]) -> None:
    _, path = demo
    open_page(browser, path)
    browser.execute_script("window.fxdebugViewer.collapse('head')")
    assert "head_temperature" not in drawn(browser)
    box = browser.find_element(By.ID, "search")
    box.send_keys("temperature\n")
    hits = [e.get_attribute("data-hit") for e in browser.find_elements(By.CSS_SELECTOR, "#results [data-hit]")]
    assert hits == ["head_temperature"]
    assert "head_temperature" in drawn(browser)  # a single hit is revealed (its module expanded)
    box.clear()
    box.send_keys("stage\n")  # by module path
    hits = [e.get_attribute("data-hit") for e in browser.find_elements(By.CSS_SELECTOR, "#results [data-hit]")]
    assert set(hits) == {"stage1_conv", "stage1_act", "stage2_conv", "stage2_act"}


# -- a tiny transformer (export frontend) with a NaN planted in one attention layer --------------------
def test_tiny_transformer_viewer(browser: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    model = transformers.BertModel(cfg).eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=inputs)
    with torch.no_grad():
        model.encoder.layer[1].attention.self.key.weight[0, 0] = float("nan")
        dbg(**inputs)
    origin = dbg.report().first_nonfinite
    assert fxdebug.to_networkx(dbg).nodes[origin]["module"] == "encoder.layer.1.attention.self.key"
    open_page(browser, dbg.render(str(tmp_path / "bert.html")))
    assert int(browser.find_element(By.ID, "node-count").text) == fxdebug.to_networkx(dbg).number_of_nodes()
    # It opens on screen: wider than the window at the smallest opening scale, it starts at the left edge
    # (it was centred, so its left part, where the inputs are, sat off screen).
    left = js(browser, "document.querySelector('#canvas > g').getBoundingClientRect().left"
                       " - document.getElementById('canvas').getBoundingClientRect().left")
    assert left >= 0
    # A statistic the report leaves empty (None) is not printed as a literal 'null'.
    empty = next(r["node"] for r in dbg.report().rows if any(v is None for v in r.values()))
    assert js(browser, f"window.fxdebugViewer.reveal({empty!r})")
    assert "null" not in browser.find_element(By.ID, "details").text
    assert "null" not in js(browser, "document.getElementById('canvas').textContent")
    assert browser.find_elements(By.CSS_SELECTOR, '.cluster.box[data-cluster$="(mask/shape plumbing)"]')  # closed
    if browser.find_elements(By.CSS_SELECTOR, '[data-cluster="encoder"] .ctitle'):  # opened to fit: close it
        browser.execute_script("document.querySelector('[data-cluster=\"encoder\"] .ctitle')"
                               ".dispatchEvent(new MouseEvent('click', {bubbles: true}))")
    shown = drawn(browser)
    assert origin not in shown  # inside a collapsed cluster now
    module = "encoder.layer.1.attention.self.key"
    boxes = {e.get_attribute("data-cluster") for e in browser.find_elements(By.CSS_SELECTOR, ".cluster.box")}
    holder = [b for b in boxes if (module + ".").startswith(b + ".")]
    assert len(holder) == 1  # one collapsed box holds the origin ...
    box = browser.find_element(By.CSS_SELECTOR, f'.cluster.box[data-cluster="{holder[0]}"]')
    assert "origin" in box.get_attribute("class").split()  # ... and is marked
    box.click()
    children = {e.get_attribute("data-cluster") for e in browser.find_elements(By.CSS_SELECTOR, "[data-cluster]")}
    inside = {n for n in drawn(browser) if n not in shown}
    assert inside or any(c.startswith(holder[0] + ".") for c in children)  # its children are drawn now
    assert not browser.find_elements(By.CSS_SELECTOR, f'.cluster.box[data-cluster="{holder[0]}"]')
    browser.find_element(By.CSS_SELECTOR, "button.finding.origin").click()
    node = browser.find_element(By.CSS_SELECTOR, f'[data-node="{origin}"]')
    assert "origin" in node.get_attribute("class").split()
    panel = browser.find_element(By.ID, "details").text
    assert "encoder.layer.1.attention.self.key" in panel
    assert re.search(r"source modeling_bert\.py:\d+", panel)  # the user's (here: transformers') line


# -- 10,000 nodes -------------------------------------------------------------------------------------
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)) * 0.5)


def synthetic(cells: int = 2000, group: int = 20) -> nn.Module:
    """``5 × cells`` op nodes in ``cells / group`` groups of ``group`` cells."""
    return nn.Sequential(*[nn.Sequential(*[Cell() for _ in range(group)]) for _ in range(cells // group)])


def test_ten_thousand_nodes_open_lazily(browser: Any, tmp_path: Path) -> None:
    gc.disable()  # tracing 10k nodes with the collector scanning the growing heap takes several times longer
    try:
        gm = fxdebug.trace(synthetic())
    finally:
        gc.enable()
    count = len(gm.graph.nodes)
    assert count >= 10_000
    target = "_73_11_norm"  # deep inside group 73
    assert target in {n.name for n in gm.graph.nodes}
    open_page(browser, fxdebug.render(gm, tmp_path / "big.html", failed=target))
    assert int(browser.find_element(By.ID, "node-count").text) == count
    assert len(drawn(browser)) < 200  # only the collapsed top of the graph is laid out
    button = browser.find_element(By.CSS_SELECTOR, "button.finding.failed")
    assert button.get_attribute("data-finding") == target
    button.click()
    node = browser.find_element(By.CSS_SELECTOR, f'[data-node="{target}"]')
    assert "failed" in node.get_attribute("class").split()
    assert len(drawn(browser)) < 400  # revealing one node opened its path, not the graph
    browser.find_element(By.ID, "search").send_keys("_12_3_lin\n")
    assert "_12_3_lin" in {e.get_attribute("data-hit") for e in browser.find_elements(By.CSS_SELECTOR, "#results [data-hit]")}


def test_viewer_colours_by_a_run_diff(browser: Any, tmp_path: Path) -> None:
    from fxdebug.cli.demo import demo_batches, demo_model

    x = demo_batches(1)[0]
    runs = []
    for scale in (1.0, 1.5):  # run B: stage1's conv weights scaled, so stage1_conv is where they part
        model = demo_model()
        with torch.no_grad():
            model.stage1.conv.weight.mul_(scale)
        dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
        with torch.no_grad():
            dbg(x)
        runs.append(dbg)
    d = fxdebug.diff(runs[0].report(), runs[1].report())
    assert d.first_divergent == "stage1_conv"
    open_page(browser, runs[0].render(str(tmp_path / "diff.html"), diff=d))
    assert browser.find_element(By.ID, "colour").get_attribute("value") == "diff:divergence"  # opens coloured
    before = browser.find_element(By.CSS_SELECTOR, '[data-node="stem_0"] rect').get_attribute("style") or ""
    after = browser.find_element(By.CSS_SELECTOR, '[data-node="stage2_conv"] rect').get_attribute("style")
    assert "fill" in after and after != before  # diverged nodes are hotter than those before the change
    button = browser.find_element(By.CSS_SELECTOR, '[data-finding="stage1_conv"]')
    assert "first divergent" in button.text
    button.click()
    assert "diverges" in browser.find_element(By.ID, "details").text
    svg = runs[0].render(str(tmp_path / "diff.svg"), diff=d)
    text = Path(svg).read_text(encoding="utf-8")
    assert "first divergent node: stage1_conv" in text


def test_long_flat_graph_opens_in_runs(browser: Any, tmp_path: Path) -> None:
    layers: list[nn.Module] = []
    for _ in range(600):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    gm = fxdebug.trace(nn.Sequential(*layers))  # 1,200 ops, all owned by the root module
    open_page(browser, fxdebug.render(gm, tmp_path / "flat.html"))
    assert int(browser.find_element(By.ID, "node-count").text) == len(gm.graph.nodes)
    runs = [e.get_attribute("data-cluster") for e in browser.find_elements(By.CSS_SELECTOR, ".cluster.box")]
    assert "(nodes 1–100)" in runs and len(drawn(browser)) < 300  # closed runs of 100, not 1,202 boxes
    browser.find_element(By.ID, "search").send_keys("_1100\n")  # the Linear at index 1100
    assert "_1100" in drawn(browser)
