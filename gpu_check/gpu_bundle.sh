#!/usr/bin/env bash
# gpu_check/gpu_bundle.sh [DIR]: the Debian packages a bare GPU machine lacks,
# downloaded (not installed) into DIR (default .gpu-bundle/, ignored by git),
# so that gpu_check/gpu_check.sh can build strider there without a network.
#
# The GPU image has CUDA, CMake, ninja, g++ and a Python with torch, but none
# of the C++ libraries strider links besides those. This fetches their
# development packages and the runtime packages those need, at the versions
# this machine builds against (the installed ones, else the candidates), with
# `apt-get download` (no root, nothing installed). gpu_check.sh unpacks them
# into a private prefix (dpkg-deb -x, never into /) and points CMake there.
#
# The closure is checked, not assumed: every Depends of every package must be
# in the bundle or in BASE below (what any glibc + libstdc++ image with a
# compiler has). A dependency outside both fails this script, naming it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$here/.gpu-bundle}

# Headers + CMake configs, and the shared libraries they link (libtbb-dev's
# TBBTargets.cmake checks that tbbmalloc, tbbmalloc_proxy and tbbbind exist).
PKGS=(liburing-dev liburing2
      libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
      libfmt-dev libfmt9
      libxxhash-dev libxxhash0
      libtomlplusplus-dev libtomlplusplus3
      libinih-dev libinih1 libinireader0
      catch2 nlohmann-json3-dev libcli11-dev)
# Not bundled: the C runtime and compiler support any build machine has, and
# libhwloc15, which only libtbbbind needs; oneTBB loads tbbbind at run time
# and runs without it (no NUMA binding) when hwloc is missing.
# No pkg-config either: cmake/find_c_library.cmake finds liburing and xxhash
# with find_path/find_library in CMAKE_PREFIX_PATH.
BASE=(libc6 libc6-dev libc-dev libgcc-s1 libstdc++6 linux-libc-dev libhwloc15)

say() { printf '[gpu_bundle] %s\n' "$*"; }

version_of() {  # installed version, else the candidate
  local v
  v=$(dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null | awk '$3 == "installed" {print $4}')
  [ -n "$v" ] || v=$(apt-cache policy "$1" | awk '/Candidate:/ {print $2}')
  if [ -z "$v" ] || [ "$v" = "(none)" ]; then
    echo "gpu_bundle: package $1 is neither installed nor known to apt (run apt-get update)" >&2
    return 1
  fi
  printf '%s' "$v"
}

# 1. The closure: each Depends alternative group must be met by the bundle or BASE.
in_list() { local x=$1; shift; for y in "$@"; do [ "$x" = "$y" ] && return 0; done; return 1; }
missing=()
for p in "${PKGS[@]}"; do
  v=$(version_of "$p")
  deps=$(apt-cache show "$p=$v" | awk -F': ' '/^(Pre-)?Depends:/ {print $2; exit}')
  IFS=',' read -ra groups <<< "$deps"
  for g in "${groups[@]}"; do
    met=false
    IFS='|' read -ra alts <<< "$g"
    for a in "${alts[@]}"; do
      name=$(echo "$a" | sed -E 's/\(.*\)//; s/:any//; s/[[:space:]]//g')
      [ -z "$name" ] && continue
      if in_list "$name" "${PKGS[@]}" || in_list "$name" "${BASE[@]}"; then met=true; break; fi
    done
    $met || missing+=("$p needs '$(echo "$g" | xargs)'")
  done
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'gpu_bundle: dependency not in the bundle nor in BASE: %s\n' "${missing[@]}" >&2
  exit 1
fi

# 2. Download, into a fresh folder so that no stale version stays behind.
tmp=$(mktemp -d "${dest%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
specs=()
for p in "${PKGS[@]}"; do specs+=("$p=$(version_of "$p")"); done
say "downloading ${#specs[@]} packages into $dest"
(cd "$tmp" && apt-get download -qq "${specs[@]}" 2>&1 | grep -v 'unsandboxed as root' >&2 || true)
for p in "${PKGS[@]}"; do
  compgen -G "$tmp/${p}_*.deb" >/dev/null || { echo "gpu_bundle: apt-get download gave no .deb for $p" >&2; exit 1; }
done

# 3. A manifest gpu_check.sh verifies before it unpacks: package, version, file, sha256.
{
  echo "# strider GPU bundle: Debian $(cat /etc/debian_version 2>/dev/null || echo '?'), made $(date -u +%Y-%m-%dT%H:%M:%SZ) by gpu_check/gpu_bundle.sh"
  for p in "${PKGS[@]}"; do
    f=$(cd "$tmp" && ls "${p}"_*.deb)
    printf '%s %s %s %s\n' "$p" "$(version_of "$p")" "$f" "$(sha256sum "$tmp/$f" | cut -d' ' -f1)"
  done
} > "$tmp/MANIFEST"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
say "$(du -sh "$dest" | cut -f1) in $dest ($(ls "$dest"/*.deb | wc -l) packages); tree + bundle: $(du -sh --exclude=.git --exclude='build*' --exclude=.venv "$here" | cut -f1)"
