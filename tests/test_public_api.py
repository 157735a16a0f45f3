"""The public surface is deliberate: two pinned, sorted ``__all__`` lists and clean boundaries.

``fxdebug.__all__`` is the user API; ``fxdebug.authoring.__all__`` the pass-author API. Adding a
public name means adding it here (and to DESIGN.md's table when it is a promise); names DESIGN.md
already promises may appear before they are pinned. The import graph of ``fxdebug/`` has no cycle,
counting imports inside functions too (so none can hide one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import fxdebug
import fxdebug.authoring
import fxdebug.passes

ROOT = Path(__file__).resolve().parent.parent

USER_API = {
    "Alignment", "align", "ArgumentTypeError", "Column", "DeviceMismatchError", "DistributedError", "FxDebugError", "GradcheckResult", "InplaceError", "Inputs",
    "Instrumented", "LeafInfo", "MissingInputsError", "NonFiniteError", "Pass", "PassContext", "PassError",
    "PassManager", "PassResult", "RenderOptions", "Report", "Sensitivity", "ShapeMismatchError", "TraceError", "TraceInfo",
    "UsageError", "Verification", "VerificationError", "authoring", "collect", "gradcheck", "graph_pass", "guard",
    "instrument", "node_pass", "numerics", "outputs_of", "plot", "precision_plan", "render", "sensitivity", "to_networkx",
    "trace", "verify", "when",
}
# Promised by DESIGN.md's tables; they may land in fxdebug.__all__ before being pinned above.
DESIGN_PROMISED = {"verify", "collect", "sensitivity", "precision_plan", "diff", "repro", "gradcheck", "InplaceError",
                   "numerics", "plot", "when"}
DESIGN_NAMES = {
    "trace", "instrument", "render", "Instrumented", "Report", "Pass", "PassContext", "PassResult", "PassManager",
    "FxDebugError", "TraceError", "PassError", "ShapeMismatchError", "NonFiniteError", "DeviceMismatchError",
    "outputs_of",
}
AUTHORING_API = {
    "CLOCK", "COLOR", "Column", "FindingRule", "FusedProbe", "FusedStats", "GRADIENT", "GRADIENT_MEAN", "GUARD", "GraphRecord", "HIDDEN", "INSTRUMENTATION",
    "KNOWN_REQUIREMENTS", "Match", "NONFINITE", "NodeMeta", "ORIGIN", "ObservationContext", "Observer", "Options", "Pass",
    "PassContext", "PassManager", "PassResult", "Probe", "Reductions", "Replacement", "SAMPLE", "TensorSpec",
    "VALUE", "Where", "activation_row", "describe", "find_pattern", "fx_meta", "get_attr", "get_module", "graph_pass", "graph_record",
    "is_batchnorm", "is_conv", "is_inplace", "is_instrumentation", "is_kind", "is_linear", "is_relu", "is_view",
    "keep_state", "matches", "module_path", "module_type", "node_identity", "node_meta", "node_pass", "node_values", "op_label",
    "outputs_of", "register_kind", "replace_pattern", "source_line", "systematic_sample",
}
DESIGN_PASSES = {"ShapeAssert", "NaNCheck", "StatCollector", "DeviceCheck", "Capture", "SwapActivation", "Fuse", "PruneMasks"}
PUBLIC_SUBPACKAGES = {"fxdebug", "fxdebug.authoring", "fxdebug.passes", "fxdebug.plot", "fxdebug.numerics", "fxdebug.when"}


def test_user_api_is_sorted_pinned_and_keeps_the_design_names():
    names = fxdebug.__all__
    assert names == sorted(names)
    assert len(names) == len(set(names))
    unpinned = set(names) - USER_API - DESIGN_PROMISED
    assert not unpinned, f"new public names {sorted(unpinned)}: pin them in USER_API (tests/test_public_api.py)"
    assert not USER_API - set(names), f"pinned names missing from fxdebug.__all__: {sorted(USER_API - set(names))}"
    assert DESIGN_NAMES <= set(names)
    for name in names:
        assert getattr(fxdebug, name) is not None


def test_authoring_api_is_sorted_and_pinned():
    names = fxdebug.authoring.__all__
    assert names == sorted(names) and len(names) == len(set(names))
    assert set(names) == AUTHORING_API
    for name in names:
        assert getattr(fxdebug.authoring, name) is getattr(fxdebug, name, getattr(fxdebug.authoring, name))
    # the user API and the authoring API share only what a user needs to write a pass at all
    assert set(fxdebug.__all__) & set(names) == {"Column", "Pass", "PassContext", "PassManager", "PassResult",
                                                 "graph_pass", "node_pass", "outputs_of"}


def test_root_holds_no_pass_authoring_name_beyond_the_user_api():
    """The re-exports "for older code" are gone (issue 32 item 7): a pass-author name lives in
    ``fxdebug.authoring`` only, and asking the root for one says where it is."""
    extra = (set(fxdebug.authoring.__all__) - set(fxdebug.__all__)) & (set(dir(fxdebug)) | set(fxdebug._LAZY))
    assert not extra, f"pass-authoring names still re-exported at the fxdebug root: {sorted(extra)}"
    for name in ("describe", "Probe", "replace_pattern", "is_conv"):
        try:
            getattr(fxdebug, name)
        except AttributeError as err:
            assert f"from fxdebug.authoring import {name}" in str(err)
        else:
            raise AssertionError(f"fxdebug.{name} still resolves at the root")


def test_passes_namespace_is_sorted_and_names_the_design_passes():
    assert fxdebug.passes.__all__ == sorted(fxdebug.passes.__all__)
    assert DESIGN_PASSES <= set(fxdebug.passes.__all__)


def test_error_hierarchy_one_class_per_meaning():
    assert issubclass(fxdebug.ShapeMismatchError, ValueError)
    assert issubclass(fxdebug.TraceError, RuntimeError)
    assert issubclass(fxdebug.NonFiniteError, FloatingPointError)
    assert issubclass(fxdebug.UsageError, ValueError) and not issubclass(fxdebug.UsageError, TypeError)
    assert issubclass(fxdebug.ArgumentTypeError, TypeError) and issubclass(fxdebug.ArgumentTypeError, fxdebug.UsageError)
    assert issubclass(fxdebug.MissingInputsError, fxdebug.UsageError)
    for name in ("TraceError", "PassError", "ShapeMismatchError", "NonFiniteError", "DeviceMismatchError", "UsageError",
                 "ArgumentTypeError", "MissingInputsError"):
        assert issubclass(getattr(fxdebug, name), fxdebug.FxDebugError)
    err = fxdebug.ShapeMismatchError("x", node="fc1", module="fc1")
    assert (err.node, err.module) == ("fc1", "fc1")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """Every import in ``path`` (module level and inside functions), as absolute module names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _core_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "fxdebug").rglob("*.py"))}


