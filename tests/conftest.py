"""Fixtures shared by the test modules."""

import functools
import os

import pytest


@pytest.fixture
def abstract_h100(monkeypatch):
    """Lower Pallas-Triton kernels for CUDA on a CPU-only machine (no GPU needed):
    catches ops the Triton lowering rejects (non-power-of-two tensors,
    unsupported primitives) before the code reaches a GPU."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
        info = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
    except (ImportError, AttributeError) as e:  # private API moved: skip, not fail
        pytest.skip(f"cannot fake a GPU for lowering: {e}")
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda *a, **k: info)



def pytest_collection_modifyitems(config, items):
    """Under ``make test-gpu`` (SPARSE_JAX_GPU_TESTS=1) the kernel tests' ``impl="reference"``
    cases are deselected: they run no GPU code, and ``make test`` runs them on the CPU."""
    if os.environ.get("SPARSE_JAX_GPU_TESTS") != "1":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("impl") == "reference" else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True, scope="session")
def _read_real_weights_once():
    """Each preset's real weights are read once per test process (``models.api.read_real_weights``
    behind a cache): ~9 s for SmolLM2 in f32 on the CI machine, and dozens of tests load it. The
    params are immutable arrays, so sharing them changes nothing a test can observe; the read
    itself is still tested (the first load of each process, and ``tests/test_loaders.py``)."""
    from models import api

    real = api.read_real_weights
    api.read_real_weights = functools.lru_cache(maxsize=4)(real)
    yield
    api.read_real_weights = real
