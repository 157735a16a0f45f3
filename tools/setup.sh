#!/usr/bin/env bash
# One-time set-up, safe to repeat. Two sizes:
#   bash tools/setup.sh demo   what the demo needs: torch 2.13.0 (CPU build, installed first so nothing
#                              pulls another torch), graphviz's `dot`, and fxdebug itself in editable mode
#                              (its own dependencies only: networkx, graphviz)
#   bash tools/setup.sh [test] the above plus the test extras (pytest, transformers, lightning, triton,
#                              mypy, selenium, ...) and Chromium with its driver for the browser tests
# FXDEBUG_SETUP_DRY_RUN=1 prints the install commands instead of running them (what would be installed here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-test}
case "$MODE" in
  demo|test) ;;
  *) echo "setup: unknown set-up '$MODE' (use: demo or test)" >&2; exit 2 ;;
esac
DRY=${FXDEBUG_SETUP_DRY_RUN:-0}

run() {  # a command that installs something: printed instead under FXDEBUG_SETUP_DRY_RUN=1
  if [ "$DRY" = "1" ]; then echo "setup (dry run): $*" >&2; else "$@"; fi
}

SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
APT_UPDATED=0
apt_install() {  # apt_install PACKAGE...: one `apt-get update` per set-up, then the packages
  if [ "$APT_UPDATED" = "0" ]; then run $SUDO apt-get update -qq; APT_UPDATED=1; fi
  run $SUDO apt-get install -y -qq "$@"
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  run "$PY" -m pip install -q "torch==2.13.0"
fi
if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    apt_install graphviz >/dev/null
  else
    echo "setup: graphviz's 'dot' is missing; install graphviz (brew install graphviz / conda install graphviz)" >&2
  fi
fi

if [ "$MODE" = "demo" ]; then
  # fxdebug and its own dependencies, no extras; nothing to do when they are already there
  if ! { "$PY" -m pip show -q fxdebug >/dev/null 2>&1 && "$PY" -c "import networkx, graphviz" 2>/dev/null; }; then
    run "$PY" -m pip install -q -e .
  fi
else
  # The HTML viewer's browser tests (tests/test_viewer.py) drive Debian's chromium through its driver.
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
      { apt_install chromium chromium-driver; } >/dev/null 2>&1 \
        || echo "setup: could not install chromium/chromium-driver; the browser tests will be skipped" >&2
    else
      echo "setup: no apt-get here; install chromium and chromedriver to run the browser tests (skipped otherwise)" >&2
    fi
  fi
  run "$PY" -m pip install -q -e ".[test]"
fi
# Build (and cache) the fused observation kernel now rather than in the first call; falls back to pure torch.
if [ "$DRY" = "1" ]; then
  echo "setup (dry run): build the observation kernel (fxdebug.runtime.load())"
else
  "$PY" -c "import fxdebug.runtime as r; print('fxdebug observation kernel:', r.load(), r.fallback_reason() or '')"
fi
