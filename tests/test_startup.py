"""Issue 33: ``import fxdebug`` costs ``import torch`` and little more (the figure is measured by
tools/bench_startup.py, never asserted here).

The package loads its public names on first use: what is pinned here is the structure that makes
it cheap — importing it loads no heavy part (Dynamo's tracer, sympy, triton, networkx, graphviz,
the renderer) — and that the lazy table and the type checkers' imports name the same things, each
resolving to the object the eager package gave."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fxdebug

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch._dynamo", "sympy", "triton", "networkx", "graphviz", "transformers", "fxdebug.api",
         "fxdebug.render.draw", "fxdebug.numerics")


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_loads_no_heavy_part() -> None:
    loaded = _fresh("import sys, torch, fxdebug\n"
                    f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert loaded == "[]"


def test_guard_and_passes_load_without_dynamo() -> None:
    loaded = _fresh("import sys, fxdebug\nfrom fxdebug.passes import NaNCheck, StatCollector\nfxdebug.guard\n"
                    "print([m for m in ('torch._dynamo', 'sympy', 'triton') if m in sys.modules])")
    assert loaded == "[]"


def test_lazy_table_matches_the_type_checkers_imports_and_resolves() -> None:
    tree = ast.parse((ROOT / "fxdebug" / "__init__.py").read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    checked[alias.name] = f"fxdebug.{alias.name}" if imp.module == "fxdebug" else imp.module
    assert checked == fxdebug._LAZY
    assert set(fxdebug.__all__) <= set(fxdebug._LAZY)
    import importlib

    for name, where in fxdebug._LAZY.items():
        module = importlib.import_module(where)
        expected = module if where == f"fxdebug.{name}" else getattr(module, name)
        assert getattr(fxdebug, name) is expected, name


def test_render_is_the_function_whichever_is_imported_first() -> None:
    # fxdebug/render/ is a subpackage: its first import sets it as an attribute of fxdebug, which must
    # not hide the public render() function
    out = _fresh("import fxdebug\nimport fxdebug.render.draw\nimport fxdebug.api\n"
                 "print(fxdebug.render is fxdebug.api.render, callable(fxdebug.render), fxdebug.api.__name__)")
    assert out == "True True fxdebug.api"
    out = _fresh("import fxdebug\nfxdebug.instrument\nprint(fxdebug.render.__module__)")
    assert out == "fxdebug.api"
