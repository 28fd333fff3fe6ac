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

# ATEN_CPU_CAPABILITY=avx2 (or default) on an AVX-512 machine runs another
# machine's ATen kernels. oneDNN must be held to the same ISA: otherwise
# torch's bf16 flash attention takes oneDNN's packed path (chosen by what the
# CPU has) from its AVX2 kernels and throws "pack_vnni2 is only supported
# when avx512 is supported".
if [ -n "${ATEN_CPU_CAPABILITY:-}" ] && [ -z "${ONEDNN_MAX_CPU_ISA:-}${DNNL_MAX_CPU_ISA:-}" ]; then
  case "$ATEN_CPU_CAPABILITY" in
    avx2) export ONEDNN_MAX_CPU_ISA=AVX2 ;;
    default) export ONEDNN_MAX_CPU_ISA=SSE41 ;;
  esac
  echo "test.sh: ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY, so ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset}"
fi

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
