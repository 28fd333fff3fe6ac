#!/usr/bin/env bash
# gpu_check/gpu_check.sh [--cpu] OUT_DIR [BUILD_DIR]: proves strider on a bare GPU machine, in one command.
#
# The GPU machine has CUDA, CMake, ninja, g++ and a Python with torch (>= 2.11),
# transformers and safetensors, but none of the C++ libraries strider links and
# no network. This script
#   1. unpacks the Debian packages of .gpu-bundle/ (gpu_check/gpu_bundle.sh made
#      it, here; it travels with the tree) into BUILD_DIR/prefix with dpkg-deb -x,
#      never into /, after checking them against the bundle's MANIFEST;
#   2. configures CMake against that prefix and that machine's own torch
#      ($STRIDER_PYTHON, else python3) and builds only the targets the checks
#      run, with every core; the binaries find the prefix's shared libraries
#      through their build RPATH (checked with ldd before anything runs);
#   3. runs the checks (gpu_check/gpu_check.py): the [cuda] Catch2 tests; the
#      engine on CUDA against the engine on the CPU device and against
#      transformers + AdamW (gpu_check/gpu_engine_check.py); measured peak device
#      memory against the plan (gpu_check/gpu_memory_check.py); speed (`strider
#      profile` on a 1.1B model made on the spot, bench_transfer's PCIe GB/s);
#      precision (the same model's losses and speed in bf16, fp16, and fp16
#      with --matmul-accumulate fp16: that setting's quality figure); the
#      simulator calibrated on the GPU (bench_calibrate --device cuda).
# OUT_DIR receives gpu_check.json (the summary: every check's status and
# figures, the build's too, also when it fails), gpu_check_logs/ (every step's
# stdout/stderr, written there as it goes, so a run stopped from outside keeps
# them) and gpu_check_logs.tar.gz (the same, packed at the end).
#
# A second run with the same BUILD_DIR skips the build and every check that
# passed, while the tree, the bundle and the torch are the same (stamps in
# BUILD_DIR/gpu-check/). Meant to take under 5 minutes on a cold GPU machine.
#
# --cpu: the dry run. The same logic (bundle, prefix, build, every check) on the
# CPU device: the engine check on the CPU device (with chaos delays, against the
# plain CPU device and transformers on the CPU), the memory and speed checks on
# smaller models, calibration with --device cpu and fewer rounds; the [cuda]
# tests must report skipped. 5 minutes from cold on the idle 2-core development
# machine (4 of them the build), 1.5 with a warm compiler cache.
#
# STRIDER_GPU_CHECK_DEADLINE_S=N: the checks end within N seconds of the start
# (a check that would start later is reported as not run); the summary is
# rewritten after every check, so a run stopped from outside leaves one too.
# Default 540: one 600 s call of the device tool, build included, with a
# minute left to write the summary and bring OUT_DIR back.
#
# Exit status 0 when every check holds; 1 otherwise (gpu_check.json says which).
set -uo pipefail

mode=gpu
if [ "${1:-}" = "--cpu" ]; then mode=cpu; shift; fi
out=${1:?usage: gpu_check/gpu_check.sh [--cpu] OUT_DIR [BUILD_DIR]}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${2:-$repo/build-gpu-check}
bundle=${STRIDER_GPU_BUNDLE:-$repo/.gpu-bundle}
export STRIDER_GPU_CHECK_T0=${STRIDER_GPU_CHECK_T0:-$(date +%s.%N)}
export STRIDER_GPU_CHECK_DEADLINE_S=${STRIDER_GPU_CHECK_DEADLINE_S:-540}
mkdir -p "$out" "$build" && out=$(cd "$out" && pwd) && build=$(cd "$build" && pwd)
prefix=$build/prefix
state=$build/gpu-check          # stamps and the build's key
logs=$out/gpu_check_logs        # under OUT_DIR as they are written (gpu_check/gpu_check.py packs them too)
mkdir -p "$logs" "$state"
jobs=${STRIDER_JOBS:-$(nproc 2>/dev/null || echo 4)}
log() { echo "gpu_check: $*" | tee -a "$logs/gpu_check.log"; }
: > "$logs/gpu_check.log"
log "mode $mode, tree $repo, build $build, out $out, $(date -u +%FT%TZ)"

