#!/usr/bin/env bash
# Installs whatever is missing on a fresh machine, then configures and builds.
# Idempotent: a second run installs nothing and rebuilds only what changed.
#
#   scripts/setup.sh            # Debian packages, Python env, CMake build in build/
#   STRIDER_NO_BUILD=1 scripts/setup.sh   # stop after the installs
#
# The Python environment and the compiler cache live outside the clone, keyed by
# requirements.txt, so a fresh clone (CI's) reuses them instead of reinstalling
# torch and rebuilding everything.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache_root=${STRIDER_CACHE:-$HOME/.cache/strider}
mkdir -p "$cache_root"

say() { printf '[setup] %s\n' "$*"; }

# 1. Debian packages: libraries the C++ side links and tools the tests call.
debs=(cmake ninja-build ccache g++ pkg-config liburing-dev libtbb-dev catch2
      nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libinih-dev libfmt-dev libxxhash-dev libgloo-dev
      fio python3-venv)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The Python environment, keyed by the pinned requirements.
key=$(sha256sum "$here/requirements.txt" | cut -c1-12)
venv="$cache_root/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  say "creating Python environment $venv (torch is large: this takes minutes once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r "$here/requirements.txt"
  touch "$venv/.complete"
fi
# This checkout's own thin environment over the shared one: `import strider`
# and `python -m strider.data` work from any directory, each checkout seeing
# its own package. The heavy environment is shared by every checkout on
# purpose (keyed by the pinned requirements); .venv is a venv of the same
# interpreter without packages, whose path files add the shared one's
# site-packages (their own path files included) and this checkout's
# python_shim/ by its absolute path.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/strider-checkout.pth"  # an earlier setup's: the working directory's python_shim/
if [ -L "$here/.venv" ] || [ ! -f "$here/.venv/pyvenv.cfg" ]; then
  rm -rf "$here/.venv"
  "$venv/bin/python" -m venv --without-pip "$here/.venv"
fi
thin=$("$here/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site; site.addsitedir(%s)\n' "'$site'" >"$thin/00-strider-shared.pth"
printf '%s\n' "$here/python_shim" >"$thin/strider-checkout.pth"
# The build backend of `pip install --no-build-isolation .` (pyproject.toml).
# Not in requirements.txt on purpose: the environment's key would change, and
# with it torch's include paths, so every ATen object would miss the compiler
# cache for the sake of a packaging tool.
if ! "$venv/bin/python" -c 'import scikit_build_core' 2>/dev/null; then
  "$venv/bin/pip" install -q "scikit-build-core==1.1.2"
fi

[ "${STRIDER_NO_BUILD:-0}" = 1 ] && exit 0

# 3. Configure and build. ccache lives beside the environment, shared by clones.
export CCACHE_DIR="$cache_root/ccache"
export CCACHE_BASEDIR="$here"       # so a clone in another folder still hits
export CCACHE_NOHASHDIR=1
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
build=${STRIDER_BUILD_DIR:-$here/build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DSTRIDER_PYTHON="$venv/bin/python" ${STRIDER_CMAKE_ARGS:-}
fi
# STRIDER_BUILD_TARGETS: only these (scripts/demo.sh builds the command line
# it runs; the test command builds everything).
# shellcheck disable=SC2086
cmake --build "$build" -j "${STRIDER_JOBS:-$(nproc)}" ${STRIDER_BUILD_TARGETS:+--target $STRIDER_BUILD_TARGETS}
