"""benchmarks.timing's CUPTI pass, with a stand-in for jax's profiler (no GPU here)."""

from __future__ import annotations

import sys
import types

from benchmarks import timing


def _fake_profiler(monkeypatch):
    """measure(...)(*a) as jax 0.11 returns it with aggregate=False: a flat list of
    (kernel, ms) for one iteration, a list of such lists for several."""
    calls = []

    def measure(fn, *, aggregate, iterations):
        assert aggregate is False

        def run(*a):
            calls.append((a, iterations))
            one = [("kernel_a", 0.25), ("kernel_b", 0.5)]
            return None, one if iterations == 1 else [one] * iterations

        return run

    mod = types.ModuleType("jax.experimental.mosaic.gpu.profiler")
    mod.measure = measure
    pkg = types.ModuleType("jax.experimental.mosaic.gpu")
    pkg.profiler = mod
    monkeypatch.setitem(sys.modules, "jax.experimental.mosaic.gpu", pkg)
    monkeypatch.setitem(sys.modules, "jax.experimental.mosaic.gpu.profiler", mod)
    return calls


def test_cupti_rotating_sets_one_call_each(monkeypatch):
    calls = _fake_profiler(monkeypatch)
    sets = [(i,) for i in range(3)]
    ms, kernels = timing._cupti(lambda x: x, sets, runs=5)
    assert ms == 0.75 and kernels == [("kernel_a", 0.25), ("kernel_b", 0.5)]
    assert [c[1] for c in calls] == [1] * 5 and [c[0][0] for c in calls] == [0, 1, 2, 0, 1]


def test_cupti_one_set_many_iterations(monkeypatch):
    calls = _fake_profiler(monkeypatch)
    ms, kernels = timing._cupti(lambda x: x, [(0,)], runs=5)
    assert ms == 0.75 and kernels == [("kernel_a", 0.25), ("kernel_b", 0.5)]
    assert calls == [((0,), 5)]
