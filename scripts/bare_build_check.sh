#!/usr/bin/env bash
# scripts/bare_build_check.sh [OUT_DIR [BUILD_DIR]]: proves, on this machine, that
# gpu_check/gpu_check.sh builds and runs with the GPU bundle alone, against the
# oldest torch strider supports, as on the bare GPU machine.
#
# It runs `gpu_check/gpu_check.sh --cpu OUT_DIR BUILD_DIR` (default
# /tmp/strider-bare-check and build-bare/) inside a private mount namespace
# (unshare -m, root) where
#   - every file of the bundled Debian packages that this machine has installed
#     (headers, libraries, CMake configs, .pc files: liburing, oneTBB, fmt,
#     xxhash, Catch2, nlohmann-json, CLI11) is whited out with an overlay, so
#     it does not exist there, and pkg-config is gone too;
#   - the project's .venv (torch 2.15) is an empty folder;
#   - the Python is a torch 2.11 environment outside the repository,
#     $STRIDER_TORCH211_VENV (default ~/.cache/strider/venv-torch211), made
#     here with pip from the package index if missing (torch==2.11.0, the
#     default CUDA 13.0 wheel, and transformers 5.17 as on the GPU image).
# The namespace ends with the script; nothing outside it changes except the
# build folder, OUT_DIR and the compiler cache ~/.cache/strider/ccache-bare
# (kept apart from the project's). Exit status: gpu_check.sh's.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/tmp/strider-bare-check}
build=${2:-$here/build-bare}
venv=${STRIDER_TORCH211_VENV:-$HOME/.cache/strider/venv-torch211}
say() { printf '[bare_build_check] %s\n' "$*"; }

if [ "${STRIDER_BARE_NS:-}" != 1 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "bare_build_check: needs root for unshare -m and overlay mounts" >&2; exit 1; }
  if [ ! -f "$venv/.complete" ]; then
    say "creating $venv: torch 2.11.0 from the package index (a few GiB, once)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q torch==2.11.0 transformers==5.17.0 numpy safetensors pytest "scikit-build-core==1.1.2"
    touch "$venv/.complete"
  fi
  [ -f "$here/.gpu-bundle/MANIFEST" ] || "$here/gpu_check/gpu_bundle.sh"
  # Every path the bundle's packages installed on this machine, from dpkg's own lists.
  pkgs=$(awk '!/^#/ && NF {print $1}' "$here/.gpu-bundle/MANIFEST")
  STRIDER_BARE_NS=1 STRIDER_BARE_PKGS="$pkgs" exec unshare -m "$0" "$@"
fi

# ---- inside the namespace -------------------------------------------------------------------------------
mount --make-rprivate /
scratch=$(mktemp -d /tmp/strider-bare-ns.XXXXXX)
mount -t tmpfs tmpfs "$scratch"
n=0
# hide DIR NAME...: an overlay on DIR whose upper layer whites out each NAME (a path below DIR).
hide() {
  local dir=$1; shift
  n=$((n + 1))
  local up=$scratch/up$n wk=$scratch/wk$n
  mkdir -p "$up" "$wk"
  for name in "$@"; do
    mkdir -p "$up/$(dirname "$name")"
    mknod "$up/$name" c 0 0
  done
  mount -t overlay overlay -o "lowerdir=$dir,upperdir=$up,workdir=$wk" "$dir"
}
# The installed files of the bundled packages (and pkg-config's), grouped by the
# top folder they live in, each hidden at its topmost path below that folder
# that belongs to the package alone (a folder such as /usr/include/tbb, or a file).
declare -A hidden
files=$(dpkg -L $STRIDER_BARE_PKGS pkg-config pkgconf pkgconf-bin 2>/dev/null | sort -u)
for f in $files; do
  [ -f "$f" ] || [ -L "$f" ] || continue
  case "$f" in
    /usr/include/*) top=/usr/include ;;
    /usr/lib/x86_64-linux-gnu/*) top=/usr/lib/x86_64-linux-gnu ;;
    /usr/lib/cmake/*) top=/usr/lib/cmake ;;
    /usr/share/cmake/*) top=/usr/share/cmake ;;
    /usr/share/pkgconfig/*) top=/usr/share/pkgconfig ;;
    /usr/bin/*) top=/usr/bin ;;
    *) continue ;;  # docs, man pages
  esac
  rel=${f#"$top"/}
  # A folder directly below top that only these packages populate goes as a whole (tbb/, fmt/, cmake/TBB/).
  first=${rel%%/*}
  if [ "$first" != "$rel" ] && [ "$first" != cmake ] && [ "$first" != pkgconfig ]; then rel=$first
  elif [ "$first" = cmake ] && [ "${rel#cmake/}" != "${rel#cmake/*/}" ]; then rel=cmake/$(echo "${rel#cmake/}" | cut -d/ -f1)
  fi
  hidden[$top]+="$rel"$'\n'
done
for top in "${!hidden[@]}"; do
  mapfile -t names < <(printf '%s' "${hidden[$top]}" | sort -u)
  hide "$top" "${names[@]}"
  say "hidden under $top: ${names[*]}"
done
# The project's environment (torch 2.15): an empty folder where its .venv points.
if [ -e "$here/.venv" ]; then
  mount -t tmpfs tmpfs "$(readlink -f "$here/.venv")"
  say "hidden: the project's .venv ($(readlink -f "$here/.venv"))"
fi

# Proof that they are gone, before anything is built.
for p in /usr/include/liburing.h /usr/include/tbb /usr/include/oneapi /usr/include/fmt /usr/include/xxhash.h \
         /usr/include/catch2 /usr/include/nlohmann /usr/include/CLI /usr/lib/x86_64-linux-gnu/libtbb.so.12 \
         /usr/lib/x86_64-linux-gnu/libfmt.so.9 /usr/lib/x86_64-linux-gnu/liburing.so.2 \
         /usr/lib/x86_64-linux-gnu/libxxhash.so.0 /usr/lib/x86_64-linux-gnu/cmake/TBB /usr/lib/cmake/Catch2 \
         /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 /usr/bin/pkg-config "$here/.venv/bin/python"; do
  if [ -e "$p" ]; then echo "bare_build_check: $p is still visible: the namespace does not hide it" >&2; exit 1; fi
done
if echo '#include <fmt/core.h>' | g++ -x c++ -fsyntax-only - 2>/dev/null; then
  echo "bare_build_check: g++ still finds <fmt/core.h>" >&2; exit 1
fi
say "the system's liburing, oneTBB, fmt, xxhash, Catch2, nlohmann-json, CLI11, pkg-config and the project's .venv are hidden"
say "python: $venv/bin/python ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"

export STRIDER_PYTHON=$venv/bin/python
export CCACHE_DIR=$HOME/.cache/strider/ccache-bare
set +e
"$here/gpu_check/gpu_check.sh" --cpu "$out" "$build"
rc=$?
say "gpu_check/gpu_check.sh --cpu exited $rc (summary: $out/gpu_check.json)"
exit $rc