# The summary is written by gpu_check.py whatever happens here; a step that
# fails before it records why in build.json.
build_status() {  # status message
  printf '{"status": "%s", "message": "%s", "key": "%s", "t0": %s, "t1": %s}\n' "$1" "$2" "${key:-}" \
    "${build_t0:-$STRIDER_GPU_CHECK_T0}" "$(date +%s.%N)" > "$state/build.json"
}
summarize() {
  "$python" "$repo/gpu_check/gpu_check.py" --mode "$mode" --repo "$repo" --build "$build" --out "$out" --jobs "$jobs"
  exit $?
}

# 0. The Python whose torch the build links and the checks use.
python=${STRIDER_PYTHON:-}
if [ -z "$python" ] && [ -x "$repo/.venv/bin/python" ] && "$repo/.venv/bin/python" -c 'import torch' 2>/dev/null; then
  python=$repo/.venv/bin/python
fi
[ -n "$python" ] || python=$(command -v python3 || true)
# The GPU image's torch environment, should its python3 not be first on PATH.
if [ -x /opt/torch/.venv/bin/python3 ] && ! "${python:-false}" -c 'import torch' 2>/dev/null; then
  python=/opt/torch/.venv/bin/python3
fi
if [ -z "$python" ] || ! torch_line=$("$python" -c 'import sys, torch; print(torch.__version__, torch.version.cuda, sys.version.split()[0])' 2>>"$logs/gpu_check.log"); then
  log "no Python with torch (set STRIDER_PYTHON): nothing can be built or checked"
  # No Python to write the summary with: the build's status by hand.
  printf '{"mode": "%s", "ok": false, "build": {"status": "failed", "message": "no Python with torch (set STRIDER_PYTHON)"}, "checks": {}}\n' \
    "$mode" > "$out/gpu_check.json"
  exit 1
fi
python=$(command -v "$python")
log "python $python: torch, CUDA, Python = $torch_line"
{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } > "$logs/nvidia-smi.txt"

# 1. The bundle: verified against its manifest, unpacked once per manifest.
if [ ! -f "$bundle/MANIFEST" ]; then
  if [ "$mode" = cpu ] && command -v apt-get >/dev/null; then
    log "no bundle at $bundle: making it (gpu_check/gpu_bundle.sh)"
    "$repo/gpu_check/gpu_bundle.sh" "$bundle" >> "$logs/gpu_check.log" 2>&1 || { build_status failed "gpu_check/gpu_bundle.sh failed"; summarize; }
  else
    log "no bundle at $bundle: run gpu_check/gpu_bundle.sh on a Debian 12 machine with network first"
    build_status failed "no bundle at $bundle (gpu_check/gpu_bundle.sh makes it)"; summarize
  fi
fi
manifest_hash=$(sha256sum "$bundle/MANIFEST" | cut -c1-16)
if [ "$(cat "$prefix/.manifest" 2>/dev/null)" != "$manifest_hash" ]; then
  rm -rf "$prefix" && mkdir -p "$prefix"
  while read -r pkg version file sha; do
    case "$pkg" in ''|'#'*) continue ;; esac
    if [ ! -f "$bundle/$file" ] || [ "$(sha256sum "$bundle/$file" | cut -d' ' -f1)" != "$sha" ]; then
      log "bundle: $bundle/$file ($pkg $version) is missing or its sha256 differs from MANIFEST: remake the bundle"
      build_status failed "bundle file $file missing or damaged"; summarize
    fi
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$bundle/$file" "$prefix"
    else  # a .deb is an ar archive holding data.tar.*; GNU tar picks the decompressor from the file
      tmp=$(mktemp -d) && member=$(ar t "$bundle/$file" | grep '^data\.tar') &&
        (cd "$tmp" && ar x "$bundle/$file" "$member") && tar -xf "$tmp/$member" -C "$prefix" && rm -rf "$tmp"
    fi || { log "bundle: cannot unpack $file"; build_status failed "cannot unpack $file"; summarize; }
  done < "$bundle/MANIFEST"
  echo "$manifest_hash" > "$prefix/.manifest"
  log "unpacked $(grep -vc '^#' "$bundle/MANIFEST") packages into $prefix"
