#!/usr/bin/env bash
# Issue 49's GPU measurements of the serving engine, in stages that each fit one 10-minute
# device command (Qwen3-8B shape, random bf16 weights: no weights to carry).
#
#   bash scripts/serving_gpu.sh compile     # the 128K programs' compile times, one at a time (compile_probe),
#                                           # and where the chunk's compile goes (traced)
#   bash scripts/serving_gpu.sh compile-scanned     # the same programs with the layers scanned (on an H100 the
#                                           # chunk program ran out of memory: the scan copies the pool)
#   bash scripts/serving_gpu.sh compile-noautotune  # unrolled, XLA's autotuner off (its flag is read once per
#                                           # process): measured on an H100 on 2026-12-06 (docs/serving.md)
#   bash scripts/serving_gpu.sh iteration L # benchmark A: the engine's iteration against the bare step at
#                                           # L = 65536 (8 rows) or 131072 (4 rows); METHODS (dense,asynctls,quest)
#                                           # and ENGINES (paged,offload-paged) narrow it: at 64K one method on
#                                           # one engine took 8-9 min of a call's 10 on the H200 (2026-12-05), so
#                                           # name one of each per call (the log times each phase)
#   bash scripts/serving_gpu.sh load        # benchmark B at 64K-128K (dense and asynctls+TSA, paged, chunked);
#                                           # METHODS: one engine per call (cold, one engine's ~15 programs at 128K
#                                           # compile for minutes; 200 s of load a call), joined by serve_load --merge;
#                                           # CHUNK_PARTS=N cuts each chunk of a long prompt in N parts by layers
#   bash scripts/serving_gpu.sh group       # short prompts prefilled together against one program each: a chat-like
#                                           # load (prompts of 65-128 tokens, 16 slots, 32 and 64 req/s), dense
#                                           # paged-chunked, --group-prompts then --no-group-prompts, merged into one
#                                           # table. Grouping pays where one prompt's program is weight-bound: 16 GB of
#                                           # weights read in ~3.4 ms on an H200, the time of ~128 tokens of matrix
#                                           # products at ~600 TFLOP/s (16 GFLOP a token); longer prompts are
#                                           # compute-bound alone, and a group only pads them
#   bash scripts/serving_gpu.sh chunk       # where chunked TSA prefill loses to dense (benchmark B): one 2,048-token
#                                           # chunk at 16K-126K, dense against TSA's chunk form whole and in pieces,
#                                           # its scores by the jnp tiles and by the kernel (prefill_bench --parts chunk)
#   bash scripts/serving_gpu.sh hostloop    # issue 49's "fewer host round trips per token": the bare step one call
#                                           # per token against 4 steps in one program, looped (fori_loop) and
#                                           # written out (host_probe's multi_unrolled), dense and asynctls, 32K, B=8
#   bash scripts/serving_gpu.sh memory      # benchmark C, SparseServe's memory regime, emulated: the device
#                                           # capped at ~49 GB (35% of an H200's 141, 62% of an H100's 80;
#                                           # C_MEM_FRACTION overrides): 16 GB of weights and
#                                           # ~30 GB of KV, a 48 GB GPU's), the host tier the box's RAM;
#                                           # METHODS: one engine per call (dense:paged-chunked, then
#                                           # asynctls:offload-paged-segmented), joined by serve_load --merge
#   bash scripts/serving_gpu.sh pinned      # XLA's pinned-host pool against the planner's model of it
#                                           # (capacity.bfc_fits): how many page-array-sized copies it places
#                                           # under PINNED_GIB (default 105), no model or compile (~3 min: pinning ~100 GiB took ~50 s a size on an H100)
#   bash scripts/serving_gpu.sh memory-pair # benchmark C's dense and offloaded AsyncTLS + TSA engines in one call, each
#                                           # under a deadline, joined (the LongBench-like mix by default)
#
# Each writes json + md (+ png) to $OUT (the device runner's folder) or benchmarks/results/, and its
# log through `tee`, so a stage cut off by its limit keeps what it printed. XLA_PYTHON_CLIENT_MEM_FRACTION
# defaults to 0.92 (jax's 0.75 hides a quarter of the GPU). PY overrides the interpreter. Compiled programs
# go to COMPILE_CACHE (default .jax_cache/, git-ignored: the device runner keeps it between calls on a
# warm machine), so a stage run again loads what the last run compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUTDIR=${OUT:-benchmarks/results}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
CACHE=${COMPILE_CACHE:-$PWD/.jax_cache}
# benchmark B's slots: 8 on an H200; on a GPU of under 100 GB (an H100: ~55 GB of pages beside the weights,
# 374K tokens) 4, else the warm-up's 8 prompts of 64K at once do not fit the pool
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0)
LOAD_SLOTS=${SLOTS:-$([ "${gpu_mib:-0}" -gt 100000 ] && echo 8 || echo 4)}
stage=${1:?usage: serving_gpu.sh compile|compile-scanned|compile-noautotune|iteration L|load|group|chunk|hostloop|memory|pinned|memory-pair}
quiet() { grep --line-buffered -v "^W0000\|^I0000" | tee -a "$OUTDIR/serving_gpu_$stage.log"; }

