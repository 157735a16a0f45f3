"""What the HTML viewer is given (no browser): module paths without torch internals, runs of repeated blocks."""

from __future__ import annotations

import torch
from torch import fx, nn

from fxdebug.render.html import html_data
from fxdebug.render.view import build_view

HOOK = "_empty_nn_module_stack_from_metadata_hook"


def test_torch_empty_module_stack_marker_is_not_a_module() -> None:
    # torch.export's metadata hook gives nodes it creates without a module this stack entry (B10):
    # it is not a module of the model, and must not be drawn as one.
    g = fx.Graph()
    x = g.placeholder("x")
    made = g.call_function(torch.relu, (x,))
    made.meta["nn_module_stack"] = {HOOK: (HOOK, HOOK)}
    inner = g.call_function(torch.neg, (made,))
    inner.meta["nn_module_stack"] = {"L['self'].block": ("L['self'].block", nn.Linear)}
    g.output(inner)
    view = build_view(fx.GraphModule(nn.Module(), g))
    assert view.nodes["relu"].module == "" and view.nodes["relu"].module_type is None
    assert view.nodes["neg"].module == "block"  # a real module path is kept
    data = html_data(view)
    assert not any(HOOK in s for s in data["strings"]) and HOOK not in str(data["modules"])


def test_repeated_blocks_are_listed_as_runs() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) + x

    from fxdebug import trace

    gm = trace(nn.Sequential(*[Block() for _ in range(6)]))
    data = html_data(build_view(gm, failed="add_3"))  # block 3 holds a failed check: kept out of the runs
    assert data["folds"] == [["0", "1", "2"], ["4", "5"]]
