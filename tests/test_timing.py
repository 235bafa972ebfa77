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


def _fake_extension(monkeypatch, log):
    """jax's CUPTI extension as the one-call timer drives it: init, the call, timings."""
    ext = types.SimpleNamespace(_cupti_init=lambda: log.append("init"),
                                _cupti_get_timings=lambda finalize: [("kernel_a", 0.25), ("kernel_b", 0.5)])
    mod = sys.modules["jax.experimental.mosaic.gpu.profiler"]
    mod.mosaic_gpu_lib = types.SimpleNamespace(_mosaic_gpu_ext=ext)


def test_cupti_rotating_sets_one_cold_call_each(monkeypatch):
    """Each timed call is the only call on its set since the previous set's: no warm-up on
    the same arguments (measure's would leave a set under 50 MB in the L2)."""
    calls = _fake_profiler(monkeypatch)
    log = []
    _fake_extension(monkeypatch, log)
    sets = [(i,) for i in range(3)]
    ms, kernels = timing._cupti(lambda x: log.append(x) or x, sets, runs=5)
    assert ms == 0.75 and kernels == [("kernel_a", 0.25), ("kernel_b", 0.5)]
    assert calls == []  # measure() is not used
    # the turn goes on after time_fn's last wall-clock call (runs=5: set 1), from set 2
    assert log == ["init", 2, "init", 0, "init", 1, "init", 2, "init", 0]


def test_cupti_rotating_falls_back_to_measure_without_the_extension(monkeypatch):
    calls = _fake_profiler(monkeypatch)
    sets = [(i,) for i in range(3)]
    ms, kernels = timing._cupti(lambda x: x, sets, runs=5)
    assert ms == 0.75 and kernels == [("kernel_a", 0.25), ("kernel_b", 0.5)]
    assert [c[1] for c in calls] == [1] * 5 and [c[0][0] for c in calls] == [2, 0, 1, 2, 0]


def test_cupti_one_set_many_iterations(monkeypatch):
    calls = _fake_profiler(monkeypatch)
    ms, kernels = timing._cupti(lambda x: x, [(0,)], runs=5)
    assert ms == 0.75 and kernels == [("kernel_a", 0.25), ("kernel_b", 0.5)]
    assert calls == [((0,), 5)]


def test_stamp_says_when_the_tree_is_not_its_commit(tmp_path, monkeypatch):
    """A results file names the commit, and ``+uncommitted`` when tracked files differ from it
    (a run started before its code was committed); GIT_COMMIT (the GPU machine's copy) wins."""
    import subprocess

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    (tmp_path / "untracked.txt").write_text("scratch")  # untracked files do not count
    assert timing.stamp("c")["git_commit"] == head
    (tmp_path / "f.py").write_text("x = 2\n")
    assert timing.stamp("c")["git_commit"] == head + "+uncommitted"
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    assert timing.stamp("c")["git_commit"] == "abc123"


def test_rotation_sets_reach_three_l2s():
    l2 = timing.H100_L2_BYTES
    assert timing.rotation_sets(64 * 2**20) == 3  # B=8, K=2048 selections: 64 MB each
    assert timing.rotation_sets(32 * 2**20) == 5
    assert timing.rotation_sets(1) == 8  # capped
    assert timing.rotation_sets(4 * l2) == 1  # one set already streams from HBM
    for n in (2**20, 7 * 2**20, 40 * 2**20, 150 * 2**20):
        k = timing.rotation_sets(n)
        assert k == 8 or k * n >= 3 * l2


def test_tune_sweep_checks_the_first_set_and_times_all(monkeypatch):
    import jax.numpy as jnp

    from benchmarks import tune

    seen = []
    real = tune.time_fn

    def spy(f, args, **kw):
        seen.append((len(args) if kw.get("rotate") else 1, kw.get("rotate", False)))
        return real(f, args, **kw)

    monkeypatch.setattr(tune, "time_fn", spy)
    monkeypatch.setattr(tune, "DEADLINE", float("inf"))
    x, y = jnp.arange(4.0), jnp.arange(4.0) + 10
    rows = []
    best = tune.sweep("double", lambda a, scale: a * scale, [(x,), (y,)], x * 2,
                      [{"scale": 2.0}, {"scale": 3.0}], 16, 2, rows, "s")
    assert best[0] == {"scale": 2.0}
    assert seen == [(2, True)]  # only the right config is timed, over both sets
    assert [r["config"] for r in rows] == ['{"scale": 2.0}', '{"scale": 3.0}']
    assert rows[1]["ms"] != rows[1]["ms"]  # the wrong config is reported (NaN), not timed


def test_per_step_wall_ms_chains_the_steps():
    import jax.numpy as jnp

    calls = []

    def step(q, w):
        calls.append(q.shape)  # traced once per unrolled step
        return jnp.tanh(q @ w)

    q, w = jnp.ones((4, 8)), jnp.eye(8) * 0.5
    ms = timing.per_step_wall_ms(step, (q, w), counts=(2, 5), runs=3, warmup=1)
    assert len(calls) == 2 + 5  # each program unrolls its count of steps
    assert isinstance(ms, float) and ms == ms


def test_per_step_wall_ms_cycles_the_sets():
    import jax.numpy as jnp

    seen = []

    def step(q, w):
        seen.append(id(w))  # one tracer per distinct argument of the traced chain
        return jnp.tanh(q @ w)

    sets = timing.cold_sets((jnp.ones((4, 8)), jnp.eye(8)), 20 * 2**20)  # 3 sets of distinct buffers
    assert len(sets) == 8 and len(seen) == 0
    timing.per_step_wall_ms(step, sets[:3], counts=(2, 5), runs=2, warmup=1)
    # the 5-step chain reads sets 0, 1, 2, 0, 1: three distinct traced arguments in turn
    five = seen[2:]
    assert five[0] != five[1] != five[2] and five[3] == five[0] and five[4] == five[1]


def test_cold_sets_copy_every_array_into_new_buffers():
    import jax.numpy as jnp
    import numpy as np

    q, k = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4), jnp.bfloat16)
    sets = timing.cold_sets((q, {"k": k, "n": 3}, None), 40 * 2**20)
    assert len(sets) == timing.rotation_sets(40 * 2**20) == 4
    assert sets[0][0] is q
    for s in sets[1:]:
        assert s[0] is not q and s[1]["k"] is not k
        assert s[0].unsafe_buffer_pointer() != q.unsafe_buffer_pointer()
        np.testing.assert_array_equal(s[0], q)
        assert s[1]["k"].dtype == jnp.bfloat16 and s[1]["n"] == 3 and s[2] is None
    assert len(timing.cold_sets((q,), 10 * timing.H100_L2_BYTES)) == 1
