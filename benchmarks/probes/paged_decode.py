"""Dense decode attention over a paged KV cache against the contiguous kernels (GPU).

``python -m benchmarks.probes.paged_decode`` times, per (B, capacity S, valid length L):

- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on its ``[B, S, H, D]``
  layout with ``key_value_seq_lengths = L`` (the dense baseline of ``benchmarks.kernels``);
- ``ours``: :func:`sparse_jax.ops.attention.dense_decode_attention` (our block kernel, the
  engine's dense decode) on the head-major ``[B, Hkv, S, D]`` cache, lengths ``L``, its splits
  sharing the valid blocks (``ours capacity-schedule``: the fixed shares it had before
  2026-12-03, which the committed H200 run measured as ``ours``);
- ``jax_paged``: jax's Pallas GPU paged attention
  (``jax.experimental.pallas.ops.gpu.paged_attention``) on one pool of pages
  ``[Hkv, B * S / page, page, D]`` shared by the rows, each row's pages scattered through
  it by a random block table (what a paged engine's allocator leaves after a while), at
  a few of its tunings;
- ``ours paged``: our dense kernel on that pool through the block table
  (``dense_decode_attention(block_table=...)``).

It answers two questions for the paged engine (issue 49): does a kernel reading pages
through a block table cost what the contiguous one costs (can the dense engine page and
stay at cuDNN speed), and does a row's unused capacity (``L < S``) cost time (what slots
that reserve ``max_len`` pay). Times are CUPTI device medians; the floor is the bytes of
the ``L`` valid positions' K and V at the H200's 4.8 TB/s. Every variant's output is
checked against the f32 reference on one configuration first.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import hbm_floor_ms, markdown_table, parse_list, stamp, time_fn, write_results

H200_HBM_BYTES_PER_S = 4.8e12


def _inputs(b: int, s: int, hq: int, hkv: int, d: int, page: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, hkv, s, d), jnp.bfloat16)  # head-major, the engine's layout
    v = jax.random.normal(ks[2], (b, hkv, s, d), jnp.bfloat16)
    n = s // page
    # row r's logical page j lives at physical page table[r, j]: a random permutation of the pool
    table = np.random.default_rng(seed).permutation(b * n).reshape(b, n).astype(np.int32)
    inv = np.argsort(table.reshape(-1))  # physical page -> (row, logical page) flat index

    def pages(x):  # [B, Hkv, S, D] -> [Hkv, B*n, page, D], page p holding what the table says
        x = x.reshape(b, hkv, n, page, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * n, page, d)
        return x[:, jnp.asarray(inv)]

    return q, k, v, pages(k), pages(v), jnp.asarray(table)


def _reference(q, k, v, lengths):
    from sparse_jax.ops.dense import dense_decode_reference

    return dense_decode_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths)


def jax_paged(q, kp, vp, table, lengths, ppcb: int, splits: int, interpret: bool = False):
    """jax's paged attention ``[B, Hq, D]``. It does not scale the scores: q comes pre-scaled by
    1/sqrt(D) (unscaled, the first run here was off by 2.9). One pipeline stage: at two, 8 pages
    of 64 x 128 keys and values exceed the H200's shared memory (282,624 of 232,448 bytes)."""
    import warnings

    with warnings.catch_warnings():  # deprecated in jax 0.11 (no replacement for GPU named)
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    scaled = (q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)).astype(q.dtype)
    return paged_attention(scaled, kp, vp, table, lengths, pages_per_compute_block=ppcb, k_splits=splits,
                           num_stages=1, interpret=interpret)


