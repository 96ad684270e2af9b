#!/usr/bin/env bash
# One device call for tests/gpu/wip_epi: environment, a smoke per variant (a fault stops only that process; the
# faulting variant then runs once under compute-sanitizer and is left out), then the benchmark of the rest.
# Usage (repo root, CUDA machine): tests/gpu/wip_epi/run_epi.sh OUT_DIR TOTAL_S [variants]
set -uo pipefail
out=${1:?usage: run_epi.sh OUT_DIR TOTAL_S [variants]}
total=${2:-560}
variants=${3:-epi,epi_s1,epi_ic,epi_icf,epi_icf_ks4}
mkdir -p "$out"
# the scratch module is kept as a diff against the runtime module (no second copy of it in the repository)
mod=tests/gpu/wip_epi/int8_lmhead_epi.py
if [ ! -f "$mod" ]; then
  cp sparkfleet/kernels/int8_lmhead.py "$mod" && patch -s "$mod" tests/gpu/wip_epi/int8_lmhead_epi.diff \
    || { echo "run_epi.sh: could not make $mod: run the cp and patch of int8_lmhead_epilogue.wip.md first"; exit 2; }
fi
export PYTHONUNBUFFERED=1
dry=${EPI_DRY:+--dry}  # CPU rehearsal: EPI_DRY=1 TRITON_INTERPRET=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$out/env.txt"
cat "$out/env.txt"
left=$variants
ok=""
for attempt in 1 2 3; do
  [ -z "$left" ] && break
  timeout 240 python3 tests/gpu/wip_epi/bench_epi.py --out "$out" $dry --smoke --variants "$left" --tag "_$attempt" \
    > "$out/smoke_$attempt.out" 2>&1
  rc=$?
  passed=$(grep -o 'SMOKE_OK [a-z0-9_]*' "$out/smoke_$attempt.out" | awk '{print $2}' | paste -sd, -)
  ok=$(echo "$ok,$passed" | sed 's/^,*//;s/,*$//')
  echo "smoke attempt $attempt rc=$rc passed: $passed"
  [ $rc -eq 0 ] && break
  bad=$(echo "$left" | tr , '\n' | grep -vxF -f <(echo "$passed" | tr , '\n' | grep .) | head -1)
  echo "smoke: $bad failed (rc $rc); tail:"; tail -5 "$out/smoke_$attempt.out"
  if [ $attempt -eq 1 ] && [ -n "${EPI_BLOCKING:-}" ]; then
    # the same smoke with every launch synchronous: passes if the fault is an ordering race
    CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 tests/gpu/wip_epi/bench_epi.py --out "$out" --smoke --variants "$bad" \
      --tag _blocking > "$out/sanitizer.log" 2>&1
    echo "launch-blocking smoke of $bad rc=$?"; grep -v '^ *\^' "$out/sanitizer.log" | tail -6
  elif [ $attempt -eq 1 ] && command -v compute-sanitizer >/dev/null; then
    timeout 200 compute-sanitizer --tool memcheck --print-limit 12 python3 tests/gpu/wip_epi/bench_epi.py \
      --out /tmp/san --smoke --sanitize --sanitize-shape "${EPI_SANITIZE_SHAPE:-248320,1}" --variants "$bad" \
      > "$out/sanitizer.log" 2>&1
    echo "sanitizer rc=$?"; grep -m3 -A3 'Invalid' "$out/sanitizer.log"
  fi
  left=$(echo "$left" | tr , '\n' | grep -vxF -f <(echo "$passed,$bad" | tr , '\n' | grep .) | paste -sd, -)
done
echo "variants that passed the smoke: $ok (elapsed ${SECONDS}s)"
[ -z "$ok" ] && exit 1
remaining=$((total - SECONDS - 10))
budget=$((remaining - 90))
timeout "$remaining" python3 tests/gpu/wip_epi/bench_epi.py --out "$out" $dry --variants "$ok" --budget-s "$budget" --worst 2 \
  > "$out/main.out" 2>&1
echo "main rc=$? (elapsed ${SECONDS}s)"
tail -25 "$out/main.out" | cut -c1-400
# at most 8 files come back: the smoke's files and the sanitizer's log as one archive
(cd "$out" && tar czf smoke.tgz smoke_* sanitizer.log 2>/dev/null; rm -f smoke_* sanitizer.log)
ls -la "$out"
