"""One timing helper for every benchmark: warm-up, synchronisation, medians,
per-kernel device times through CUPTI, and the stamp every result carries.

Wall-clock times include host dispatch (tens of microseconds per jitted call),
which dominates for small kernels; CUPTI times (``device_ms``) sum the GPU
kernels' own durations and are the number to compare with a bytes/bandwidth
floor. Both are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Measured on the lent H100 (DESIGN.md): jitted elementwise copy, read + write.
H100_HBM_BYTES_PER_S = 2458e9
H100_BF16_FLOPS = 667e12


@dataclasses.dataclass
class Timing:
    """Times in milliseconds. ``device_ms`` is the CUPTI kernel-time median (or None)."""

    name: str
    wall_ms: float
    wall_p10_ms: float
    wall_p90_ms: float
    device_ms: float | None
    kernels: list[tuple[str, float]] | None
    runs: int

    @property
    def best_ms(self) -> float:
        """Device time where CUPTI measured it, else the wall-clock median."""
        return self.device_ms if self.device_ms is not None else self.wall_ms

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _block(x):
    return jax.block_until_ready(x)


def time_fn(
    fn: Callable,
    args: Sequence[Any] | Sequence[Sequence[Any]],
    *,
    name: str = "",
    warmup: int = 3,
    runs: int = 50,
    rotate: bool = False,
    cupti: bool = True,
) -> Timing:
    """Time ``fn(*args)``.

    Args:
      fn: a jitted function (it is jitted if not).
      args: the arguments, or with ``rotate=True`` a list of argument tuples
        cycled through so that repeated runs do not measure a warm L2 (50 MB on
        the H100) when one input set would fit in it.
      warmup: untimed calls first (compilation, autotuning, allocation).
      runs: timed calls; the median is reported.
      cupti: also measure per-kernel device time with CUPTI (GPU only).
    """
    if not hasattr(fn, "lower"):
        fn = jax.jit(fn)
    sets = list(args) if rotate else [tuple(args)]
    for i in range(warmup):
        _block(fn(*sets[i % len(sets)]))
    wall = []
    for i in range(runs):
        a = sets[i % len(sets)]
        t0 = time.perf_counter()
        _block(fn(*a))
        wall.append((time.perf_counter() - t0) * 1e3)
    device_ms, kernels = None, None
    if cupti and jax.default_backend() == "gpu":
        device_ms, kernels = _cupti(fn, sets, runs)
    q = np.percentile(wall, [10, 50, 90])
    return Timing(name, float(q[1]), float(q[0]), float(q[2]), device_ms, kernels, runs)


def _cupti(fn, sets, runs):
    try:
        from jax.experimental.mosaic.gpu import profiler
    except Exception:  # noqa: BLE001 - CUPTI is optional
        return None, None
    try:
        iters = max(1, min(runs, 20))
        totals = []
        per_kernel = None
        one_call = _one_call_timer(profiler) if len(sets) > 1 else None
        if len(sets) > 1:
            # rotating: one call per set in turn, so a call never finds its own inputs in L2
            # (measure's iterations repeat the same arguments back to back); the turn goes on
            # from time_fn's last wall-clock call (set (runs - 1) % n), not back to set 0
            calls = [(sets[(runs + j) % len(sets)], 1) for j in range(max(iters, len(sets)))]
        else:
            calls = [(sets[0], iters)]
        for a, n in calls:
            if one_call is not None:
                timings = one_call(fn, a)
            else:
                _, timings = profiler.measure(fn, aggregate=False, iterations=n)(*a)
            if not timings:
                continue
            if n == 1:
                # one iteration comes back as one flat [(name, ms), ...], not a list per iteration
                timings = [timings]
            for it in timings:
                totals.append(sum(t for _, t in it))
            per_kernel = timings[len(timings) // 2]
        if not totals:
            return None, None
        return float(statistics.median(totals)), [(n, float(t)) for n, t in per_kernel]
    except Exception as e:  # noqa: BLE001 - fall back to wall-clock only
        print(f"[timing] CUPTI unavailable: {e}", file=sys.stderr)
        return None, None


def _one_call_timer(profiler):
    """``timer(fn, args) -> [(kernel, ms), ...]`` for exactly one call, or None where jax's
    CUPTI extension is not reachable (then rotated sets are timed through ``measure``, warm).

    ``profiler.measure`` runs a warm-up call on the same arguments right before the timed
    one, which leaves those arguments in the L2: a rotated set smaller than the L2 (50 MB on
    the H100) was timed warm, at L2 speed. Here nothing runs between the previous call of
    the rotation (another set) and the timed one. With ``measure``, B=8 sparse decode read
    faster below the L2's size than above it, a step that timed cold does not show
    (docs/kernels.md, 'A timing defect', its table)."""
    lib = getattr(profiler, "mosaic_gpu_lib", None)
    ext = getattr(lib, "_mosaic_gpu_ext", None)
    if ext is None or not hasattr(ext, "_cupti_init") or not hasattr(ext, "_cupti_get_timings"):
        print("[timing] CUPTI extension not found: rotated sets are timed through measure(), "
              "whose warm-up leaves a set under 50 MB in the L2", file=sys.stderr)
        return None

    def timer(fn, args):
        ext._cupti_init()
        try:
            jax.block_until_ready(fn(*args))
        finally:
            timings = ext._cupti_get_timings(True)
        return timings

    return timer


def per_step_wall_ms(step: Callable, args: Sequence[Any], *, counts: tuple[int, int] = (8, 24), runs: int = 20,
                     warmup: int = 3) -> float:
    """Wall time of one ``step(q, *rest) -> out`` (``out`` shaped like ``q``) when the GPU runs
    many back to back inside one program, as a model's decode step runs its layers: the
    gaps between kernels count, the host's dispatch of the call does not.

    Two programs unroll ``counts`` steps each, every query nudged by the previous output (so
    nothing is hoisted or shared between steps); the slope of their median wall times over
    the step count is the answer, which cancels the fixed cost of dispatching one call.
    ``args`` may be a list of argument tuples (:func:`cold_sets`): step ``i`` reads set
    ``i % len``, so consecutive steps do not find their inputs in the L2, as a model's
    layers (each with its own cache) do not."""
    sets = list(args) if isinstance(args, list) else [tuple(args)]

    def chain(n):
        def run(all_sets):
            out = jnp.zeros_like(all_sets[0][0])
            for i in range(n):
                q, *rest = all_sets[i % len(all_sets)]
                out = step(q + (1e-3 * out).astype(q.dtype), *rest)
            return out
        return jax.jit(run)

    short, long = (time_fn(chain(n), (sets,), warmup=warmup, runs=runs, cupti=False).wall_ms for n in counts)
    return (long - short) / (counts[1] - counts[0])


H100_L2_BYTES = 50 * 2**20


def rotation_sets(nbytes_per_set: float, *, max_sets: int = 8) -> int:
    """How many input sets a timed call must cycle through so that each call reads HBM,
    not the L2 the previous call filled: together at least three L2s (the H100's is
    50 MB), at most ``max_sets``. One set when a single set is already that large."""
    return int(max(1, min(max_sets, -(-3 * H100_L2_BYTES // max(int(nbytes_per_set), 1)))))


def cold_sets(args: Sequence[Any], nbytes: float, *, max_sets: int = 8) -> list[tuple]:
    """``args`` and copies of it (every array leaf in its own new buffer, same values) to
    cycle through with ``time_fn(..., rotate=True)``, so that each timed call reads its
    ``nbytes`` from HBM as a model's layer does, not from the L2 that the previous calls
    filled: :func:`rotation_sets` of them (one, ``args`` itself, when ``nbytes`` is
    already three L2s)."""
    def copy(x):
        return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x

    n = rotation_sets(nbytes, max_sets=max_sets)
    return [tuple(args)] + [tuple(jax.tree.map(copy, a) for a in args) for _ in range(n - 1)]


def hbm_floor_ms(nbytes: float, bandwidth: float = H100_HBM_BYTES_PER_S) -> float:
    """Time to move ``nbytes`` through HBM at ``bandwidth`` bytes/s, in ms."""
    return nbytes / bandwidth * 1e3


def stamp(command: str | None = None) -> dict:
    """Device, jax version, date, command and git commit for a results file."""
    dev = jax.devices()[0]
    # GIT_COMMIT first: a copied working tree (the GPU machine's) can carry a
    # stale .git whose HEAD is not the code that runs
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            # uncommitted changes to tracked files: the code that runs is not HEAD's
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, check=False).stdout.strip()
            if commit and dirty:
                commit += "+uncommitted"
        except OSError:
            commit = ""
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command or _command_line(),
        "git_commit": commit,
    }


def _command_line() -> str:
    """How this process was started, as ``python -m pkg.module args`` where it was."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"
    return " ".join([head, *(shlex.quote(a) for a in sys.argv[1:])])


