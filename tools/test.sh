#!/usr/bin/env bash
# The test command: the full set-up (idempotent: the demo's, plus the test extras and Chromium),
# run the whole suite, then build the wheel, install it into a fresh venv and smoke-test it from
# outside the checkout (tools/wheel_smoke.sh).
# FXDEBUG_SLOW=1 also runs the slow tests; FXDEBUG_FUZZ_EXAMPLES=N sets the number of fuzzed models;
# FXDEBUG_SKIP_WHEEL=1 skips the wheel smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
"${PYTHON:-python3}" -m pytest "$@"
if [ "${FXDEBUG_SKIP_WHEEL:-0}" != "1" ]; then
  bash tools/wheel_smoke.sh
fi
