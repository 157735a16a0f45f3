"""The public surface is deliberate: a pinned, sorted __all__ and clean package boundaries."""

from __future__ import annotations

import ast
from pathlib import Path

import fxdebug
import fxdebug.passes

ROOT = Path(__file__).resolve().parent.parent

DESIGN_NAMES = {
    "trace", "instrument", "Instrumented", "Report", "Pass", "PassContext", "PassResult", "PassManager",
    "FxDebugError", "TraceError", "PassError", "ShapeMismatchError", "NonFiniteError", "DeviceMismatchError",
}
DESIGN_PASSES = {"ShapeAssert", "NaNCheck", "StatCollector", "DeviceCheck", "Capture", "SwapActivation", "Fuse", "PruneMasks"}


def test_all_is_sorted_and_resolves():
    assert fxdebug.__all__ == sorted(fxdebug.__all__)
    assert DESIGN_NAMES <= set(fxdebug.__all__)
    for name in fxdebug.__all__:
        assert getattr(fxdebug, name) is not None


def test_passes_namespace_names_the_design_passes():
    assert set(fxdebug.passes.__all__) == DESIGN_PASSES


def test_error_hierarchy_also_inherits_builtins():
    assert issubclass(fxdebug.ShapeMismatchError, ValueError)
    assert issubclass(fxdebug.TraceError, RuntimeError)
    assert issubclass(fxdebug.NonFiniteError, FloatingPointError)
    for name in ("TraceError", "PassError", "ShapeMismatchError", "NonFiniteError", "DeviceMismatchError", "UsageError"):
        assert issubclass(getattr(fxdebug, name), fxdebug.FxDebugError)
    err = fxdebug.ShapeMismatchError("x", node="fc1", module="fc1")
    assert (err.node, err.module) == ("fc1", "fc1")


def _imports(path: Path) -> list[tuple[str, int, list[str]]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, 0, []) for a in node.names)
    return found


def test_passes_use_only_public_fxdebug_names():
    public = set(fxdebug.__all__)
    for path in sorted((ROOT / "passes").glob("*.py")):
        for module, level, names in _imports(path):
            if level > 0:
                continue  # sibling pass modules
            if module == "fxdebug":
                assert set(names) <= public, f"{path.name} imports private names {set(names) - public}"
            else:
                assert not module.startswith("fxdebug.") or module.startswith("fxdebug.passes"), \
                    f"{path.name} imports {module}; use the public names of fxdebug"


def test_core_never_imports_passes_at_module_level():
    for path in sorted((ROOT / "fxdebug").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; the CLI/demo may import passes inside functions
            if isinstance(node, ast.ImportFrom):
                assert "passes" not in (node.module or "").split("."), f"{path} imports passes at module level"
            if isinstance(node, ast.Import):
                assert not any("passes" in a.name.split(".") for a in node.names), path
