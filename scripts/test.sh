#!/usr/bin/env bash
# Sets up whatever is missing, builds, and runs every test: the Catch2 tests
# through ctest, then the pytest tests against the same build.
#   scripts/test.sh                 # everything
#   scripts/test.sh -R adam         # extra arguments go to ctest
# An unfiltered run also checks that ctest ran (or skipped) every test case
# the Catch2 binaries list, so a case whose ctest entry selects nothing fails.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
build=${STRIDER_BUILD_DIR:-$here/build}

# Arguments that choose which tests run: with one, not every case is expected.
filtered=""
for a in "$@"; do
  case "$a" in
    -R*|-E*|-L*|-I*|-U|-N|-FA*|-FS*|-FC*|--tests-regex*|--exclude-regex*|--label-*|\
    --tests-information*|--rerun-failed|--fixture-exclude-*|--exclude-fixture*|--tests-from-file*|\
    --exclude-from-file*|--show-only*|--union) filtered="$a" ;;
  esac
done

junit="$build/Testing/strider-ctest-junit.xml"
extra=()
if [ -z "$filtered" ]; then
  rm -f "$junit"
  extra=(--output-junit "$junit")
fi
ctest --test-dir "$build" --output-on-failure -j "${STRIDER_JOBS:-$(nproc)}" "${extra[@]}" "$@"
if [ -z "$filtered" ]; then
  "$here/.venv/bin/python" "$here/scripts/check_catch_cases.py" "$build" "$junit"
else
  echo "test.sh: '$filtered' filters the run; not checking that every Catch2 case ran"
fi

if compgen -G "$here/tests/python/test_*.py" >/dev/null; then
  # A skip for a reason not on conftest.py's ALLOWED_SKIPS fails the run.
  STRIDER_STRICT_SKIPS=1 STRIDER_BUILD_DIR="$build" "$here/.venv/bin/python" -m pytest -q "$here/tests/python"
fi
