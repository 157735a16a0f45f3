#!/usr/bin/env bash
# One-time set-up, safe to repeat: torch 2.13.0 (CPU build, installed first so nothing pulls
# another torch), graphviz's `dot`, and fxdebug itself in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! command -v dot >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq graphviz >/dev/null
  else
    echo "setup: graphviz's 'dot' is missing; install graphviz (brew install graphviz / conda install graphviz)" >&2
  fi
fi
# The HTML viewer's browser tests (tests/test_viewer.py) drive Debian's chromium through its driver.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 \
      || echo "setup: could not install chromium/chromium-driver; the browser tests will be skipped" >&2
  else
    echo "setup: no apt-get here; install chromium and chromedriver to run the browser tests (skipped otherwise)" >&2
  fi
fi
"$PY" -m pip install -q -e ".[test]"
# Build (and cache) the fused observation kernel now rather than in the first test; falls back to pure torch.
"$PY" -c "import fxdebug.runtime as r; print('fxdebug observation kernel:', r.load(), r.fallback_reason() or '')"
