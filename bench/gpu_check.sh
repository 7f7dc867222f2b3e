#!/usr/bin/env bash
# The GPU checks of issue 19 on a machine with CUDA, bounded (the shared device:
# `source .device/preamble.sh && bash bench/gpu_check.sh`). Results go to $OUT
# (default ./gpu-check): the check's JSON and markdown, pytest's summary, logs (tarball).
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
rc=0
timeout 330 python3 -m bench.gpu_check --run-dir "$OUT/runs" --json "$OUT/gpu-check.json" \
  > "$OUT/gpu-check.md" 2> "$OUT/gpu-check.err" || rc=1
grep -v "^\s*$" "$OUT/gpu-check.md" | tail -25
timeout 100 python3 -m pytest -q -p no:cacheprovider --basetemp="$OUT/tmp" -rA \
  tests/test_gpus.py "tests/test_cuda.py::test_cpu_example_on_a_gpu_machine_uses_gloo" \
  "tests/test_cuda.py::test_cuda_model_alone_on_its_gpu_uses_nccl" 2>&1 | tail -12 \
  > "$OUT/pytest-cuda.txt" || rc=1
tail -4 "$OUT/pytest-cuda.txt"
tar -czf "$OUT/logs.tgz" -C "$OUT" runs tmp gpu-check.err 2>/dev/null && rm -rf "$OUT/runs" "$OUT/tmp"
exit $rc
