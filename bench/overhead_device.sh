#!/usr/bin/env bash
# Issue 23's overhead figure on the 16-core device machine (CPU, its GPU hidden), before and
# after the overlapped gradient sync: `source .device/preamble.sh && bash bench/overhead_device.sh`.
# Interleaved pairs (Ceaseless vs plain DDP) per setting; results under $OUT (default
# ./overhead-device): JSON + markdown per setting, logs in a tarball. Bounded: ~8 minutes.
set -uo pipefail
OUT=${OUT:-overhead-device}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
rc=0
for overlap in 1 0; do
  CUDA_VISIBLE_DEVICES= CEASELESS_OVERLAP=$overlap timeout 230 python3 -m bench.overhead \
    --workers 4 --model 10m --repeats "$REPEATS" --work-dir "$OUT/runs-$overlap" \
    --json "$OUT/overhead-overlap$overlap.json" > "$OUT/overhead-overlap$overlap.md" \
    2> "$OUT/overhead-overlap$overlap.err" || rc=1
  echo "== CEASELESS_OVERLAP=$overlap"; grep -v "^\s*$" "$OUT/overhead-overlap$overlap.md" | tail -12
done
tar -czf "$OUT/logs.tgz" -C "$OUT" runs-1 runs-0 overhead-overlap1.err overhead-overlap0.err \
  2>/dev/null && rm -rf "$OUT/runs-1" "$OUT/runs-0"
exit $rc
