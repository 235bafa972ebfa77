#!/usr/bin/env bash
# Run the test suite in a few pytest processes, not one: a single process that compiles
# every test's XLA programs crashed inside XLA's CPU compiler (a segfault at ~70% of the
# suite, reproducible on the 2-core CI machine), while each part passes on its own. Four
# parts crashed the same way once the Kascade tests grew (CI of 4b7d119: part 2 segfaulted
# compiling in test_offload, which passes alone), so `make test` uses eight.
# Usage: scripts/run_tests.sh PYTHON [PARTS]
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
n=${#files[@]}; per=$(( (n + parts - 1) / parts )); rc=0
for ((i = 0; i < n; i += per)); do
  echo "== tests part $(( i / per + 1 )) of $parts: ${files[i]} .. ${files[$(( i + per < n ? i + per - 1 : n - 1 ))]}"
  JAX_PLATFORMS=cpu "$py" -m pytest -q -rfE --durations=8 "${files[@]:i:per}" || rc=1
done
exit $rc
