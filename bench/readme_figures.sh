#!/usr/bin/env bash
# bench/readme_figures.sh: reruns the command of every figure block in README.md
# and docs/*.md (bench/figure_blocks.py's COMMANDS; CPU only), keeps each
# command's full output, and prints a figures report: one line per figure,
# `name: value    # command`, then one JSON object with all of them (machine,
# per-part wall time, figures, commands, failures). Two blocks it does not
# rerun: quality (bench/quality_formats.py, half an hour) and gpu (a GPU machine).
#
#   bench/readme_figures.sh                  run everything, print the report
#   bench/readme_figures.sh --check          the same; exit 1 naming every command that failed
#                                            and each block's first figure that none printed
#   bench/readme_figures.sh --update-readme  the same, then rewrite the figure blocks
#                                            (<!-- figures:begin NAME --> ...
#                                            <!-- figures:end -->) from this run
# Options:
#   --logs DIR         where each command's output goes (default: a new temp dir, kept)
#   --from-logs DIR    run nothing: report on (and --check, --update-readme from) an earlier run's logs
#   --only P1,P2       run only these parts: plan predict profile step torch demo calibrate adam nvme
#                      (--update-readme needs them all)
#   --no-build         use the binaries as they are (default: build the five targets first)
#   --adam-args A, --nvme-args A
#                      extra arguments for that bench, e.g. --nvme-args '--pairs 2' to run it
#                      smaller; the README's command column then shows them, and its text
#                      the size that ran (the sizes come from each bench's JSON)
# Environment: STRIDER_BUILD_DIR (default build/), STRIDER_JOBS (build jobs, default nproc),
# TMPDIR (scratch: bench_nvme's 2 GiB file, plan's --nvme dir, the demo's data).
#
# Parts, in order, with their wall time on the 2-core development VM while two
# other C++ builds ran on it (18m38s in all; a quiet machine takes less):
#   plan       16 `strider plan --predict rtx4090 --json` runs (8B; 70B/123B on NVMe; LoRA; refusals) 12 s
#   predict    bench/predict_dp.py, predict_pool.py, predict_past_ram.py: each prints its block    (not timed)
#   profile    `strider profile --json` on the built-in model                                    21 s
#   step       bench_step                                                                        73 s
#   torch      bench/bench_vs_torch.py: strider vs plain PyTorch, 135M Llama, 5 rounds x 2 steps  ~420 s
#   demo       `strider finetune` with the demo's defaults (as scripts/demo.sh runs it)         433 s
#   calibrate  bench_calibrate                                                                  243 s
#   adam       bench_adam                                                                        62 s
#   nvme       bench_nvme, then its compute-copy pattern (256 MiB extents)                      300 s
# Figures are whatever this machine printed: a benchmark never fails on speed.
# Not part of scripts/test.sh: it takes minutes.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
build=${STRIDER_BUILD_DIR:-$repo/build}
build=$(cd "$build" 2>/dev/null && pwd || echo "$build")

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "readme_figures: $*" >&2; exit 2; }

all_parts=plan,predict,profile,step,torch,demo,calibrate,adam,nvme
logs="" from_logs="" parts=$all_parts check=0 update=0 do_build=1
adam_args="" nvme_args=""
while [ $# -gt 0 ]; do
  case $1 in
    --logs) logs=${2:?--logs needs a folder}; shift 2 ;;
    --from-logs) from_logs=${2:?--from-logs needs a folder}; shift 2 ;;
    --only) parts=${2:?--only needs parts}; shift 2 ;;
    --check) check=1; shift ;;
    --update-readme) update=1; shift ;;
    --no-build) do_build=0; shift ;;
    --adam-args) adam_args=${2?}; shift 2 ;;
    --nvme-args) nvme_args=${2?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (--help lists them)" ;;
  esac
done
for p in ${parts//,/ }; do
  case ",$all_parts," in *",$p,"*) ;; *) die "--only: unknown part '$p' (parts: $all_parts)" ;; esac
done
python=$repo/.venv/bin/python
[ -x "$python" ] || python=python3
report_args=(--parts "$parts")
[ $check = 1 ] && report_args+=(--check)
[ $update = 1 ] && report_args+=(--update-readme "$repo/README.md")

if [ -n "$from_logs" ]; then
  [ -f "$from_logs/commands.tsv" ] || die "--from-logs $from_logs: no commands.tsv there"
  exec "$python" "$here/readme_figures.py" "$from_logs" "${report_args[@]}"
fi

if [ -z "$logs" ]; then
  logs=$(mktemp -d "${TMPDIR:-/tmp}/readme-figures.XXXXXX")