def test_import_graph_of_fxdebug_has_no_cycle():
    modules = _core_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target, names in _imports(path, name):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            for dep in submodules or ([target] if target in modules else []):
                if dep != name:
                    graph.add_edge(name, dep)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles in fxdebug/ (imports inside functions count): {cycles[:5]}"


def test_passes_use_only_public_fxdebug_names():
    public = set(fxdebug.__all__)
    authoring = set(fxdebug.authoring.__all__)
    for path in sorted((ROOT / "passes").glob("*.py")):
        for module, names in _imports(path, f"fxdebug.passes.{path.stem}"):
            if module.startswith("fxdebug.passes"):
                continue  # sibling pass modules
            if module == "fxdebug":
                assert set(names) <= public - authoring, \
                    f"{path.name} imports {set(names) - (public - authoring)} from fxdebug; pass-authoring names come from fxdebug.authoring"
            elif module == "fxdebug.authoring":
                assert set(names) <= authoring, f"{path.name} imports {set(names) - authoring} from fxdebug.authoring"
            else:
                assert module not in _core_modules() or module in PUBLIC_SUBPACKAGES, \
                    f"{path.name} imports {module}; use the public names of fxdebug / fxdebug.authoring"
        for node in ast.walk(ast.parse(path.read_text())):  # fxdebug.<name> in code, e.g. a base class fxdebug.Pass
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fxdebug":
                assert node.attr in public, f"{path.name}:{node.lineno} reads fxdebug.{node.attr}, not a public root name"


