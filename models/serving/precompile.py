"""Programs compiled ahead of time, in background threads, and run before their jitted twins.

A served model's first long prompts otherwise compile a program per chunk size and key bucket
as they arrive (~3 min for a 32K load on the Qwen3-8B shape on the H200, one at a time).
:class:`AheadOfTime` compiles a list of ``(what, program, args, static)`` jobs (the engine's
:meth:`models.serving.paged.PagedSlots.program_shapes`) in threads (XLA compiles with the GIL
released) and :meth:`AheadOfTime.run` runs a call on its executable when one was built; a call
whose program is still compiling waits for that compile rather than compiling it a second time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp


def aot_key(program, args: tuple, static: dict) -> tuple:
    """What an ahead-of-time compiled ``program`` is looked up by: the program, its static
    arguments, and every argument's tree, shapes and dtypes (concrete or abstract alike)."""
    leaves, tree = jax.tree.flatten(args)
    return (id(program), tuple(sorted(static.items())), tree,
            tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves))


class AheadOfTime:
    """The executables of one engine's programs, by :func:`aot_key`.

    ``compiled``: those built; ``pending``: those compiling in the background (futures);
    ``failed``: what failed to compile ahead (each compiles when first used); ``aot_calls`` /
    ``jit_calls``: calls that ran an executable / went to the jitted program (which compiles on
    a new shape; after :meth:`compile` it stays 0); ``waited_calls``: of the first, those that
    waited for their program's compile."""

    def __init__(self):
        self.compiled: dict[tuple, Any] = {}
        self.pending: dict[tuple, concurrent.futures.Future] = {}
        self.failed: list[str] = []
        self.aot_calls = self.jit_calls = self.waited_calls = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def compiling(self) -> int:
        """Programs still compiling in the background."""
        return len(self.pending)

    def lookup(self, program, args: tuple, static: dict):
        """The executable for this call, waiting for it if it is compiling in the background;
        None: the call runs the jitted program. Counted in the ``*_calls``."""
        key = aot_key(program, args, static)
        aot = self.compiled.get(key)
        if aot is None:
            fut = self.pending.get(key)
            if fut is not None and not fut.cancelled():
                aot = fut.result()[0]  # None if it failed: the jitted program then compiles it
                self.waited_calls += aot is not None
            else:  # its compile may have ended between the two reads (it stores, then unlists)
                aot = self.compiled.get(key)
        if aot is None:
            self.jit_calls += 1
        else:
            self.aot_calls += 1
        return aot

    def run(self, program, args: tuple, static: dict):
        """``program(*args, **static)``, on its ahead-of-time executable where there is one."""
        aot = self.lookup(program, args, static)
        return aot(*args) if aot is not None else program(*args, **static)

    def cancel(self) -> None:
        """Drop the background compiles not yet started (the engine stops: a process exiting
        would otherwise wait for every one of them); those running finish."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def compile(self, jobs, *, workers: int | None = None, progress: bool = False,
                background: bool = False) -> dict:
        """Compile ``jobs`` (``(what, program, args, static)``, smallest first) not already
        built or pending, in ``workers`` threads. Returns ``{"programs": n, "seconds": s,
        "failed": [...], "from_cache": k}`` (``k`` compiles loaded from the compile cache,
        :func:`use_compile_cache`); a job that fails is left to compile when first used, and named.
        ``progress``: a bar on stderr. ``background``: return at once (``{"programs": n
        submitted, "seconds": 0.0, "failed": [], "background": True}``), failures printed to
        stderr and kept in :attr:`failed`.

        A compile that runs out of device memory (``RESOURCE_EXHAUSTED``: XLA's GEMM autotuner
        runs candidates on redzone copies of a fusion's operands, up to the largest stacked
        weight) is tried once more alone, no other compile running
        (:class:`ExclusiveOnFailure`): on the H200 capped at ~49 GB (benchmark C, 2026-12-06)
        eight compiles beside a dense engine's pool each asked 3.39 GiB and 5 of 13 programs
        failed, where one at a time fits. The result's ``retried_alone`` counts them."""
        keyed = [(aot_key(*job[1:]), job) for job in jobs]
        keyed = [(key, job) for key, job in keyed if key not in self.compiled and key not in self.pending]
        workers = workers or min(8, os.cpu_count() or 1)
        t0 = time.perf_counter()
        hits = CACHE_EVENTS["hits"]

        gate = ExclusiveOnFailure()

        def build(job):
            what, program, args, static = job
            try:
                with gate.shared():
                    return program.lower(*args, **static).compile(), None
            except Exception as e:  # noqa: BLE001 - that program compiles when first used, as without this
                if "RESOURCE_EXHAUSTED" in str(e):  # the other compiles' scratch: once more, alone
                    try:
                        with gate.alone():
                            return program.lower(*args, **static).compile(), None
                    except Exception as e2:  # noqa: BLE001
                        e = e2
                return None, f"{what}: {type(e).__name__}: {str(e)[:300]}"

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(keyed), desc="precompiling the engine's programs", unit="program", file=sys.stderr)
        failed = []

        def done(key, fut):  # in the compiling thread: the executable goes in before the pending entry goes
            if fut.cancelled():  # cancel()
                self.pending.pop(key, None)
                return
            compiled, error = fut.result()
            if error is None:
                self.compiled[key] = compiled
            else:
                failed.append(error)
                self.failed.append(error)
                if background:  # no caller waits to report it
                    print(f"not compiled ahead (compiles when first used): {error}", file=sys.stderr, flush=True)
            self.pending.pop(key, None)
            if bar is not None:
                bar.update()
                if not self.pending:
                    bar.close()

        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sparse-jax-compile")
        for key, job in keyed:
            fut = pool.submit(build, job)
            self.pending[key] = fut  # before the callback, which may run at once
            fut.add_done_callback(functools.partial(done, key))
        self._pool = pool
        pool.shutdown(wait=not background)  # the threads end once their jobs are done
        if background:
            return {"programs": len(keyed), "seconds": 0.0, "failed": [], "background": True}
        if bar is not None:
            bar.close()
        return {"programs": len(keyed) - len(failed), "seconds": time.perf_counter() - t0, "failed": failed,
                "from_cache": CACHE_EVENTS["hits"] - hits, "retried_alone": gate.alone_runs}


