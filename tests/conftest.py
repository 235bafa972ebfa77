"""Fixtures shared by the test modules."""

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