fi

# 2. Configure and build, unless this tree, bundle and torch were built already.
tree_hash=$(cd "$repo" && find CMakeLists.txt pyproject.toml cmake host io gpu engine python_shim bench gpu_check tests -type f \
              ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
key="tree-$tree_hash bundle-$manifest_hash torch-$(echo "$python $torch_line" | sha256sum | cut -c1-12)"
echo "$key" > "$state/key"
build_t0=$(date +%s.%N)
if [ "$(cat "$state/build.stamp" 2>/dev/null)" = "$key" ] && [ -f "$build/strider" ]; then
  log "build: this tree, bundle and torch were built already ($key): skipped"
  build_status cached "built by an earlier run"
  summarize
fi
rm -f "$state/build.stamp"
lib=$prefix/usr/lib/x86_64-linux-gnu
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DSTRIDER_WITH_CUDA=ON -DSTRIDER_WITH_TORCH=ON "-DSTRIDER_PYTHON=$python"
            "-DCMAKE_PREFIX_PATH=$prefix/usr"
            # The configs by name, so that a copy elsewhere on the machine never mixes in.
            "-DTBB_DIR=$lib/cmake/TBB" "-Dfmt_DIR=$lib/cmake/fmt" "-DCatch2_DIR=$prefix/usr/lib/cmake/Catch2"
            "-Dnlohmann_json_DIR=$prefix/usr/share/cmake/nlohmann_json" "-DCLI11_DIR=$prefix/usr/share/cmake/CLI11"
            "-Dtomlplusplus_DIR=$lib/cmake/tomlplusplus")
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
# Only this GPU's architecture: half the nvcc time of the default "89;90".
if [ "$mode" = gpu ] && cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1) && [ -n "$cc" ]; then
  cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=${cc//./}")
fi
log "configure: cmake ${cmake_args[*]}"
if ! cmake -S "$repo" -B "$build" "${cmake_args[@]}" > "$logs/configure.log" 2>&1; then
  log "configure failed (see configure.log in the logs archive)"; tail -20 "$logs/configure.log"
  build_status failed "cmake configure failed"; summarize
fi
cuda=OFF
grep -q 'strider: CUDA=ON' "$logs/configure.log" && cuda=ON
if [ "$mode" = gpu ] && [ "$cuda" = OFF ]; then
  log "CMake found no CUDA toolkit (nvcc); see configure.log"
  build_status failed "no CUDA toolkit found by CMake"; summarize
fi
targets=(gpu_test strider strider_ops bench_calibrate)
[ "$cuda" = ON ] && targets+=(bench_transfer)
log "build ${targets[*]} with -j$jobs (CUDA=$cuda)"
if ! cmake --build "$build" -j "$jobs" --target "${targets[@]}" > "$logs/build.log" 2>&1; then
  log "build failed (see build.log in the logs archive)"; grep -m5 -E 'error|Error' "$logs/build.log"; tail -15 "$logs/build.log"
  build_status failed "build failed"; summarize
fi
# Every binary must find its shared libraries without the system's copies.
unresolved=$(for f in "$build/strider" "$build/tests/gpu/gpu_test" "$build/bench/bench_calibrate" \
                      "$build/python_shim/libstrider_ops.so"; do ldd "$f" | sed "s|^|$(basename "$f"): |"; done | grep 'not found')
if [ -n "$unresolved" ]; then
  log "binaries with unresolved shared libraries:"; echo "$unresolved" | tee -a "$logs/gpu_check.log"
  build_status failed "unresolved shared libraries"; summarize
fi
ldd "$build/strider" | grep -E 'tbb|fmt|uring|xxhash|torch' >> "$logs/gpu_check.log"
echo "$key" > "$state/build.stamp"
build_status built "built $(printf '%s ' "${targets[@]}")"
log "build done"
summarize