def main(argv=None) -> int:
    from sparse_jax.ops.attention import dense_decode_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8x16384,8x32768,8x131072", help="BxS,... (capacity S per row)")
    p.add_argument("--fills", type=functools.partial(parse_list, cast=float), default=[1.0, 0.5],
                   help="valid length L as a fraction of S (comma-separated)")
    p.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D (default: Qwen3-8B)")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--tunings", default="4x16,8x16,8x32",
                   help="jax_paged tunings: pages_per_compute_block x k_splits, comma-separated")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="paged_decode")
    a = p.parse_args(argv)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    tunings = [tuple(int(x) for x in t.split("x")) for t in a.tunings.split(",")]

    def cudnn(q, kb, vb, lengths):
        out = jax.nn.dot_product_attention(q[:, None], kb, vb, key_value_seq_lengths=lengths,
                                           implementation="cudnn")
        return out[:, 0]

    def ours(q, k, v, lengths, schedule="valid"):
        return dense_decode_attention(q, k, v, lengths, impl="pallas", split_schedule=schedule)

    def ours_paged(q, pool_k, pool_v, table, lengths):  # our dense kernel over the row's pages, through the table
        return dense_decode_attention(q, pool_k, pool_v, lengths, block_size=a.page, impl="pallas", block_table=table)

    rows, checks = [], []
    for shape in a.shapes.split(","):
        b, s = (int(x) for x in shape.split("x"))
        q, k, v, kp, vp, table = _inputs(b, s, hq, hkv, d, a.page)
        kb, vb = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # cuDNN's [B, S, Hkv, D]
        pool_k, pool_v = (x.reshape(1, hkv, -1, d) for x in (kp, vp))  # our kernel's pool: [1, Hkv, P * page, D]
        variants = {"cudnn": (jax.jit(cudnn), lambda L: (q, kb, vb, L)),
                    "ours": (jax.jit(ours), lambda L: (q, k, v, L)),
                    # the splits' old schedule: fixed shares of the capacity's blocks
                    "ours capacity-schedule": (jax.jit(functools.partial(ours, schedule="capacity")),
                                               lambda L: (q, k, v, L)),
                    "ours paged": (jax.jit(ours_paged), lambda L: (q, pool_k, pool_v, table, L))}
        for ppcb, splits in tunings:
            if (s // a.page) % splits or (s // a.page // splits) % min(ppcb, s // a.page // splits):
                continue
            fn = jax.jit(functools.partial(jax_paged, ppcb=ppcb, splits=splits))
            variants[f"jax_paged {ppcb}x{splits}"] = (fn, lambda L, fn=fn: (q, kp, vp, table, L))
        for fill in a.fills:
            L = int(s * fill)
            lengths = jnp.full((b,), L, jnp.int32)
            if not checks:  # numerics once, the first configuration (each variant against f32)
                ref = np.asarray(_reference(q, k, v, lengths))
                for name, (fn, args) in list(variants.items()):
                    try:
                        err = float(np.max(np.abs(np.asarray(fn(*args(lengths)), np.float32) - ref)))
                    except Exception as e:  # noqa: BLE001 - a tuning the device refuses: reported, dropped
                        err = f"failed: {type(e).__name__}: {str(e)[:160]}"
                        del variants[name]
                    checks.append({"variant": name, "B": b, "S": s, "L": L, "max_abs_err": err})
                    print(checks[-1], flush=True)
            floor = hbm_floor_ms(2 * b * L * hkv * d * 2, H200_HBM_BYTES_PER_S)
            for name, (fn, args) in variants.items():
                if any(c["variant"] == name and isinstance(c["max_abs_err"], str) for c in checks):
                    continue
                try:
                    t = time_fn(fn, args(lengths), name=name, runs=a.runs)
                except Exception as e:  # noqa: BLE001 - reported, the others run
                    print(f"{name} at {b}x{s}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                ms = t.device_ms if t.device_ms is not None else t.wall_ms
                rows.append({"B": b, "S": s, "L": L, "variant": name, "ms": round(ms, 4),
                             "x_floor": round(ms / floor, 2)})
                print(rows[-1], flush=True)
    for r in rows:  # each against cuDNN at the same (B, S, L)
        base = next(x["ms"] for x in rows if (x["B"], x["S"], x["L"], x["variant"]) == (r["B"], r["S"], r["L"], "cudnn"))
        r["vs_cudnn"] = round(r["ms"] / base, 3)
    md = (f"# Dense decode attention: paged against contiguous\n\n{stamp()}\n\n"
          f"Hq={hq}, Hkv={hkv}, D={d}, bf16, pages of {a.page} tokens in one pool shared by the rows, each row's "
          "pages scattered by a random block table. `ms`: CUPTI device time, median; `x_floor`: over the "
          "bytes of the L valid positions' K and V at 4.8 TB/s; `vs_cudnn`: over cuDNN at the same B, S, L.\n\n"
          + markdown_table(rows, ["B", "S", "L", "variant", "ms", "x_floor", "vs_cudnn"])
          + "\n\nNumerics (first configuration, max |out - f32 reference|):\n\n"
          + markdown_table(checks, ["variant", "B", "S", "L", "max_abs_err"]))
    print(md)
    if a.out:
        write_results(a.name, {"rows": rows, "checks": checks, **stamp()}, md, out_dir=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
