#!/usr/bin/env bash
# gpu_check.sh OUT_DIR [BUILD_DIR]: on a GPU machine, build gpu/ with CUDA, run
# the [cuda] tests and bench_transfer, and write JSON (and logs) to OUT_DIR.
#   OUT_DIR/cuda_tests.log      Catch2 output of `gpu_test [cuda]`
#   OUT_DIR/seam_tests.log      the CPU seam tests, for comparison
#   OUT_DIR/bench_transfer.json bench_transfer's JSON line
#   OUT_DIR/bench_calibrate.json bench_calibrate --device cuda's JSON line: the
#                               simulator fed with this GPU's isolated costs vs
#                               the GPU's measured step (needs torch; with it,
#                               `strider` is built too)
#   OUT_DIR/gpu_check.json      summary: return codes, whether tests ran or skipped, the bench lines
# Takes a few minutes on one GPU (most of it compiling). Exits non-zero when a
# step fails or when the [cuda] tests skipped because no GPU was usable.
set -uo pipefail

out=${1:?usage: bench/gpu_check.sh OUT_DIR [BUILD_DIR]}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${2:-$repo/build-gpu-check}
mkdir -p "$out" && out=$(cd "$out" && pwd)
jobs=$(nproc 2>/dev/null || echo 4)
log() { echo "gpu_check: $*" | tee -a "$out/gpu_check.log"; }

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed (see nvidia-smi.txt)"

# torch is optional here: without it the CUDA seam, the pool and the bench
# still build; only the ATen unit-view test drops out.
python=${STRIDER_PYTHON:-$repo/.venv/bin/python}
torch_args=(-DSTRIDER_WITH_TORCH=OFF)
if [ -x "$python" ] && "$python" -c 'import torch' >/dev/null 2>&1; then
  torch_args=(-DSTRIDER_WITH_TORCH=ON "-DSTRIDER_PYTHON=$python")
fi
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)

log "configure $build (${torch_args[*]})"
if ! cmake -S "$repo" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSTRIDER_WITH_CUDA=ON \
     "${torch_args[@]}" > "$out/configure.log" 2>&1; then
  log "configure failed (see configure.log)"; tail -20 "$out/configure.log"; exit 1
fi
if ! grep -q 'strider: CUDA=ON' "$out/configure.log"; then
  log "CMake found no CUDA toolkit (see configure.log)"; exit 1
fi
log "build gpu_test gpu_seam_test bench_transfer with -j$jobs"
if ! cmake --build "$build" -j"$jobs" --target gpu_test gpu_seam_test bench_transfer > "$out/build.log" 2>&1; then
  log "build failed (see build.log)"; tail -30 "$out/build.log"; exit 1
fi

tests=$build/tests/gpu
timeout 300 "$tests/gpu_test" "[cuda]" -d yes > "$out/cuda_tests.log" 2>&1
cuda_rc=$?
timeout 120 "$tests/gpu_seam_test" > "$out/seam_tests.log" 2>&1
seam_rc=$?
cuda_skipped=false
grep -q 'skipped: no GPU' "$out/cuda_tests.log" && cuda_skipped=true
log "[cuda] tests rc=$cuda_rc skipped=$cuda_skipped; seam tests rc=$seam_rc"
tail -3 "$out/cuda_tests.log"

timeout 180 "$build/bench/bench_transfer" --out "$out/bench_transfer.json" | tee "$out/bench_transfer.log"
bench_rc=${PIPESTATUS[0]}
bench_json=$(tail -n 1 "$out/bench_transfer.json" 2>/dev/null)
[ -n "$bench_json" ] || bench_json=null

# The calibration: strider and bench_calibrate link the engine, which needs torch.
calib_rc=-1  # not run
calib_json=null
if [ "${torch_args[0]}" = "-DSTRIDER_WITH_TORCH=ON" ]; then
  log "build strider bench_calibrate with -j$jobs"
  if cmake --build "$build" -j"$jobs" --target strider bench_calibrate > "$out/build_calibrate.log" 2>&1; then
    timeout 300 "$build/bench/bench_calibrate" --device cuda > "$out/bench_calibrate.log" 2>&1
    calib_rc=$?
    tail -n 25 "$out/bench_calibrate.log"
    calib_json=$(tail -n 1 "$out/bench_calibrate.log")
    if [ "$calib_rc" -eq 0 ] && [ "${calib_json:0:1}" = "{" ]; then
      printf '%s\n' "$calib_json" > "$out/bench_calibrate.json"
    else
      calib_json=null
    fi
  else
    calib_rc=1
    log "build of strider/bench_calibrate failed (see build_calibrate.log)"; tail -30 "$out/build_calibrate.log"
  fi
  log "bench_calibrate rc=$calib_rc"
else
  log "no torch at $python: bench_calibrate (and strider) not built"
fi

printf '{"cuda_tests_rc":%d,"cuda_tests_skipped":%s,"seam_tests_rc":%d,"bench_rc":%d,"bench":%s,"calibrate_rc":%d,"calibrate":%s}\n' \
  "$cuda_rc" "$cuda_skipped" "$seam_rc" "$bench_rc" "$bench_json" "$calib_rc" "$calib_json" | tee "$out/gpu_check.json"

[ "$cuda_rc" -eq 0 ] && [ "$seam_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$cuda_skipped" = false ] &&
  { [ "$calib_rc" -eq 0 ] || [ "$calib_rc" -eq -1 ]; }
