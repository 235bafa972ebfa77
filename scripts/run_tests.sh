#!/usr/bin/env bash
# Run the test suite in a few pytest processes, not one: a single process that compiles
# every test's XLA programs crashed inside XLA's CPU compiler (a segfault at ~70% of the
# suite, reproducible on the 2-core CI machine), while each part passes on its own. Four
# parts crashed the same way once the Kascade tests grew (CI of 4b7d119: part 2 segfaulted
# compiling in test_offload, which passes alone), so `make test` uses eight.
# Usage: [TEST_LANES=N] scripts/run_tests.sh PYTHON [PARTS]
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
mapfile -t files < <(ls tests/test_*.py)
n=${#files[@]}; per=$(( (n + parts - 1) / parts ))
# The parts run in TEST_LANES concurrent lanes (default 2, the CI machine's cores): each lane
# takes the next part nobody has claimed (mkdir is atomic), so a lane that drew short parts
# takes more. Most of a part's time is one compiler thread, so two lanes use both cores (CI of
# e2ed633: 26 min of tests against 36-38 min one part at a time, with parts dealt round-robin). Each
# part's output is kept and printed whole, in order, once every lane is done. A cache entry read
# while another process writes it fails to deserialise, which jax reports and recompiles.
lanes="${TEST_LANES:-2}"
logs="$(mktemp -d -t sparse-jax-test-logs.XXXXXX)"
count=$(( (n + per - 1) / per ))
run_part() {  # part number (1-based)
  local k=$1 i=$(( ($1 - 1) * per )) t0=$SECONDS
  local last=$(( i + per < n ? i + per - 1 : n - 1 ))
  echo "== tests part $k of $count: ${files[i]} .. ${files[last]}" > "$logs/$k.log"
  JAX_PLATFORMS=cpu "$py" -m pytest -q -rfE --durations=8 --junit-xml="$logs/$k.xml" "${files[@]:i:per}" \
    >> "$logs/$k.log" 2>&1
  local r=$?
  echo "$r" > "$logs/$k.rc"
  echo "part $k: ${files[i]} .. ${files[last]}: rc=$r in $(( SECONDS - t0 )) s" > "$logs/$k.time"
  echo "-- part $k of $count done: rc=$r in $(( SECONDS - t0 )) s"
}
# Parts holding the slowest files are claimed first, so the last part to finish is a short one
# (a long part claimed last would run alone on one core at the end): the files below are the
# slowest of a recent run (the 15 slowest tests, printed at the end, say which).
heavy="tests/test_multi_device.py tests/test_token_sparse.py tests/test_methods_in_model.py tests/test_labels.py"
order=()
for ((k = 1; k <= count; k++)); do
  for f in "${files[@]:$(( (k - 1) * per )):per}"; do
    case " $heavy " in *" $f "*) order+=("$k"); break ;; esac
  done
done
for ((k = 1; k <= count; k++)); do case " ${order[*]} " in *" $k "*) ;; *) order+=("$k") ;; esac; done
for ((lane = 1; lane <= lanes; lane++)); do
  ( for k in "${order[@]}"; do mkdir "$logs/claim.$k" 2>/dev/null && run_part "$k"; done ) &
done
wait
rc=0
for ((k = 1; k <= count; k++)); do
  cat "$logs/$k.log"
  [ "$(cat "$logs/$k.rc" 2>/dev/null)" = 0 ] || { rc=1; echo "!! part $k failed"; }
done
# The summary last, so the next regression is visible at the end of the CI log: each part's
# wall time, then the 15 slowest tests of the whole run (setup + call + teardown, from the
# parts' JUnit XML).
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
PY
rm -rf "$logs"
exit $rc