else
  mkdir -p "$logs"
  logs=$(cd "$logs" && pwd)
  rm -f "$logs"/*.log "$logs/commands.tsv" "$logs/demo-metrics.jsonl" "$logs/machine.json" "$logs/report.txt"
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/readme-figures-work.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "readme_figures: logs in $logs" >&2

has_part() { case ",$parts," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# The command as the report and the README show it: paths relative to the
# repository, the scratch folder as <tmp>, the log folder as <logs>.
shown() {
  local s
  s=$(printf '%q ' "$@")
  s=${s% }
  s=${s//"$work"/<tmp>}
  s=${s//"$logs"/<logs>}
  s=${s//"$repo/"/}
  printf '%s' "$s"
}

# run NAME EXPECTED_STATUS COMMAND...: in the repository root, stdout and
# stderr to $logs/NAME.log; the status and wall time to commands.tsv.
run() {
  local name=$1 expected=$2 rc=0 t0 t1 wall
  shift 2
  printf 'readme_figures: %-20s %s\n' "$name" "$(shown "$@")" >&2
  t0=$(date +%s.%N)
  (cd "$repo" && "$@") > "$logs/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$expected" "$wall" "$(shown "$@")" >> "$logs/commands.tsv"
  [ "$rc" = "$expected" ] || echo "readme_figures: $name exited $rc (expected $expected): see $logs/$name.log" >&2
}

# The machine, stated once in the README.
disk_of() {  # the block device under a folder, and its driver (virtio_blk, nvme, ...)
  local src dev drv
  src=$(findmnt -no SOURCE -T "$1" 2>/dev/null || true)
  dev=$(basename "${src:-unknown}")
  drv=$(basename "$(readlink -f "/sys/block/$dev/device/driver" 2>/dev/null)" 2>/dev/null || true)
  [ -n "$drv" ] && [ "$drv" != . ] && printf '%s on %s (%s)' "$1" "$src" "$drv" || printf '%s on %s' "$1" "${src:-?}"
}
gpu="no GPU"
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > "$work/gpus" 2>/dev/null && [ -s "$work/gpus" ]; then
  gpu="GPU: $(head -1 "$work/gpus")"
fi
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD 2>/dev/null || commit="$commit with local changes"
"$python" - "$logs/machine.json" <<EOF
import json, sys
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
mem_kib = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
json.dump({"date": "$(date -u +%Y-%m-%d)", "commit": "$commit", "nproc": $(nproc), "cpu_model": cpu,
           "mem_gib": mem_kib / 2**20, "tmp_disk": "$(disk_of "${TMPDIR:-/tmp}")", "gpu": "$gpu"},
          open(sys.argv[1], "w"))
EOF

# The binaries, built from this checkout (stale ones would quote another commit's figures).
targets=()
has_part plan || has_part predict || has_part profile || has_part demo && targets+=(strider)
has_part step && targets+=(bench_step)
has_part torch && targets+=(strider_ops)
has_part calibrate && targets+=(bench_calibrate)
has_part adam && targets+=(bench_adam)
has_part nvme && targets+=(bench_nvme)
if [ $do_build = 1 ] && [ ${#targets[@]} -gt 0 ]; then
  [ -f "$build/CMakeCache.txt" ] || die "no build in $build: run scripts/setup.sh first (or set STRIDER_BUILD_DIR)"
  export CCACHE_DIR=${CCACHE_DIR:-${STRIDER_CACHE:-$HOME/.cache/strider}/ccache}  # as scripts/setup.sh
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$repo} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
  echo "readme_figures: building ${targets[*]} (log: $logs/build.log)" >&2
  cmake --build "$build" -j "${STRIDER_JOBS:-$(nproc)}" --target "${targets[@]}" > "$logs/build.log" 2>&1 ||
    die "the build failed: see $logs/build.log"
fi

S=$build/strider
if has_part plan; then
  # Llama-3.1-8B on the rtx4090 preset at batch 8/16/32/64 (the plan chooses which layers keep
  # their activations: --activations auto), and batch 8 without clipping.
  for acc in 8 16 32 64; do
    run "plan-8b-b$acc" 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --seq 1024 --accumulation "$acc" \
        --predict rtx4090 --json
  done
  run plan-8b-b8-clip0 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --seq 1024 --accumulation 8 \
      --predict rtx4090 --clip 0 --json
  # The same in fp16 (loss scaling), its GEMMs accumulating in fp32 and in fp16.
  for acc in 8 16 32 64; do
    run "plan-8b-b$acc-fp16" 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --seq 1024 --accumulation "$acc" \
        --dtype fp16 --predict rtx4090 --json
    run "plan-8b-b$acc-fp16acc" 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --seq 1024 --accumulation "$acc" \
        --dtype fp16 --matmul-accumulate fp16 --predict rtx4090 --json
  done
  # Larger than RAM: optimizer state on NVMe, batch 32, clip 1.0 (the default) and 0.
  mkdir -p "$work/nvme"
  for m in "70b llama-3.1-70b 256GiB" "123b mistral-large-123b 384GiB"; do
    read -r tag model ram <<< "$m"
    run "plan-$tag-nvme" 0 "$S" plan --model "$model" --gpu 24GiB --ram "$ram" --nvme "$work/nvme" --seq 1024 \
        --accumulation 32 --predict rtx4090 --json
    run "plan-$tag-nvme-clip0" 0 "$S" plan --model "$model" --gpu 24GiB --ram "$ram" --nvme "$work/nvme" \
        --seq 1024 --accumulation 32 --predict rtx4090 --clip 0 --json
    # Without --nvme the plan refuses (status 1), naming the RAM it needs.
    run "plan-$tag-ram-only" 1 "$S" plan --model "$model" --gpu 24GiB --ram "$ram" --seq 1024 --json
  done
  # The q8 optimizer-state format: 8B all in RAM (issue 13's figure), 70B with NVMe.
  run plan-8b-q8 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --ram 256GiB --seq 1024 --accumulation 8 --clip 1 \
      --optimizer-state q8 --predict rtx4090 --json
  run plan-70b-nvme-q8 0 "$S" plan --model llama-3.1-70b --gpu 24GiB --ram 256GiB --nvme "$work/nvme" --seq 1024 \
      --accumulation 32 --optimizer-state q8 --predict rtx4090 --json
  # LoRA (r=16 on every linear module, bf16 base) next to full training, batch 16: 8B in 128 GiB of RAM,
  # 70B in 256 GiB (full training with NVMe); 70B LoRA in 128 GiB is refused (status 1), naming its base.
  lora=r=16,alpha=32,targets=all-linear
  run plan-8b-lora 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --ram 128GiB --seq 1024 --accumulation 16 \
      --lora "$lora" --predict rtx4090 --json
  run plan-8b-full-128 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --ram 128GiB --seq 1024 --accumulation 16 \
      --predict rtx4090 --json
  run plan-70b-lora 0 "$S" plan --model llama-3.1-70b --gpu 24GiB --ram 256GiB --seq 1024 --accumulation 16 \
      --lora "$lora" --predict rtx4090 --json
  run plan-70b-full-b16 0 "$S" plan --model llama-3.1-70b --gpu 24GiB --ram 256GiB --nvme "$work/nvme" --seq 1024 \
      --accumulation 16 --predict rtx4090 --json
  run plan-70b-lora-128 1 "$S" plan --model llama-3.1-70b --gpu 24GiB --ram 128GiB --seq 1024 --accumulation 16 \
      --lora "$lora" --json
  # The same LoRA over an NF4 base (--base-format nf4): 8B, and 70B in the 128 GiB a bf16 base is refused.
  run plan-8b-lora-nf4 0 "$S" plan --model llama-3.1-8b --gpu 24GiB --ram 128GiB --seq 1024 --accumulation 16 \
      --lora "$lora" --base-format nf4 --predict rtx4090 --json
  run plan-70b-lora-nf4-128 0 "$S" plan --model llama-3.1-70b --gpu 24GiB --ram 128GiB --seq 1024 \
      --accumulation 16 --lora "$lora" --base-format nf4 --predict rtx4090 --json
fi
if has_part predict; then
  # Each prints its whole block (bench/figure_blocks.py's marked()); readme_figures.py writes it.
  for script in predict_dp predict_pool predict_past_ram; do
    run "${script//_/-}" 0 "$python" "bench/$script.py" --binary "$S"
  done
fi
if has_part profile; then
  # Its trace and PNG stay with the logs.
  run profile 0 "$S" profile --out "$logs/profile" --work-dir "$work/profile-data" --json
fi
if has_part step; then
  run bench_step 0 "$build/bench/bench_step"
fi
if has_part torch; then
  # Against the peer a user would pick instead: the same HF model and batches
  # in plain PyTorch, interleaved rounds, one worker process per side.
  run bench_vs_torch 0 "$python" bench/bench_vs_torch.py --rounds 5 --steps-per-round 2
fi
if has_part demo; then
  # scripts/demo.sh is setup.sh, then this with the demo's defaults; its data
  # and checkpoint go to scratch, one JSON line per step to the logs.
  run demo 0 "$S" finetune --work-dir "$work/demo" --out "$work/demo/out" --metrics "$logs/demo-metrics.jsonl"
fi
if has_part calibrate; then
  run bench_calibrate 0 "$build/bench/bench_calibrate"
fi
if has_part adam; then
  # shellcheck disable=SC2086
  run bench_adam 0 "$build/bench/bench_adam" $adam_args
fi
if has_part nvme; then
  # shellcheck disable=SC2086
  run bench_nvme 0 "$build/bench/bench_nvme" $nvme_args
  # shellcheck disable=SC2086
  run bench_nvme_extents 0 "$build/bench/bench_nvme" --chunks-mib 1 --depths 32 --extent-mib 256 \
    --inflight-extents 2 --pairs 4 $nvme_args
fi

"$python" "$here/readme_figures.py" "$logs" "${report_args[@]}" | tee "$logs/report.txt"
