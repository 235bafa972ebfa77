"""benchmarks.kernels' model-path row: the AsyncTLS method step it times is the method's own
decode (channels, state and layer plumbed as the model's driver does)."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels as kb
from sparse_jax.ops.dense import dense_decode_reference


def _inputs(b, s):
    q, k, v = kb.make_inputs(jax.random.key(3), b, s)
    channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
    return q, k, v, channels


def test_method_step_is_dense_when_the_budget_covers_the_context():
    b, s = 2, 512
    q, k, v, channels = _inputs(b, s)
    lengths = jnp.array([s, s - 77], jnp.int32)
    fn, state = kb.asynctls_method_step(512, k, lengths, channels, impl="reference")
    got = np.asarray(fn(q, k, v, lengths, state), np.float32)
    ref = np.asarray(dense_decode_reference(q, k, v, lengths), np.float32)
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_method_step_selects_when_the_context_is_longer():
    b, s = 1, 4096
    q, k, v, channels = _inputs(b, s)
    lengths = jnp.array([s], jnp.int32)
    fn, state = kb.asynctls_method_step(512, k, lengths, channels, impl="reference")
    got = np.asarray(fn(q, k, v, lengths, state), np.float32)
    ref = np.asarray(dense_decode_reference(q, k, v, lengths), np.float32)
    assert got.shape == (b, kb.HQ, kb.D) and np.all(np.isfinite(got))
    assert np.abs(got - ref).max() > 1e-2  # 512 of 4,096 tokens: not the dense answer


def test_method_step_runs_the_8bit_filter_by_default():
    """The benchmark's model-path row runs the method's default, 8-bit boxes (the state holds
    codes), and its ``[bf16 boxes]`` row the exact boxes; 4,096 tokens are 64 blocks, fewer
    than the filter keeps (128), so both steps select the same tokens."""
    from pallas_kernels.quantized_boxes import QuantizedBoxes
    from sparse_jax.methods.quest import BlockBoxes

    b, s = 1, 4096
    q, k, v, channels = _inputs(b, s)
    lengths = jnp.array([s], jnp.int32)
    fn8, state8 = kb.asynctls_method_step(512, k, lengths, channels, impl="reference")
    assert isinstance(state8.boxes, QuantizedBoxes)
    fn, state = kb.asynctls_method_step(512, k, lengths, channels, impl="reference", box_bits=None)
    assert isinstance(state.boxes, BlockBoxes)
    got8 = np.asarray(fn8(q, k, v, lengths, state8), np.float32)
    got = np.asarray(fn(q, k, v, lengths, state), np.float32)
    np.testing.assert_allclose(got8, got, rtol=1e-6, atol=1e-6)


def test_bad_budgets_are_refused_before_any_device_work():
    """``--budgets`` is checked first: on this CPU machine a good list would stop at the
    GPU check instead, so the messages below can only come from the argument check."""
    import pytest

    from benchmarks import kernels

    for bad, msg in (("0,512", "every K must be >= 1"), ("512,x", "comma-separated integers")):
        with pytest.raises(SystemExit, match=msg):
            kernels.main(["--budgets", bad])
    with pytest.raises(SystemExit, match="needs a GPU"):
        kernels.main(["--budgets", "2048", "--shapes", "8x131072"])


def test_untuned_classes_are_reported_and_merged(tmp_path):
    """A class the tuned table has no entry for runs the kernels' defaults silently;
    ``tuning.untuned_classes`` remembers each one looked up, and the kernels results (and a
    ``--merge`` of them) list them."""
    import json

    from benchmarks import kernels
    from pallas_kernels import tuning

    tuning.set_device_kind("NVIDIA H200")  # the class was measured there (the CPU reads no entries)
    try:
        assert tuning.tuned("sparse_decode", rows=64, k=2048, d=128, g=4)  # in the table: not missed
        assert "sparse_decode|rows=64|k=2048|d=128|g=4" not in tuning.untuned_classes()
    finally:
        tuning.set_device_kind(None)
    assert tuning.tuned("sparse_decode", rows=3, k=5, d=48, g=7) == {}
    missed = "sparse_decode|rows=4|k=8|d=48|g=7"
    assert missed in tuning.untuned_classes()

    info = {"device": "cpu", "jax": jax.__version__, "date": "today", "command": "test"}
    row = {"B": 1, "S": 64, "K": 8, "kernel": "k", "ms": 1.0}
    for name, untuned in (("a", [missed]), ("b", ["topk|rows=8|n=512|k=128", missed])):
        md = kernels.write_all(name, info, [], [row], tmp_path, untuned)
        assert f"- `{missed}`" in md
    kernels.main(["--merge", f"{tmp_path}/a.json,{tmp_path}/b.json", "--name", "ab", "--out", str(tmp_path)])
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert merged["untuned_classes"] == ["sparse_decode|rows=4|k=8|d=48|g=7", "topk|rows=8|n=512|k=128"]
    assert "- `topk|rows=8|n=512|k=128`" in (tmp_path / "ab.md").read_text()
    assert "without a tuned entry" not in kernels.write_all("c", info, [], [row], tmp_path)  # none given: no section
