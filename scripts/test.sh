#!/usr/bin/env bash
# Sets up whatever is missing, builds, and runs every test: the Catch2 tests
# through ctest, then the pytest tests against the same build.
#   scripts/test.sh                 # everything
#   scripts/test.sh -R adam         # extra arguments go to ctest
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
build=${STRIDER_BUILD_DIR:-$here/build}

ctest --test-dir "$build" --output-on-failure -j "${STRIDER_JOBS:-$(nproc)}" "$@"

if compgen -G "$here/tests/python/test_*.py" >/dev/null; then
  STRIDER_BUILD_DIR="$build" "$here/.venv/bin/python" -m pytest -q "$here/tests/python"
fi
