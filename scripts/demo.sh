#!/usr/bin/env bash
# Sets up whatever is missing, builds, and runs strider's main job on its
# built-in default: `strider finetune` with no model or data given fine-tunes
# the built-in model on generated data on the CPU device (or a GPU when one is
# usable) under a small device budget, so the window slides. Extra arguments
# go to `strider finetune` (see build/strider finetune --help).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# The demo builds what it runs, the command line (a fresh machine: minutes,
# not the tests' 200-odd targets); scripts/test.sh builds the rest.
STRIDER_BUILD_TARGETS=${STRIDER_BUILD_TARGETS:-strider} "$here/scripts/setup.sh"
build=${STRIDER_BUILD_DIR:-$here/build}
cd "$here"
exec "$build/strider" finetune "$@"
