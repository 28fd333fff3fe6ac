#!/usr/bin/env python3
"""Fails unless ctest ran (or skipped, for a reason the build allows) every
Catch2 test case of the build.

catch_discover_tests turns each test case a Catch2 binary lists into one ctest
entry that runs the binary on that name. A name it cannot carry through (a ';'
splits it in two) gives entries that select nothing, and such an entry passes
in 0.01 s while its test case never runs. So this compares the binaries' own
lists with what ctest ran:

  check_catch_cases.py BUILD_DIR JUNIT_XML

A skip must say why in its output, and the reason must be one this build
has: "skipped: no GPU" (a [cuda] case on a machine without one), or
"skipped: this build has no c10d Gloo" only in a build without gloo headers
(BUILD_DIR/strider_features.json, written by CMake, says which), "skipped:
cannot mount a tmpfs" (a full-disk case in a container that may not mount
one, as CI's), or "skipped: under ThreadSanitizer" (a case that races on
purpose). Any other
skip fails the run, so a case cannot pass by skipping in silence.

BUILD_DIR: the build ctest ran in; JUNIT_XML: that run's --output-junit file.
The Catch2 entries are the tests labelled "catch2" in `ctest --show-only=json-v1`
(tests/CMakeLists.txt's strider_test labels them); each one's command names
its binary and the test case it selects.
"""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

LABEL = "catch2"


def catch_names(binary):
    """The binary's test cases, as --list-test-names-only prints them (its exit
    status is the count, so it is not an error)."""
    out = subprocess.run([binary, "--list-test-names-only"], capture_output=True, text=True,
                         timeout=120).stdout
    names = []
    for line in out.splitlines():
        if not line.strip():
            continue
        # Catch2 v2 quotes names that begin with '#'.
        if line.startswith('"#') and line.endswith('"'):
            line = line[1:-1]
        names.append(line)
    return names


def selected_name(spec):
    """The test case a command's test spec selects: CatchAddTests.cmake
    escapes ',', '[' and ']' with a backslash."""
    for c in ",[]":
        spec = spec.replace("\\" + c, c)
    return spec


def skip_problem(output, features):
    """Why a skip the build should not have is one, or None when it is allowed."""
    text = " ".join(output.split())  # Catch2 wraps its messages
    if "skipped: no GPU" in text:
        return None
    if "skipped: cannot mount a tmpfs" in text or "skipped: under ThreadSanitizer" in text:
        return None
    if "skipped: this build has no c10d Gloo" in text:
        if features.get("gloo") is False:
            return None
        if features.get("gloo") is True:
            return "skipped for want of Gloo, but this build has c10d Gloo"
        return "skipped for want of Gloo, and strider_features.json does not say this build lacks it"
    m = re.search(r"skipped: [^.]*", text)
    return f"skipped for a reason not on the allowed list ({m.group(0) if m else 'no reason printed'})"


def main(build_dir, junit_path):
    features_path = os.path.join(build_dir, "strider_features.json")
    features = json.load(open(features_path)) if os.path.exists(features_path) else {}
    listing = json.loads(subprocess.run(["ctest", "--test-dir", build_dir, "--show-only=json-v1"],
                                        capture_output=True, text=True, check=True).stdout)
    entries = {}  # ctest name -> (binary, selected test case)
    for t in listing.get("tests", []):
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if LABEL not in props.get("LABELS", []):
            continue
        cmd = t.get("command") or []
        entries[t["name"]] = (cmd[0] if cmd else None, selected_name(cmd[1]) if len(cmd) > 1 else "")

    # What ctest reported as run (passed or failed) or skipped; "disabled" and
    # "notrun" without a skip message did not run.
    ran, bad_skips = set(), []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        status = case.get("status", "")
        if status in ("run", "fail") or case.find("skipped") is not None:
            ran.add(case.get("name"))
        if case.find("skipped") is not None:
            out = case.find("system-out")
            problem = skip_problem(out.text if out is not None and out.text else "", features)
            if problem:
                bad_skips.append(f"{case.get('name')}: {problem}")

    binaries = sorted({b for b, _ in entries.values() if b})
    if not binaries:
        print(f"check_catch_cases: ctest lists no test labelled '{LABEL}' in {build_dir}; "
              "tests/CMakeLists.txt's strider_test should label every Catch2 case", file=sys.stderr)
        return 1
    missing, stray, total = [], [], 0
    for binary in binaries:
        names = catch_names(binary)
        total += len(names)
        covered = {name for ctest_name, (b, name) in entries.items() if b == binary and ctest_name in ran}
        missing += [f"{binary}: {n}" for n in names if n not in covered]
        stray += [f"{ctest_name} (selects '{name}')" for ctest_name, (b, name) in entries.items()
                  if b == binary and name not in names]
    if bad_skips:
        print("\n".join([f"check_catch_cases: {len(bad_skips)} Catch2 test cases skipped where this build "
                         f"should run them ({features_path}: {features}):"] + [f"  {b}" for b in bad_skips]),
              file=sys.stderr)
        return 1
    if missing or stray:
        msg = [f"check_catch_cases: {len(missing)} of {total} Catch2 test cases did not run under ctest:"]
        msg += [f"  {m}" for m in missing]
        if stray:
            msg.append("ctest entries that select no test case (catch_discover_tests split a name; "
                       "a ';' in a TEST_CASE name does that: rename the case):")
            msg += [f"  {s}" for s in stray]
        print("\n".join(msg), file=sys.stderr)
        return 1
    print(f"check_catch_cases: all {total} Catch2 test cases of {len(binaries)} binaries ran or were "
          f"skipped under ctest")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
