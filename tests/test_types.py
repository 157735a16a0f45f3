"""``mypy`` reports no error in the package (configured in pyproject.toml's ``[tool.mypy]``).

The package ships ``py.typed``, so its annotations are a promise to users' type checkers. CI
installs the ``test`` extra, which includes mypy; without mypy the test is skipped. A cold run
takes ~15-50 s (two shared cores); mypy's cache (``.mypy_cache/``) makes reruns a few seconds.

The result must not depend on which optional extras are installed (triton, lightning): a ``type: ignore``
that names whether a module is found (``import-untyped`` vs ``import-not-found``) is wrong in one of the
two environments, so those modules are in the config's ``ignore_missing_imports`` list instead. The slow
variant checks that for real, in an interpreter that sees every installed package but the extras.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_reports_no_error_in_the_package():
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install 'fxdebug[test]')")
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "fxdebug")])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, "mypy found errors:\n" + "\n".join(errors[:40]) + f"\n{stderr}"


# the optional extras the package imports when present (pyproject's extras ``triton`` and ``lightning``), and the
# distributions that come with them
EXTRAS = ("triton", "lightning", "pytorch_lightning")
_EXTRA_DISTRIBUTIONS = re.compile(r"^(triton|lightning|lightning_fabric|lightning_utilities|pytorch_lightning)([-.].*)?$")


def test_optional_extras_are_typed_the_same_whether_installed_or_not():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    ignored = {m for o in config.get("overrides", []) if o.get("ignore_missing_imports") for m in o["module"]}
    assert {f"{m}.*" for m in EXTRAS} <= ignored, f"add {sorted({f'{m}.*' for m in EXTRAS} - ignored)} to the overrides"
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "fxdebug").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"type:\s*ignore\[[^]]*import-(untyped|not-found)", line)]
    assert not found, f"type: ignore comments that hold only where the module is (or is not) installed: {found}"


@pytest.mark.slow
def test_mypy_reports_no_error_without_the_optional_extras(tmp_path):
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install 'fxdebug[test]')")
    venv = tmp_path / "without-extras"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    for installed in map(Path, site.getsitepackages()):  # every installed package but the extras, linked
        for entry in installed.iterdir():
            if not _EXTRA_DISTRIBUTIONS.match(entry.name) and not (packages / entry.name).exists():
                os.symlink(entry, packages / entry.name)
    hidden = subprocess.run([str(python), "-c", "import triton"], capture_output=True)
    assert hidden.returncode != 0, "the extras are still importable in the test interpreter"
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--python-executable", str(python),
                                      "--cache-dir", str(ROOT / ".mypy_cache" / "without-extras"), str(ROOT / "fxdebug")])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, "mypy found errors without triton/lightning:\n" + "\n".join(errors[:40]) + stderr
