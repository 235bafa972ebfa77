#!/usr/bin/env bash
# Run the test suite in a few pytest processes, not one: a single process that compiles
# every test's XLA programs crashed inside XLA's CPU compiler (a segfault at ~70% of the
# suite, reproducible on the 2-core CI machine), while each part passes on its own. Four
# parts crashed the same way once the Kascade tests grew (CI of 4b7d119: part 2 segfaulted
# compiling in test_offload, which passes alone), so `make test` uses many.
# Usage: [TEST_LANES=N] scripts/run_tests.sh PYTHON [PARTS]  (PARTS: for the files not in `heavy`)
set -uo pipefail
py="$1"; parts="${2:-4}"
# One persistent XLA compilation cache for the whole run (all parts and the subprocesses tests
# start), fresh each run: most of the suite's time is compiling (tests/test_methods_in_model.py:
# 96 s cold, 35 s with its programs cached), and many tests build the same programs again.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t sparse-jax-xla-cache.XXXXXX)"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# XLA's backend at optimisation level 0, LLVM's expensive passes off (jax's
# disable_most_optimizations): the suite is mostly compiling small programs once, and runs them
# little. On the 2-core machine (2026-12-02) test_driver + test_label_topk took 181 s against
# 225, and test_methods_in_model + test_generate_cli + test_parity (SmolLM2's real weights,
# run as well as compiled) 203 s against 269, every test passing. Set it to 0 to test what
# users compile. The files in `runs_more` run more than they compile (Gemma 3's long prompts
# on its real weights: 194 s with it against 156 without, CI of 99c868a; the server's engine
# serving SmolLM2 to its clients, tests/test_serve.py: 305 s wall, 337 s CPU with it against
# 222 s, 201 s without, two at once on the 2-core machine, 2026-12-04; since it serves 4 of
# SmolLM2's layers, alike: 79 s and 84 s with it against 86 s and 83 s without, alone,
# 2026-12-07: noise, so it keeps the passes, what users compile) and keep XLA's passes
# (each is a `heavy` part of its own: the setting is per process). Not test_engine, test_offload,
# test_offload_benchmark or test_replicas: measured alike, as fast or faster with it.
export JAX_DISABLE_MOST_OPTIMIZATIONS="${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}"
# The project's modules compiled to bytecode once, before the parts: where PYTHONDONTWRITEBYTECODE
# is set (this sandbox sets it), every process (the parts, and the CLIs and servers tests start)
# otherwise compiled them from source again, 0.4-0.7 s of CPU a process for models + serving +
# benchmarks on the 2-core box (2026-12-06); a set variable still lets Python read what exists.
# (tests/ is left out: pytest rewrites its modules' asserts into files of its own.)
"$py" -m compileall -q -j 0 models sparse_jax pallas_kernels benchmarks scripts > /dev/null || true
runs_more=(tests/test_gemma3.py tests/test_serve.py)
# The slowest files (of a recent run: the 15 slowest tests, printed at the end, say which),
# slowest first, are parts of their own, claimed first; the other files are dealt into PARTS
# parts after them. A lane that finishes early then takes short parts, so the run ends with
# short parts on both lanes, not one long part running alone on one core.
heavy=(tests/test_multi_device.py tests/test_serve.py tests/test_engine.py tests/test_labels.py tests/test_gemma3.py
       tests/test_kascade_prefill.py tests/test_driver.py tests/test_methods_in_model.py tests/test_offload.py
       tests/test_offload_benchmark.py tests/test_topk.py tests/test_kascade.py tests/test_shared_pool.py)
mapfile -t all < <(ls tests/test_*.py)
rest=()
for f in "${all[@]}"; do case " ${heavy[*]} " in *" $f "*) ;; *) rest+=("$f") ;; esac; done
n=${#rest[@]}; per=$(( (n + parts - 1) / parts ))
groups=()
for f in "${heavy[@]}"; do [ -f "$f" ] && groups+=("$f"); done
for ((i = 0; i < n; i += per)); do groups+=("${rest[*]:i:per}"); done
count=${#groups[@]}
# The parts run in TEST_LANES concurrent lanes (default 2, the CI machine's cores): each lane
# takes the next part nobody has claimed (mkdir is atomic), so a lane that drew short parts
# takes more. Most of a part's time is one compiler thread, so two lanes use both cores (CI of
# e2ed633: 26 min of tests against 36-38 min one part at a time, with parts dealt round-robin). Each
# part's output is kept and printed whole, in order, once every lane is done. A cache entry read
# while another process writes it fails to deserialise, which jax reports and recompiles.
lanes="${TEST_LANES:-2}"
logs="$(mktemp -d -t sparse-jax-test-logs.XXXXXX)"
run_part() {  # part number (1-based)
  local k=$1 t0=$SECONDS
  local -a part
  read -r -a part <<< "${groups[k - 1]}"
  local span="${part[0]} .. ${part[${#part[@]} - 1]}"
  echo "== tests part $k of $count: $span" > "$logs/$k.log"
  local opt=$JAX_DISABLE_MOST_OPTIMIZATIONS
  case " ${runs_more[*]} " in *" ${part[0]} "*) [ ${#part[@]} = 1 ] && opt=0 ;; esac
  JAX_DISABLE_MOST_OPTIMIZATIONS=$opt JAX_PLATFORMS=cpu "$py" -m pytest -q -rfE --durations=8 --junit-xml="$logs/$k.xml" "${part[@]}" \
    >> "$logs/$k.log" 2>&1
  local r=$?
  echo "$r" > "$logs/$k.rc"
  echo "part $k: $span: rc=$r in $(( SECONDS - t0 )) s" > "$logs/$k.time"
  echo "-- part $k of $count done: rc=$r in $(( SECONDS - t0 )) s"
}
for ((lane = 1; lane <= lanes; lane++)); do
  ( for ((k = 1; k <= count; k++)); do mkdir "$logs/claim.$k" 2>/dev/null && run_part "$k"; done ) &
done
wait
rc=0
for ((k = 1; k <= count; k++)); do
  cat "$logs/$k.log"
  [ "$(cat "$logs/$k.rc" 2>/dev/null)" = 0 ] || { rc=1; echo "!! part $k failed"; }
done
# The summary last, so the next regression is visible at the end of the CI log: each part's
# wall time, then the 15 slowest tests and files of the whole run (setup + call + teardown, from
# the parts' JUnit XML).
echo "== time per part (total wall $SECONDS s)"
cat "$logs"/*.time 2>/dev/null | sort -t' ' -k2n
echo "== the 15 slowest tests"
"$py" - "$logs" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
rows = []
for f in glob.glob(sys.argv[1] + "/*.xml"):
    for case in ET.parse(f).iter("testcase"):
        rows.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
for t, name in sorted(rows, reverse=True)[:15]:
    print(f"{t:8.1f} s  {name}")
files = {}
for t, name in rows:  # by file: what the `heavy` list above should name
    f = "tests/" + name.split("::")[0].split(".")[1] + ".py"
    files[f] = files.get(f, 0.0) + t
print("== the 15 slowest files (their tests' time)")
for f, t in sorted(files.items(), key=lambda x: -x[1])[:15]:
    print(f"{t:8.1f} s  {f}")
PY
# TEST_LOGS_DIR: keep every part's log and JUnit XML there (every test's time, to choose what to cut)
if [ -n "${TEST_LOGS_DIR:-}" ]; then mkdir -p "$TEST_LOGS_DIR" && cp "$logs"/*.log "$logs"/*.xml "$TEST_LOGS_DIR"/; fi
rm -rf "$logs"
exit $rc
