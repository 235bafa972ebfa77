"""``python -m models.generate`` in a subprocess with forced CPU devices (the count must be
set before jax starts), and its output read: the header line in brackets, then the
generated text up to the report's rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_generate(args: list[str], devices: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "models.generate", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def texts_with_and_without(args: list[str], flag: list[str], marker: str, devices: int = 2) -> list[str]:
    """The generated text of ``args`` and of ``args + flag``; each run must exit 0, and its
    header must name ``marker`` exactly when ``flag`` is given."""
    texts = []
    for extra in ([], flag):
        proc = run_generate([*args, *extra], devices)
        assert proc.returncode == 0, proc.stderr[-3000:]
        head, rest = proc.stdout.split("]\n", 1)
        texts.append(rest.split("-" * 72)[0])
        assert (marker in head) == bool(extra), head
    return texts
