#!/usr/bin/env bash
# Sets up whatever is missing, builds, and runs strider's main job on its
# built-in default. Until the engine lands (issue 6) that job is the optimizer
# benchmark: CpuAdam against the machine's memory roofline and torch's fused
# AdamW, 16M and 256M parameters, 1..all threads.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/scripts/setup.sh"
build=${STRIDER_BUILD_DIR:-$here/build}
exec "$build/bench/bench_adam" "$@"