def test_core_never_imports_passes_at_module_level():
    for path in sorted((ROOT / "fxdebug").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; the CLI/demo may import passes inside functions
            if isinstance(node, ast.ImportFrom):
                assert "passes" not in (node.module or "").split("."), f"{path} imports passes at module level"
            if isinstance(node, ast.Import):
                assert not any("passes" in a.name.split(".") for a in node.names), path


# The floor plan of fxdebug/, bottom up. A module may import its own folder and any floor below
# its own, never a floor above and never a sibling folder on its own floor (imports inside
# functions count: a lazy import upward is the same dependency, only hidden).
FLOORS = [
    {"fxdebug.errors"},
    {"fxdebug.graph"},
    {"fxdebug.runtime", "fxdebug.capture"},
    {"fxdebug.report"},
    {"fxdebug.authoring", "fxdebug.render"},
    {"fxdebug.instrumented"},
    {"fxdebug.api"},
    {"fxdebug.numerics", "fxdebug.training", "fxdebug.plot", "fxdebug.when"},
    {"fxdebug"},  # the package itself: the user API, re-exported from the floors below
    {"fxdebug.cli", "fxdebug.integrations"},
    {"fxdebug.__main__"},
]
# Known upward imports still to be removed: each entry is (importer room, imported room). The list
# only shrinks; a new upward import fails the test below.
UPWARD_DEBTS: set[tuple[str, str]] = set()
MAX_TOP_LEVEL_MODULES = 8


def _room(module: str) -> str:
    """The folder (or top-level module) a module lives in: ``fxdebug.graph.meta`` → ``fxdebug.graph``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _floor(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"{room} is on no floor: add it to FLOORS in tests/test_public_api.py")


def test_every_import_points_down_the_floor_plan():
    modules = _core_modules()
    upward = set()
    for name, path in modules.items():
        here = _room(name)
        for target, names in _imports(path, name):
            if not target.startswith("fxdebug") or target.startswith("fxdebug.passes"):
                continue
            deps = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules] or [target]
            for dep in deps:
                there = _room(dep)
                if there != here and _floor(there) >= _floor(here):
                    upward.add((here, there))
    new = upward - UPWARD_DEBTS
    assert not new, f"imports that point up or sideways in the floor plan: {sorted(new)}"
    paid = UPWARD_DEBTS - upward
    assert not paid, f"these debts are paid: remove them from UPWARD_DEBTS: {sorted(paid)}"


def test_few_modules_at_the_top_of_the_package():
    top = [p.name for p in (ROOT / "fxdebug").glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of fxdebug/: {sorted(top)}"


# A module a reader can hold in their head: split a longer one along a seam a reader would see (issue 32).
MAX_MODULE_LINES = 500


def test_no_module_of_the_package_or_the_pass_library_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted([*(ROOT / "fxdebug").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


# Keys that only a built-in pass writes (report columns, node.meta["fxdebug"] entries): the core
# reads column declarations (roles, only=, merge=, finding=, answers=) and declared node metadata
# (NodeMeta: transforms, stands_for) instead, so a user's pass gets the same treatment.
BUILT_IN_KEYS = (
    "dead_frac",  # StatCollector's dead fraction (Column(only=, merge=, finding=))
    "param_grad",  # ParamGrads (roles GRADIENT / GRADIENT_MEAN)
    "\"fused\"", "'fused'",  # Fuse (NodeMeta.transforms, stands_for)
    "\"pruned\"", "'pruned'",  # PruneMasks
    "\"swapped\"", "'swapped'",  # SwapActivation
    "\"frozen\"", "'frozen'", "frozen_ref",  # Freeze
    "\"nonfinite_calls\"", "\"nonfinite_first_call\"",  # NaNCheck (roles NONFINITE / ORIGIN)
    "\"hist\"", "\"grad_hist\"",  # Histograms
)


# The same words meaning something else: torch.optim's ``fused=`` flag of a parameter group.
NOT_PASS_KEYS = {"fxdebug/training/guard.py": {"\"fused\""}}


def test_core_knows_no_built_in_pass_key():
    found = []
    for path in sorted((ROOT / "fxdebug").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        keys = [k for k in BUILT_IN_KEYS if k not in NOT_PASS_KEYS.get(name, set())]
        for i, line in enumerate(path.read_text().splitlines(), 1):
            found.extend(f"{name}:{i}: {key}" for key in keys if key in line)
    assert not found, "the core names built-in passes' keys (declare them on the pass's Column / NodeMeta):\n" + \
        "\n".join(found[:40])
