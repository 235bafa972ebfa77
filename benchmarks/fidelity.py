"""Fidelity of a sparse method against dense attention on real long text.

Text: the sources of a fixed, sorted list of Python standard-library modules
(:func:`benchmarks.ruler_tasks.stdlib_source_text`), concatenated and tokenized
to the target length; batch row ``r`` starts ``r`` modules later.

Three measurements per (method, budget, length), all teacher-forced on the same
token stream (prefill ``length - steps`` text tokens, then feed the next text
token and afterwards dense's greedy continuation):

* **Per layer and query head** (:class:`FidelityProbe`): the attention-output
  relative error ``||o_method - o_dense|| / ||o_dense||`` and the fraction of
  the oracle top-K attention mass the method's selection recovers: the dense
  softmax mass on the selected tokens divided by the mass on the query head's
  own top-K tokens, ``K`` = the number of distinct tokens the method selected
  for the head's KV group. The probe wraps the method and returns the *dense*
  output, so the model runs dense and every layer sees the same inputs as in
  the dense run; the metrics ride in the layer's cache state.
* **Next-token KL divergence** ``KL(p_dense || p_method)`` of the model running
  the method for real, averaged over the decode steps, and the **greedy
  agreement**: the fraction of steps where the method's argmax equals dense's.

Errors are measured in the model's dtype: with bfloat16 the floor of
``rel_err`` is bf16 rounding (~1e-3 -- 1e-2), not zero.

``max_logp_diff`` checks the teacher forcing: the largest log-probability
difference between the probe run and the dense run. It is 0 on CPU; on a GPU in
bfloat16 it was seen at up to 0.03 (the probe's graph, which also computes the
method's attention, is fused differently by XLA, so dense's sums round in
another order) -- small against the KL values it sits beside, but not exact.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.methods.base import AttentionMethod, DenseAttention
from sparse_jax.ops.dense import dense_prefill_attention, masked_decode_attention
from sparse_jax.methods.sparse_base import decode_probabilities

__all__ = [
    "FidelityProbe",
    "selection_mass_ratio",
    "relative_error",
    "fidelity_text_ids",
    "reference_run",
    "method_kl",
    "probe_metrics",
]


# -----------------------------------------------------------------------------
# Metrics (pure, jittable)
# -----------------------------------------------------------------------------


def relative_error(out: jax.Array, ref: jax.Array) -> jax.Array:
    """``||out - ref|| / ||ref||`` over the last axis, f32 (0 where both are 0)."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    num = jnp.linalg.norm(out - ref, axis=-1)
    den = jnp.linalg.norm(ref, axis=-1)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def dense_probabilities(q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact decode softmax ``[B, Hkv, G, S]`` f32 (0 past ``lengths``)."""
    return decode_probabilities(q, k, lengths)


def selection_mask(indices: jax.Array, counts: jax.Array, lengths: jax.Array, s: int) -> jax.Array:
    """Bool ``[B, Hkv, S]``: the valid positions named by ``indices[..., :counts]``."""
    b, hkv, kk = indices.shape
    live = jnp.arange(kk)[None, None, :] < counts[..., None]
    idx = jnp.where(live & (indices >= 0) & (indices < s), indices, s)  # dropped -> slot s
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(hkv)[None, :, None]
    mask = jnp.zeros((b, hkv, s + 1), bool).at[bi, hi, idx].set(True)[..., :s]
    return mask & (jnp.arange(s)[None, None, :] < lengths[:, None, None])


def selection_mass_ratio(q: jax.Array, k: jax.Array, lengths: jax.Array, indices: jax.Array,
                         counts: jax.Array) -> jax.Array:
    """Per query head ``f32[B, Hq]``: dense softmax mass on the selected tokens divided
    by the mass on that head's top-K tokens, K = distinct selected valid tokens of
    its KV group (1.0 when K is 0 or the context is empty)."""
    b, hq, _ = q.shape
    s = k.shape[2]
    p = dense_probabilities(q, k, lengths)  # [B, Hkv, G, S]
    sel = selection_mask(indices, counts, lengths, s)  # [B, Hkv, S]
    mass = jnp.sum(jnp.where(sel[:, :, None, :], p, 0.0), axis=-1)  # [B, Hkv, G]
    n_sel = jnp.sum(sel, axis=-1)  # [B, Hkv]
    top = jnp.cumsum(-jnp.sort(-p, axis=-1), axis=-1)  # prefix sums of the sorted masses
    at = jnp.clip(n_sel - 1, 0, s - 1)[:, :, None, None]
    best = jnp.take_along_axis(top, jnp.broadcast_to(at, p.shape[:3] + (1,)), axis=-1)[..., 0]
    best = jnp.where(n_sel[:, :, None] > 0, best, 0.0)
    ratio = jnp.where(best > 0, mass / jnp.where(best > 0, best, 1.0), 1.0)
    return ratio.reshape(b, hq)


# -----------------------------------------------------------------------------
# The probe
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FidelityProbe(AttentionMethod):
    """Wraps ``inner``: runs dense attention, records how far ``inner`` is from it.

    Each decode step, per layer, it computes the dense output and the inner
    method's (``inner.decode_attention``: the method as it really runs), and
    the inner method's selection (``inner.select`` with the same input state)
    for the attention-mass ratio. It returns the dense output (teacher
    forcing) and the state ``{"inner": ..., "rel_err": f32[B, Hq], "mass":
    f32[B, Hq]}`` whose metrics are those of the last step. ``mass`` is 1.0
    for a method without ``select`` that attends everything (dense) and NaN
    for any other method without ``select``.

    Not registered: construct it around a method,
    ``FidelityProbe(inner=get_method("quest", budget=512), num_q_heads=cfg.num_heads)``.
    Prefill is dense (the decode fidelity is what it measures).

    It runs on the layers where ``inner`` runs (its dense-layer rule); the
    other layers are exact, and :func:`probe_metrics` reports them as
    ``rel_err`` 0 and ``mass`` 1.

    Attributes:
      inner: the method measured.
      num_q_heads: query heads of the model (``init_state`` is not told them).
    """

    name: ClassVar[str] = "fidelity_probe"
    inner: AttentionMethod = DenseAttention()
    num_q_heads: int = 1

    def with_model_defaults(self, model_name):
        return dataclasses.replace(self, inner=self.inner.with_model_defaults(model_name))

    def for_model(self, model_name, *, num_layers, head_dim, sparse_layers=None):
        # the measured method may need per-model data (calibrated channels)
        inner = self.inner.for_model(model_name, num_layers=num_layers, head_dim=head_dim, sparse_layers=sparse_layers)
        return dataclasses.replace(self, inner=inner)

    @property
    def cache_multiple(self) -> int:
        return self.inner.cache_multiple

    def is_sparse_layer(self, index, num_layers):
        return self.inner.is_sparse_layer(index, num_layers)

    def layer_data(self, index):
        return self.inner.layer_data(index)

    def init_carry(self, **kw):
        return self.inner.init_carry(**kw)

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        if num_q_heads != self.num_q_heads:
            raise ValueError(f"FidelityProbe: num_q_heads={self.num_q_heads} but the model has {num_q_heads}")
        self.inner.check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)

    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        inner = self.inner.init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                                      head_dim=head_dim, dtype=dtype, num_q_heads=num_q_heads)
        return {"inner": inner,
                "rel_err": jnp.zeros((batch, self.num_q_heads), jnp.float32),
                "mass": jnp.ones((batch, self.num_q_heads), jnp.float32)}

    def prefill_state(self, state, k, v, lengths, layer):
        return {**state, "inner": self.inner.prefill_state(state["inner"], k, v, lengths, layer)}

    def prefill_query_state(self, state, q_last, lengths, layer):
        return {**state, "inner": self.inner.prefill_query_state(state["inner"], q_last, lengths, layer)}

    def append_state(self, state, kv, positions, layer):
        return {**state, "inner": self.inner.append_state(state["inner"], kv, positions, layer)}

    def prefill_attention(self, q, k, v, lengths, layer):
        return dense_prefill_attention(q, k, v)

    def decode(self, q, kv, lengths, state, carry, layer):
        inner_state = state["inner"]
        k, v = kv.k, kv.v  # the probe compares against exact attention: a resident layer
        valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
        dense = masked_decode_attention(q, k, v, valid[:, None, :])
        out, new_inner, new_carry = self.inner.decode(q, kv, lengths, inner_state, carry, layer)
        rel = relative_error(out, dense)
        mass = self._mass(q, kv, lengths, inner_state, carry, layer)
        return dense, {"inner": new_inner, "rel_err": rel, "mass": mass}, new_carry

    def _mass(self, q, kv, lengths, inner_state, carry, layer):
        b, hq = q.shape[0], q.shape[1]
        if isinstance(self.inner, DenseAttention):
            return jnp.ones((b, hq), jnp.float32)
        try:
            sel, _, _ = self.inner.select(q, kv, lengths, inner_state, carry, layer)
        except NotImplementedError:
            return jnp.full((b, hq), jnp.nan, jnp.float32)
        if sel.kind == "all":
            return jnp.ones((b, hq), jnp.float32)
        indices, counts = sel.token_view(lengths)
        return selection_mass_ratio(q, kv.k, lengths, indices, counts)


# -----------------------------------------------------------------------------
# Runs on a model (models.api.Model: .fns, .params, .init_cache, .with_method)
# -----------------------------------------------------------------------------


def fidelity_text_ids(tokenizer, length: int, batch: int) -> np.ndarray:
    """``int32[batch, length]``: row ``r`` is the stdlib source starting at module ``r``."""
    from benchmarks.ruler_tasks import _read, stdlib_modules

    mods = stdlib_modules()
    rows = []
    for r in range(batch):
        ids: list[int] = []
        i = r
        while len(ids) < length:
            name, path = mods[i % len(mods)]
            ids.extend(tokenizer.encode(f"# file: {name.replace('.', '/')}.py\n" + _read(path) + "\n"))
            i += 1
            if i - r > 4 * len(mods):
                raise RuntimeError("the standard-library text is too short for this length")
        rows.append(ids[:length])
    return np.asarray(rows, np.int32)


@jax.jit
def _log_softmax(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@jax.jit
def _kl_and_agree(ref_logp, logits):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(ref_logp)
    kl = jnp.sum(jnp.where(p > 0, p * (ref_logp - logp), 0.0), axis=-1)
    agree = jnp.argmax(logits, axis=-1) == jnp.argmax(ref_logp, axis=-1)
    return kl, agree.astype(jnp.float32)


def _prefill(model, text: np.ndarray, prefix: int, pad_to: int, cache_len: int):
    b = text.shape[0]
    tokens = np.full((b, pad_to), int(text[0, 0]), np.int32)
    tokens[:, :prefix] = text[:, :prefix]
    lengths = np.full((b,), prefix, np.int32)
    cache = model.init_cache(b, cache_len)
    return model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lengths), cache)


@dataclasses.dataclass
class Reference:
    """Dense run: the fed tokens ``int32[steps, B]`` and log-probs ``f32[steps, B, V]``."""

    text: np.ndarray
    prefix: int
    pad_to: int
    cache_len: int
    fed: np.ndarray
    logp: jax.Array


def reference_run(dense_model, text: np.ndarray, steps: int, *, pad_to: int | None = None,
                  cache_len: int | None = None) -> Reference:
    """Prefill ``text[:, :L - steps]`` with dense, then ``steps`` decode steps fed with
    the next text token and then dense's greedy tokens."""
    b, length = text.shape
    if steps < 1 or steps >= length:
        raise ValueError(f"steps must be in [1, {length}), got {steps}")
    prefix = length - steps
    pad_to = pad_to or prefix
    cache_len = cache_len or length
    _, cache = _prefill(dense_model, text, prefix, pad_to, cache_len)
    tok = jnp.asarray(text[:, prefix])
    fed, logps = [], []
    for _ in range(steps):
        fed.append(np.asarray(tok))
        logits, cache = dense_model.fns.decode_step(dense_model.params, tok, cache)
        lp = _log_softmax(logits)
        logps.append(lp)
        tok = jnp.argmax(lp, axis=-1).astype(jnp.int32)
    return Reference(text, prefix, pad_to, cache_len, np.stack(fed), jnp.stack(logps))


def method_kl(model, ref: Reference, steps: int | None = None) -> dict:
    """Mean ``KL(p_dense || p_method)`` and greedy agreement of ``model`` (running its
    method) over the reference's teacher-forced steps."""
    steps = ref.fed.shape[0] if steps is None else min(steps, ref.fed.shape[0])
    _, cache = _prefill(model, ref.text, ref.prefix, ref.pad_to, ref.cache_len)
    kls, agrees = [], []
    for t in range(steps):
        logits, cache = model.fns.decode_step(model.params, jnp.asarray(ref.fed[t]), cache)
        kl, ag = _kl_and_agree(ref.logp[t], logits)
        kls.append(kl)
        agrees.append(ag)
    kl = np.asarray(jnp.stack(kls))  # [steps, B]
    ag = np.asarray(jnp.stack(agrees))
    return {"kl": float(kl.mean()), "agreement": float(ag.mean()), "kl_per_step": kl.mean(1).tolist(),
            "steps": steps}


@functools.partial(jax.jit, static_argnums=1)
def _gather_metrics(cache, hq: int):
    """``rel_err, mass [L, B, Hq]``; the layers the probe did not run on (exact) get 0 and 1
    (every layer, for a method whose decode is dense, e.g. dense with a sparse prefill)."""
    rel, mass = [], []
    for lc in cache.layers:
        if lc.state is None:
            b = lc.k.shape[0]
            rel.append(jnp.zeros((b, hq), jnp.float32))
            mass.append(jnp.ones((b, hq), jnp.float32))
        else:
            rel.append(lc.state["rel_err"])
            mass.append(lc.state["mass"])
    return jnp.stack(rel), jnp.stack(mass)


def probe_metrics(probe_model, ref: Reference, steps: int) -> dict:
    """Per layer and query head rel_err / mass of the probe's inner method, averaged
    over batch rows and the first ``steps`` teacher-forced steps. ``probe_model``
    runs a :class:`FidelityProbe`; its logits must match the dense run's
    (``max_logp_diff`` reports how closely they did)."""
    steps = min(steps, ref.fed.shape[0])
    _, cache = _prefill(probe_model, ref.text, ref.prefix, ref.pad_to, ref.cache_len)
    rel_sum = mass_sum = None
    max_diff = jnp.zeros((), jnp.float32)
    for t in range(steps):
        logits, cache = probe_model.fns.decode_step(probe_model.params, jnp.asarray(ref.fed[t]), cache)
        rel, mass = _gather_metrics(cache, probe_model.config.num_heads)
        rel_sum = rel if rel_sum is None else rel_sum + rel
        mass_sum = mass if mass_sum is None else mass_sum + mass
        max_diff = jnp.maximum(max_diff, jnp.max(jnp.abs(_log_softmax(logits) - ref.logp[t])))
    rel = np.asarray(rel_sum).mean(axis=1) / steps  # [L, Hq]
    mass = np.asarray(mass_sum).mean(axis=1) / steps
    return {
        "rel_err": float(np.mean(rel)),
        "mass": float(np.nanmean(mass)) if np.isfinite(mass).any() else float("nan"),
        "rel_err_per_layer": rel.mean(axis=1).tolist(),
        "mass_per_layer": mass.mean(axis=1).tolist(),
        "rel_err_per_layer_head": rel.tolist(),
        "mass_per_layer_head": mass.tolist(),
        "probe_steps": steps,
        "max_logp_diff": float(max_diff),
    }