case "$stage" in
  compile)
    $PY -u -m benchmarks.probes.compile_probe --max-len 132096 --kv-lens 131072 --unroll unrolled --runs 2 \
        --trace-compile /tmp/compile_trace --out "$OUTDIR" --name compile_probe_128k 2>&1 | quiet
    ;;
  compile-scanned)
    $PY -u -m benchmarks.probes.compile_probe --max-len 132096 --kv-lens 131072 --unroll scanned --runs 2 \
        --out "$OUTDIR" --name compile_probe_128k_scanned 2>&1 | quiet
    ;;
  compile-noautotune)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      $PY -u -m benchmarks.probes.compile_probe --max-len 132096 --kv-lens 131072 --unroll unrolled --runs 2 \
        --out "$OUTDIR" --name compile_probe_128k_noautotune 2>&1 | quiet
    ;;
  iteration)
    # every row at the context, the capacity the request's (context + tokens + 2, rounded up):
    # 73 GiB of cache + 15 GiB of weights at either length (the probe refuses shapes that do not fit)
    L=${2:?usage: serving_gpu.sh iteration 65536|131072}
    case "$L" in 65536) B=8 ;; 131072) B=4 ;; *) echo "L: 65536 or 131072" >&2; exit 2 ;; esac
    $PY -u -m benchmarks.probes.engine_iteration --methods "${METHODS:-dense,asynctls,quest}" \
        --engines "${ENGINES:-paged,offload-paged}" --compile-cache "$CACHE" --context "$L" --caps $((L + 1024)) --batch $B --max-tokens 40 \
        --out "$OUTDIR" --name "engine_iteration_${L}" 2>&1 | quiet
    ;;
  load)
    m=${METHODS:-dense:paged-chunked,asynctls+tsa:paged-chunked}
    parts=${CHUNK_PARTS:-1}  # each chunk of a long prompt in this many parts by layers (Engine(chunk_parts))
    suffix=$([ "$parts" = 1 ] || echo "_parts$parts")
    $PY -u -m benchmarks.serve_load --methods "$m" --compile-cache "$CACHE" --chunk-parts "$parts" \
        --prefill-opt keep_fraction=0.3 --prompt-mix 65536:1,131072:2 --output-min 256 --output-max 1024 \
        --slots "$LOAD_SLOTS" --rates 0.5 --requests 10 --time-limit 200 --out "$OUTDIR" \
        --name "serve_load_long_${m//[:+,]/_}$suffix" 2>&1 | quiet
    ;;
  group)
    common=(--methods dense:paged-chunked --compile-cache "$CACHE" --prompt-mix 128:1 --output-min 32 --output-max 128
            --slots 16 --rates 32,64 --requests 64 --time-limit 45 --out "$OUTDIR")
    $PY -u -m benchmarks.serve_load "${common[@]}" --name serve_load_group_on 2>&1 | quiet
    $PY -u -m benchmarks.serve_load "${common[@]}" --no-group-prompts --name serve_load_group_off 2>&1 | quiet
    $PY -m benchmarks.serve_load --merge "$OUTDIR/serve_load_group_on.json,$OUTDIR/serve_load_group_off.json" \
        --out "$OUTDIR" --name serve_load_grouped_prefill 2>&1 | quiet
    ;;
  chunk)
    $PY -u -m benchmarks.prefill_bench --parts chunk --contexts 16384,32768,65536,129024 --chunk 2048 \
        --chunk-keep 0.3 --runs 10 --out "$OUTDIR" --name prefill_chunk_tsa 2>&1 | quiet
    ;;
  hostloop)
    $PY -u -m benchmarks.probes.host_probe --context 32768 --batch 8 --multi 4 --steps 32 --rounds 5 \
        --shapes stable,multi,multi_unrolled --tag _multistep --out "$OUTDIR" 2>&1 | quiet
    ;;
  memory)
    m=${METHODS:-dense:paged-chunked}
    # the same ~49 GB on any card: 0.35 of an H200's 141 GB, 0.62 of an H100's 80 (C_MEM_FRACTION overrides)
    total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    # C_SLOTS (default 16: at most; --fit-slots takes one fewer until the capacity check passes) and POOL_SLOTS (an offloaded engine's block slots per (slot, KV head); default
    # twice one step's blocks) size the engine to the cap: at 64K an offloaded AsyncTLS row holds ~2.1 GiB
    # of device memory with POOL_SLOTS=128 (its two dense layers, labels, 128 blocks per head and layer;
    # 2.6 before the paged engine built its empty batch without the batch's K/V, 2026-12-06): 10 rows
    # (SHARED_POOL_SLOTS: NAME:offload-paged-shared-segmented's one pool, per layer and KV head); CHURN=0.009
    # emulates real text's block hit rate on the random weights (serve_load --churn)
    # PREFILL_OPT (e.g. keep_fraction=0.3, as benchmark B's): NAME+tsa's prefill option
    # MIX, OUT_MIN, OUT_MAX, RATES, REQUESTS, TIME_LIMIT change the load (default: 16 prompts of 64K at
    # 1 req/s, outputs 256-512, which is prefill-bound for both engines; SparseServe's LongBench trace is
    # mostly shorter prompts, e.g. MIX=16384:2,32768:2,65536:1)
    C_MEM_FRACTION=${C_MEM_FRACTION:-$(awk -v t="$total_mib" 'BEGIN { f = 49 * 1024 / t; printf "%.2f", (f < 0.95 ? f : 0.95) }')}
    XLA_PYTHON_CLIENT_MEM_FRACTION=$C_MEM_FRACTION \
      $PY -u -m benchmarks.serve_load --methods "$m" --compile-cache "$CACHE" --max-inject-tokens 32768 --prompt-mix "${MIX:-65536:1}" \
        --output-min "${OUT_MIN:-256}" --output-max "${OUT_MAX:-512}" --slots "${C_SLOTS:-16}" --fit-slots ${POOL_SLOTS:+--pool-slots "$POOL_SLOTS"} \
        ${SHARED_POOL_SLOTS:+--shared-pool-slots "$SHARED_POOL_SLOTS"} ${CHURN:+--churn "$CHURN"} ${PREFILL_OPT:+--prefill-opt "$PREFILL_OPT"} --rates "${RATES:-1}" --requests "${REQUESTS:-16}" \
        --time-limit "${TIME_LIMIT:-240}" --out "$OUTDIR" --name "serve_load_memory_${m//[:+,]/_}" \
        --note "benchmark C, emulated: XLA_PYTHON_CLIENT_MEM_FRACTION=$C_MEM_FRACTION caps the device (~49 GB)" \
        2>&1 | quiet
    ;;
  pinned)
    $PY -u -m benchmarks.probes.pinned_pool --limit-gib "${PINNED_GIB:-105}" --out "$OUTDIR" 2>&1 | quiet
    ;;
  memory-pair)
    # benchmark C's two engines in one device call (when one call's time is what is left): dense, then
    # offloaded AsyncTLS + TSA prefill, each a `memory` run under a deadline (DEADLINE s for both,
    # default 560; dense at most DENSE_S, default 300: its cold compile is most of it), joined by
    # serve_load --merge as serve_load_memory_pair. The load is `memory`'s variables, here by default
    # the LongBench-like mix at 2 req/s, 24 requests. Each engine's files go to PAIR_PARTS (default
    # /tmp/serving_gpu_pair) and only its json to the output folder: the device runner returns 8 files
    t0=$SECONDS
    parts=${PAIR_PARTS:-/tmp/serving_gpu_pair}
    mkdir -p "$parts"
    export MIX=${MIX:-16384:2,32768:2,65536:1} C_SLOTS=${C_SLOTS:-24} RATES=${RATES:-2} REQUESTS=${REQUESTS:-24} \
      TIME_LIMIT=${TIME_LIMIT:-100}
    OUT=$parts METHODS=dense:paged-chunked timeout "${DENSE_S:-300}" bash scripts/serving_gpu.sh memory \
      || echo "dense: rc=$?" | quiet
    left=$(( ${DEADLINE:-560} - (SECONDS - t0) ))
    OUT=$parts CHURN=${CHURN:-0.009} POOL_SLOTS=${POOL_SLOTS:-128} PREFILL_OPT=${PREFILL_OPT:-keep_fraction=0.3} \
      METHODS=asynctls+tsa:offload-paged timeout "$left" bash scripts/serving_gpu.sh memory || echo "offloaded: rc=$?" | quiet
    cp "$parts"/serve_load_memory_*.json "$OUTDIR"/ 2>/dev/null || true
    $PY -m benchmarks.serve_load --merge "$parts/serve_load_memory_dense_paged-chunked.json,$parts/serve_load_memory_asynctls_tsa_offload-paged.json" \
      --out "$OUTDIR" --name serve_load_memory_pair 2>&1 | quiet
    ;;
  *)
    echo "unknown stage $stage: compile|compile-scanned|compile-noautotune|iteration|load|group|chunk|hostloop|memory|pinned|memory-pair" >&2
    exit 2 ;;
esac
