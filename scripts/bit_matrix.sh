#!/usr/bin/env bash
# The trained state's bits under a matrix of engine configurations (K, tiers,
# shards, kept activations, q8, tied, clipping on and off, 2 ranks), with
# ATen's thread count fixed, and before them a hash of each compiled step
# program under a wider matrix (pools, sub-layer pieces, experts, a quantized
# LoRA base, compute copies on NVMe, fp16, ranks): a restructuring of the
# engine must change none of either.
#   scripts/bit_matrix.sh record [FILE]   # before the change
#   scripts/bit_matrix.sh check [FILE]    # after each step: exits 1 on any difference
# FILE defaults to ~/.cache/strider/bit-matrix.txt: the bits belong to this
# machine (its CPU's kernels), so they are not committed and no CI test reads them.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${STRIDER_BUILD_DIR:-$here/build}
mode=${1:-check}
file=${2:-${STRIDER_CACHE:-$HOME/.cache/strider}/bit-matrix.txt}
cmake --build "$build" --target bit_matrix >/dev/null
export OMP_NUM_THREADS=1
case "$mode" in
  record)
    mkdir -p "$(dirname "$file")"
    "$build/tests/engine/bit_matrix" | tee "$file.new"
    mv "$file.new" "$file"
    echo "bit_matrix: recorded $(wc -l <"$file") configurations in $file" ;;
  check)
    [ -f "$file" ] || { echo "bit_matrix: no record at $file (run '$0 record' before the change)" >&2; exit 2; }
    now=$(mktemp)
    "$build/tests/engine/bit_matrix" >"$now" || true
    if diff -u "$file" "$now"; then
      echo "bit_matrix: all $(wc -l <"$file") configurations bit-identical to $file"
      rm -f "$now"
    else
      echo "bit_matrix: the bits changed (above: - recorded, + now)" >&2
      rm -f "$now"
      exit 1
    fi ;;
  *) echo "usage: $0 record|check [FILE]" >&2; exit 2 ;;
esac