def write_results(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` under ``out_dir`` (default results/)."""
    out = Path(out_dir or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=float))
    (out / f"{name}.md").write_text(markdown)
    return out


def write_final_results(name: str, payload: dict, render, plot, out_dir: Path | None = None) -> Path:
    """:func:`write_results` of ``render(payload)``, then ``plot(payload, <dir>/<name>.png)``
    (a failed plot is reported, not raised: the numbers are written), and the markdown
    printed."""
    md = render(payload)
    path = write_results(name, payload, md, out_dir)
    try:
        plot(payload, path / f"{name}.png")
    except Exception as e:  # noqa: BLE001 - the plot is optional, the numbers are written
        print(f"plot failed: {e}", file=sys.stderr)
    print(md)
    return path


def logit_agreement(got: np.ndarray, ref: np.ndarray) -> dict:
    """``max_dlogit`` (max |difference|) and ``argmax_agree`` (fraction of rows) of logits
    ``got`` against ``ref`` (``[B, V]``; ``got``'s first ``len(ref)`` rows)."""
    got = got[: ref.shape[0]]
    return {"max_dlogit": float(np.max(np.abs(got - ref))),
            "argmax_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}


def use_compile_cache_flag(path: str) -> str:
    """A benchmark's ``--compile-cache DIR``: jax's persistent compilation cache in ``path``
    (:func:`models.serving.precompile.use_compile_cache`), said on stdout; exits with the
    reason where it cannot be used (a file, not writable). Returns the absolute path."""
    from models.serving.precompile import use_compile_cache

    try:
        path = use_compile_cache(path)
    except (ValueError, OSError) as e:
        raise SystemExit(f"--compile-cache: {e}")
    print(f"compile cache: {path}", flush=True)
    return path


def parse_list(s: str, cast=int) -> list:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (an argparse ``type``; blank items skipped): a bad item
    is an :class:`argparse.ArgumentTypeError` naming the whole argument."""
    try:
        return [cast(x) for x in s.split(",") if x.strip()]
    except ValueError:
        what = "integers" if cast is int else "numbers"
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None


def markdown_table(rows: list[dict], columns: list[str], fmt: dict[str, str] | None = None) -> str:
    fmt = fmt or {}
    head = "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    body = ""
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            if isinstance(v, float) and c in fmt:
                v = format(v, fmt[c])
            elif isinstance(v, float):
                v = f"{v:.4g}"
            cells.append(str(v))
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def time_steps(step, cache, tokens, steps: int, rounds: int):
    """Median ms per step over ``rounds`` rounds of ``steps`` back-to-back steps."""
    logits, cache = step(tokens, cache)  # warm-up (compiled before)
    jax.block_until_ready(logits)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(tokens, cache)
        jax.block_until_ready(logits)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times), cache
