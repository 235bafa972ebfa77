"""The layer driver's mode for the models a test builds."""

import functools


def driver_mode(monkeypatch, unroll: bool) -> None:
    """Models built from here on, until the test ends, run the layer driver unrolled or
    scanned everywhere, decode step included (the CPU's default decode step is unrolled
    over the layers' rows whatever ``default_unroll`` says: a test of the scanned driver
    turns that off too). The test gets its own cache of ``build_functions``, so it neither
    reuses programs built in the other mode nor leaves its own behind."""
    from models import programs

    monkeypatch.setattr(programs, "default_unroll", lambda: unroll)
    monkeypatch.setattr(programs, "rows_decode", lambda: False)
    fresh = functools.lru_cache(maxsize=32)(programs.build_functions.__wrapped__)
    monkeypatch.setattr(programs, "build_functions", fresh)
