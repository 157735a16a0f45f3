"""The wheel ships every subpackage: an editable install once hid a missing ``fxdebug.capture``.

Every directory under ``fxdebug/`` and ``passes/`` holding an ``__init__.py`` must be listed in
``[tool.setuptools] packages`` (mapped as setuptools maps it), and every non-Python file the
package reads at run time must be covered by ``package-data``.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _on_disk() -> set[str]:
    found = set()
    for base, dotted in (("fxdebug", "fxdebug"), ("passes", "fxdebug.passes")):
        for init in (ROOT / base).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / base)
            found.add(".".join([dotted, *rel.parts]))
    return found


def test_every_subpackage_is_listed():
    listed = set(_config()["packages"])
    missing = sorted(_on_disk() - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def test_every_data_file_is_shipped():
    patterns = _config().get("package-data", {}).get("fxdebug", [])
    unshipped = []
    for path in (ROOT / "fxdebug").rglob("*"):
        if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT / "fxdebug").as_posix()
        if not any(fnmatch.fnmatch(rel, pat) for pat in patterns):
            unshipped.append(rel)
    assert not unshipped, f"add {unshipped} to [tool.setuptools.package-data] fxdebug in pyproject.toml"
