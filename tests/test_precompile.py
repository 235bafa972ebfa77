"""The engine's ahead-of-time compiles: one that runs out of device memory beside the others
(XLA's GEMM autotuner claims scratch per compile) is tried once more alone, and one that
fails alone too is named and left to compile when first used."""

import threading
import time

import jax.numpy as jnp

from models.serving.precompile import AheadOfTime, ExclusiveOnFailure


class _Memory:
    """Compiles that each claim one of ``units`` of device memory for ``hold`` seconds; a
    compile that finds none free raises like XLA's autotuner does."""

    def __init__(self, units: int, hold: float = 0.05):
        self.units, self.hold, self.lock, self.busy, self.most = units, hold, threading.Lock(), 0, 0

    def program(self, name: str, need: int = 1):
        memory = self

        class Lowered:
            def compile(self):
                with memory.lock:
                    if memory.busy + need > memory.units:
                        raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate ({name})")
                    memory.busy += need
                    memory.most = max(memory.most, memory.busy)
                time.sleep(memory.hold)
                with memory.lock:
                    memory.busy -= need
                return f"executable {name}"

        class Program:
            def lower(self, *args, **static):
                return Lowered()

        return Program()


def _jobs(memory, needs):
    return [(f"p{i}", memory.program(f"p{i}", need), (jnp.zeros((i + 1,), jnp.int32),), {})
            for i, need in enumerate(needs)]


def test_compiles_that_run_out_of_memory_together_run_again_alone():
    memory = _Memory(units=1)  # room for one compile at a time
    aot = AheadOfTime()
    done = aot.compile(_jobs(memory, [1] * 6), workers=4)
    assert done["failed"] == [] and done["programs"] == 6
    assert 1 <= done["retried_alone"] <= 5  # the first to start fits; those beside it ran again alone
    assert len(aot.compiled) == 6 and memory.most == 1


def test_a_compile_that_does_not_fit_alone_is_named_and_the_others_build():
    memory = _Memory(units=2)
    aot = AheadOfTime()
    done = aot.compile(_jobs(memory, [1, 3, 1]), workers=1)  # p1 needs more than the device has
    assert done["programs"] == 2 and len(done["failed"]) == 1 and done["failed"][0].startswith("p1: RuntimeError")
    assert done["retried_alone"] == 1 and aot.failed == done["failed"]


def test_other_errors_are_not_retried():
    class Broken:
        def lower(self, *a, **k):
            raise TypeError("bad shapes")

    aot = AheadOfTime()
    done = aot.compile([("broken", Broken(), (jnp.zeros(2),), {})], workers=2)
    assert done["retried_alone"] == 0 and done["failed"] == ["broken: TypeError: bad shapes"]


def test_exclusive_waits_for_the_shared_ones_and_blocks_new_ones():
    gate, log = ExclusiveOnFailure(), []

    def shared(name, hold):
        with gate.shared():
            log.append(("start", name))
            time.sleep(hold)
            log.append(("end", name))

    first = threading.Thread(target=shared, args=("a", 0.1))
    first.start()
    time.sleep(0.02)

    def alone():
        with gate.alone():
            log.append(("start", "alone"))
            time.sleep(0.05)
            log.append(("end", "alone"))

    t = threading.Thread(target=alone)
    t.start()
    time.sleep(0.02)
    late = threading.Thread(target=shared, args=("b", 0.0))  # asks while the exclusive one waits
    late.start()
    for th in (first, t, late):
        th.join(2)
    assert log.index(("end", "a")) < log.index(("start", "alone"))
    assert log.index(("end", "alone")) < log.index(("start", "b"))
    assert gate.alone_runs == 1