class ExclusiveOnFailure:
    """Compiles run side by side (:meth:`shared`); one that failed for memory runs again
    :meth:`alone`: it waits until no other compile runs, and none starts until it ends."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._exclusive = False
        self.alone_runs = 0

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True  # no new compile starts; wait for the running ones
            self._cond.wait_for(lambda: self._running == 0)
            self.alone_runs += 1
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


#: the compile cache's events in this process (``hits``, ``misses``), once :func:`use_compile_cache` ran
CACHE_EVENTS: collections.Counter = collections.Counter()
_listening = False


def _count_cache_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        CACHE_EVENTS["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        CACHE_EVENTS["misses"] += 1


def default_compile_cache_dir() -> str:
    """Where a server keeps its compiled programs by default: ``$SPARSE_JAX_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/sparse-jax/xla`` (``~/.cache/sparse-jax/xla``)."""
    env = os.environ.get("SPARSE_JAX_COMPILE_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparse-jax", "xla")


def use_compile_cache(path: str, min_compile_s: float = 1.0) -> str:
    """Keep this process's compiled programs in ``path`` (jax's persistent compilation cache, with
    XLA's per-fusion autotuning results beside them) and load them from there: a server started
    again on the same machine, jax and flags loads its programs instead of compiling them. At a
    128K context one program compiles for 11-49 s on an H100 (the decode step 40 s, the last
    chunk 49 s; docs/serving.md, 'Each program alone, measured') and an engine has ~15-30 of them. Programs that
    compile in less than ``min_compile_s`` are not kept. Process-wide (jax has one cache); call
    it before the first compile. Returns the absolute path."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"the compile cache is a directory path, got {path!r}")
    if min_compile_s < 0:
        raise ValueError(f"min_compile_s must be >= 0, got {min_compile_s!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"the compile cache {path!r} is a file, not a directory")
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise ValueError(f"the compile cache {path!r} is not writable")
    global _listening
    if not _listening:  # once per process: jax keeps its listeners
        jax.monitoring.register_event_listener(_count_cache_event)
        _listening = True
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compile_cache_entries(path: str) -> int:
    """Programs kept in the compile cache at ``path`` (0 where it does not exist)."""
    try:
        return sum(1 for e in os.scandir(path) if e.is_file() and e.name.endswith("-cache"))
    except FileNotFoundError:
        return 0
