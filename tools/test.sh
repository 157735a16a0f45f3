#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
# FXDEBUG_SLOW=1 also runs the slow tests; FXDEBUG_FUZZ_EXAMPLES=N sets the number of fuzzed models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${PYTHON:-python3}" -m pytest "$@"
