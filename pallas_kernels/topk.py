"""Exact top-k *index* selection without a sort: a threshold (radix) select.

Shapes:

* ``scores``: ``float32[R, N]`` (rows = flattened leading dims, e.g. B*Hkv).
* ``counts``: ``int32[R]`` or ``None``: row ``r`` has ``counts[r]`` valid
  leading entries; positions ``>= counts[r]`` are never selected
  (``None`` = all ``N`` valid). Values are clipped to ``[0, N]``.
* result: ``int32[R, k]``: the positions of the ``k`` largest valid entries
  of each row, each position at most once, ties broken arbitrarily.
  When a row has fewer than ``k`` valid entries, the result holds all of its
  valid positions and the other slots hold distinct invalid positions in
  ``[count, N)``; callers use ``min(k, count)`` as the selection size. The
  kernel returns positions in ascending order (the reference does not).

Order: scores are compared as floats, except that NaN is treated as ``-inf``
(a tie with ``-inf``), and ``-0.0`` sorts just below ``+0.0`` (they are equal
floats, so either order is a valid tie-break). ``-inf`` is a valid score: a
valid ``-inf`` is always preferred to an invalid position.

Why no sort: ``lax.top_k`` on a GPU sorts the row (several times the kernel's time
already at 64 x 2048: docs/kernels.md, 'Measured reasons for kernel choices'), while
the data is tiny (64 x 8192 x 4 B = 2 MB). The kernel maps each
score to an order-preserving int32 key (invalid -> INT32_MIN), finds the exact
k-th largest key ``T`` by a bitwise binary search on the key (each step is a
count ``#(key >= candidate)``: one reduction over the row held in registers;
with ``search="bracket"``, by a bracket of keys narrowed by bisection and
interpolation, two counts a round in one reduction: ``_bracket_search``),
then compacts: every key ``> T`` plus the first ``k - #(key > T)`` keys ``== T``
(one prefix sum gives both the tie rank and the output slot), written by a
masked scatter store.

Rows longer than one program can hold (``max_single`` keys, default 16384) use
a multi-level scheme: level 1 splits each row into chunks of ``chunk`` keys;
each (row, chunk) program keeps its chunk's local top-k (keys + positions),
which provably contains the row's top-k. The survivors (``n_chunks * k`` per
row) are selected again, until one program per row can finish. Every level is
one ``pallas_call``; all SMs work on level 1.

Triton constraints honoured: every in-kernel tensor has power-of-two size
(rows are padded in registers with masked loads, never in memory); refs are
flat 1-D arrays addressed with computed int32 offsets (``R * N < 2**31`` is
checked); only primitives with Pallas-Triton lowering rules are used
(bitcast_convert_type, integer compare/select/shift, reduce_sum, cumsum
(forward), iota, while_loop).

Interpret-mode note: Pallas interpret mode implements a masked scatter store as
gather-old / select / scatter, so masked-off lanes *do* write (their old value)
and collide with live lanes that share an index. Masked-off lanes therefore
get an out-of-bounds index (dropped by the interpreter's scatter; never
touched on the GPU, where a masked lane does not access memory).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels._util import next_pow2

__all__ = [
    "topk_reference",
    "topk_pallas",
    "plan_topk",
    "TopkPlan",
    "DEFAULT_MAX_SINGLE",
    "float_to_key",
]

INT32_MIN = -(2**31)
DEFAULT_MAX_SINGLE = 16384  # keys one program holds in registers (64 KiB)
MAX_CHUNK = 32768
SEARCHES = ("radix", "bracket")  # the threshold search (topk_pallas' ``search``)



def _i32(v: int) -> np.int32:
    """A Python int taken modulo 2**32 as an int32 constant (two's complement)."""
    v &= 0xFFFFFFFF
    return np.int32(v - (1 << 32) if v >= (1 << 31) else v)


# ----------------------------------------------------------------------------
# Keys (shared by kernel and reference so both impls order values identically)
# ----------------------------------------------------------------------------

# key(-inf): bits 0xFF800000 are negative, so key = bits ^ 0x7FFFFFFF.
_NEG_INF_KEY = _i32(0xFF800000 ^ 0x7FFFFFFF)


def float_to_key(x):
    """Order-preserving map float32 -> int32 (signed compare); NaN -> key(-inf).

    Non-negative floats keep their bits (0 .. 0x7F800000 for +inf); negative
    floats get their magnitude bits flipped so larger magnitude -> smaller key.
    Every float (incl. -inf) maps above INT32_MIN, which is kept for invalid
    positions.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    return jnp.where(x != x, _NEG_INF_KEY, key)


# ----------------------------------------------------------------------------
# Reference (pure jnp): exact, via lax.top_k on the int32 keys
# ----------------------------------------------------------------------------


def topk_reference(scores, k: int, counts=None):
    """``int32[R, k]`` via ``lax.top_k`` on int32 keys (invalid -> INT32_MIN).

    Keys rather than floats so that a valid ``-inf`` always beats an invalid
    position (with invalid -> -inf the sort could pick either).
    """
    r, n = scores.shape
    key = float_to_key(scores.astype(jnp.float32))
    if counts is not None:
        valid = jnp.arange(n, dtype=jnp.int32)[None, :] < counts.astype(jnp.int32)[:, None]
        key = jnp.where(valid, key, np.int32(INT32_MIN))
    _, idx = lax.top_k(key, k, is_stable=False)  # order is unspecified anyway
    return idx.astype(jnp.int32)


# ----------------------------------------------------------------------------
# Planning: how many levels, which chunk sizes
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TopkLevel:
    n_in: int  # keys per row entering this level
    chunk: int  # power-of-two lanes per program (>= the chunk of keys it reads)
    n_chunks: int  # programs per row
    k_sel: int  # keys kept per (row, chunk)
    final: bool
    block_rows: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class TopkPlan:
    levels: tuple[TopkLevel, ...]


def _default_warps(elems: int) -> int:
    # ~16-32 keys per thread: enough ILP in the per-thread part of each
    # reduction, few enough registers that the row, keys and prefix sum fit.
    return int(min(16, max(4, elems // 1024)))


def plan_topk(
    n: int,
    k: int,
    *,
    max_single: int = DEFAULT_MAX_SINGLE,
    chunk: int | None = None,
    block_rows: int = 1,
    num_warps: int | None = None,
) -> TopkPlan | None:
    """Levels for rows of ``n`` keys; ``None`` if the kernel cannot do it.

    Single level when ``n <= max_single``. Otherwise each level cuts rows into
    ``chunk``-key pieces and keeps k per piece, until at most ``max_single``
    survivors remain. Default chunk: the smallest power of two >= max(4096,
    4k): 4x shrink per level, and at most 8192 lanes for k <= 2048, which
    compiles without spills at 8 warps (16384-lane non-final programs spill
    on sm_90 at 16 warps: they keep keys and positions live to the end).
    """
    if not (1 <= k <= n):
        return None
    max_single = next_pow2(max_single)
    levels = []
    m = n
    while m > max_single:
        c = chunk if chunk is not None else max(4096, next_pow2(4 * k))
        c = next_pow2(c)
        n_chunks = -(-m // c)
        m_next = n_chunks * k
        if c <= k or m_next >= m or c > MAX_CHUNK:
            return None  # selection would not shrink the row
        w = num_warps or _default_warps(c)
        levels.append(TopkLevel(m, c, n_chunks, k, False, 1, w))
        m = m_next
    c = next_pow2(m)
    if c > MAX_CHUNK:
        return None
    br = block_rows if not levels else 1
    w = num_warps or _default_warps(c * br)
    levels.append(TopkLevel(m, c, 1, k, True, br, w))
    return TopkPlan(tuple(levels))


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


def _count_ge(key, cands):
    """``[#(key >= c) for c in cands]``, each ``int32[BR, 1]``.

    Counts fit in 16 bits (chunk <= 32768), so two counts share one int32
    reduction (low / high half): half the reductions, hence half the
    cross-warp shared-memory round trips, for the multi-candidate search.
    """
    out = []
    i = 0
    while i < len(cands):
        if i + 1 < len(cands):
            both = (key >= cands[i]).astype(jnp.int32) + ((key >= cands[i + 1]).astype(jnp.int32) << 16)
            s = jnp.sum(both, axis=1, keepdims=True)
            out.append(s & np.int32(0xFFFF))
            out.append(lax.shift_right_logical(s, np.int32(16)))
            i += 2
        else:
            out.append(jnp.sum((key >= cands[i]).astype(jnp.int32), axis=1, keepdims=True))
            i += 1
    return out


def _search_threshold(key, k: int, radix_bits: int, early_exit: bool, row_ok, search: str = "radix",
                      n_valid=None):
    """An int32 ``T`` with ``#(key >= T) >= k`` and ``#(key > T) <= k`` per row.

    ``key: int32[BR, C]``; returns ``int32[BR, 1]``. Without early exit ``T``
    is the k-th largest key (the largest ``T`` with ``#(key >= T) >= k``);
    with it, the search may stop at any ``T`` with ``#(key >= T) == k``.

    ``search="radix"`` (below); ``"bracket"``: :func:`_bracket_search`. ``n_valid``
    (``int32[BR, 1]``, optional): ``#(key > INT32_MIN)`` when the caller has counted it (the
    kernel counts it with ``count_above``'s count in one packed reduction).

    Built MSB-first in the unsigned image ``u = key ^ 0x80000000`` of the key
    (so the top bit is searched like any other): with ``T_u`` fixed above bit
    ``s + r``, the ``2**r - 1`` candidates ``T_u + (j << s)`` have
    non-increasing counts; the number of candidates whose count is still
    ``>= k`` is the next digit. In the signed domain ``T_u + x`` is ``T + x``
    with wrap-around, so everything stays int32.
    """
    if search == "bracket":
        return _bracket_search(key, k, early_exit, row_ok, n_valid)[0]
    br, c = key.shape
    n_rounds = 32 // radix_bits
    n_cand = (1 << radix_bits) - 1
    t0 = jnp.full((br, 1), INT32_MIN, jnp.int32)

    def one_round(t, cnt_t, shift):
        # shift: a Python int (unrolled) or a traced int32 scalar (loop)
        if isinstance(shift, int):
            offs = [_i32(j << shift) for j in range(1, n_cand + 1)]
        else:
            offs = [np.int32(j) << shift for j in range(1, n_cand + 1)]
        cnts = _count_ge(key, [t + o for o in offs])
        digit = sum((cn >= k).astype(jnp.int32) for cn in cnts)
        # count(>= new T): unchanged when the digit is 0
        for j, cn in enumerate(cnts, start=1):
            cnt_t = jnp.where(digit == j, cn, cnt_t)
        return t + (digit << shift), cnt_t

    cnt0 = jnp.full((br, 1), c, jnp.int32)  # count(>= INT32_MIN) = all lanes
    if not early_exit:
        t, cnt = t0, cnt0
        for i in range(n_rounds):
            t, cnt = one_round(t, cnt, 32 - radix_bits * (i + 1))
        return t

    # Early exit: stop once every row has #(key >= T) == k (then "take
    # key >= T" is exact and T need not be a key). For distinct-ish scores
    # that happens once T separates the k-th from the (k+1)-th key, well
    # before all 32 bits are fixed (bf16-derived scores: after <= 16 bits).
    # Rows with <= k valid keys are done at once: T = INT32_MIN satisfies
    # the contract (all valid keys are > T; the fill comes from ties at T).
    # Later rounds keep a done row valid: T only moves up while
    # #(key >= T) >= k, and that count cannot grow.
    if n_valid is None:
        n_valid = _count_valid(key)
    settled = (n_valid <= k) | ~row_ok

    def all_done(cnt):
        return jnp.min((settled | (cnt == k)).astype(jnp.int32))

    def cond(carry):
        i, _, _, done = carry
        return (i < n_rounds) & (done == 0)

    def body(carry):
        i, t, cnt, _ = carry
        shift = np.int32(32) - np.int32(radix_bits) * (i + 1)
        t, cnt = one_round(t, cnt, shift)
        return i + 1, t, cnt, all_done(cnt)

    init = (np.int32(0), t0, cnt0, all_done(cnt0))
    _, t, _, _ = lax.while_loop(cond, body, init)
    return t


def _count_valid(key):
    """``#(key > INT32_MIN)`` per row, ``int32[BR, 1]``: the valid keys."""
    return jnp.sum((key > np.int32(INT32_MIN)).astype(jnp.int32), axis=1, keepdims=True)


def _float_key(v: float) -> int | None:
    """``float_to_key`` of a Python float taken as float32, for a static floor: ``x > v`` is
    ``float_to_key(x) > _float_key(v)`` for every float32 ``x`` (NaN too: its key is -inf's,
    never above a floor's); ``None`` for a NaN floor (nothing is above it). Zero is taken as
    ``+0.0``: ``-0.0``'s key sits just below ``+0.0``'s, and ``+0.0 > -0.0`` is false."""
    f = np.float32(v)
    if f != f:
        return None
    if f == 0:
        f = np.float32(0.0)
    bits = int(f.view(np.int32))
    return bits ^ 0x7FFFFFFF if bits < 0 else bits


def _count_valid_and_above(key, floor_key: int | None):
    """``(#(key > INT32_MIN), #(key > floor_key))`` per row, each ``int32[BR, 1]``, in one
    packed reduction (low / high 16 bits: rows of at most 32768 keys; the high half may reach
    bit 31, read back by a logical shift). ``floor_key`` None: nothing is above it."""
    valid = (key > np.int32(INT32_MIN)).astype(jnp.int32)
    if floor_key is None:
        n_valid = jnp.sum(valid, axis=1, keepdims=True)
        return n_valid, jnp.zeros_like(n_valid)
    s = jnp.sum(valid + ((key > np.int32(floor_key)).astype(jnp.int32) << 16), axis=1, keepdims=True)
    return s & np.int32(0xFFFF), lax.shift_right_logical(s, np.int32(16))


def _umin(a, b):
    """Unsigned min of int32 bit patterns (compare with the sign bit flipped)."""
    return jnp.where((a ^ np.int32(INT32_MIN)) < (b ^ np.int32(INT32_MIN)), a, b)


def _bracket_search(key, k: int, early_exit: bool, row_ok, n_valid=None):
    """``(T int32[BR, 1], rounds)`` for ``key int32[BR, C]``: ``_search_threshold``'s contract by a
    bracketing search on the keys' values (``rounds``: the loop's trips, for tests).

    Each row keeps a bracket ``lo < hi`` with
    ``#(key >= lo) >= k > #(key >= hi)``, starting at its smallest valid key and its largest
    key plus one. A round counts two candidates strictly inside the bracket in one packed
    reduction (``_count_ge``): the bisection point, which at least halves the bracket, and
    the point where a straight line through the two ends' counts reaches ``k`` (regula
    falsi in key space). The radix search fixes one key bit a round from the top bit
    down; bits every key shares (the sign, most of the exponent) cost rounds there, and
    here the interpolation lands near the k-th key once the bracket is tight: about 7
    rounds instead of about 24 on ``benchmarks.kernels``' 8,192 label scores a row (k =
    2048, counted on the CPU), and at most 33 (bisection alone). On the H200 that made 8
    rows of label-like scores faster, but 64 rows of normal scores slower (three
    reductions before the loop, float math in it): the tuned table picks the search per
    class (docs/kernels.md, 'a bracketing threshold search for the top-k'). The bracket
    ends at ``hi = lo + 1`` (``lo`` is then the k-th largest
    key) or, with early exit, at ``#(key >= lo) == k``; it returns ``lo``.

    All arithmetic is int32 with wrap-around: ``hi - lo`` is the unsigned width (keys are
    signed, their order is the unsigned order of ``key ^ INT32_MIN``), and ``lo + off`` for
    ``0 <= off < width`` stays inside the bracket. The interpolated offset is computed in
    float32 and clamped to ``width - 1`` in unsigned terms, so rounding cannot leave the
    bracket. Rows with at most ``k`` valid keys are settled before the loop: ``T`` is
    ``INT32_MIN`` (fewer than ``k``) or their smallest valid key (exactly ``k``), which is
    the k-th largest key either way.
    """
    valid = key > np.int32(INT32_MIN)
    if n_valid is None:
        n_valid = _count_valid(key)
    lo = jnp.min(jnp.where(valid, key, np.int32(2**31 - 1)), axis=1, keepdims=True)
    # no key is INT32_MAX (+inf's key is 0x7F800000, NaN's is -inf's), so max + 1 cannot wrap
    hi = jnp.max(key, axis=1, keepdims=True) + np.int32(1)
    settled = (n_valid <= k) | ~row_ok
    t_settled = jnp.where((n_valid < k) | ~row_ok, np.int32(INT32_MIN), lo)
    clo, chi = n_valid, jnp.zeros_like(n_valid)

    def row_done(lo, hi, clo):
        end = (hi - lo) == np.int32(1)
        if early_exit:
            end = end | (clo == k)
        return settled | end

    def all_done(lo, hi, clo):
        return jnp.min(row_done(lo, hi, clo).astype(jnp.int32))

    def cond(carry):
        i, _, _, _, _, done = carry
        return (i < 40) & (done == 0)  # bisection alone ends within 32 rounds

    def body(carry):
        i, lo, hi, clo, chi, _ = carry
        width = hi - lo  # unsigned, >= 1
        half = lax.shift_right_logical(width, np.int32(1))
        mid = lo + half
        frac = (clo - k).astype(jnp.float32) / jnp.maximum(clo - chi, 1).astype(jnp.float32)
        off_f = frac * (half.astype(jnp.float32) * 2.0)
        # float -> int32 directly below 2**30; above it, by halves (the sum wraps like the width)
        big = lax.shift_right_logical(width, np.int32(30)) != 0
        small_off = jnp.minimum(off_f, 2.0**30).astype(jnp.int32)
        half_off = jnp.minimum(off_f * 0.5, 2.0**31 - 128.0).astype(jnp.int32)
        off = jnp.where(big, half_off + half_off, small_off)
        # off <= width by construction (frac < 1, truncation); the clamp to width - 1 guards
        # float rounding at widths near 2**32, where a candidate past hi would stall the
        # bracket. A candidate at lo (off = 0) recounts lo harmlessly: mid still halves it.
        off = _umin(off, width - np.int32(1))
        guess = lo + off
        a, b = jnp.minimum(mid, guess), jnp.maximum(mid, guess)
        ca, cb = _count_ge(key, [a, b])
        lo_n = jnp.where(cb >= k, b, jnp.where(ca >= k, a, lo))
        clo_n = jnp.where(cb >= k, cb, jnp.where(ca >= k, ca, clo))
        hi_n = jnp.where(cb >= k, hi, jnp.where(ca >= k, b, a))
        chi_n = jnp.where(cb >= k, chi, jnp.where(ca >= k, cb, ca))
        return i + 1, lo_n, hi_n, clo_n, chi_n, all_done(lo_n, hi_n, clo_n)

    init = (np.int32(0), lo, hi, clo, chi, all_done(lo, hi, clo))
    rounds, lo, _, _, _, _ = lax.while_loop(cond, body, init)
    return jnp.where(settled, t_settled, lo), rounds


def _compaction(key, t, k_sel: int, greater_first: bool = False):
    """``(take bool[BR, C], slot int32[BR, C])``: the lanes of the top ``k_sel`` given the
    threshold ``t`` (every key ``> t`` plus the first ``k_sel - #(key > t)`` keys ``== t``)
    and each taken lane's output slot.

    One prefix sum of ``gt << 16 | eq`` gives, at each lane, #gt and #eq up to it
    (inclusive); a taken lane's slot is #gt + min(#eq, need) - 1 (the taken lanes in lane
    order), or with ``greater_first`` #gt - 1 for a lane above ``t`` and
    #(key > t) + #eq - 1 for one at it (the keys above the threshold first)."""
    c = key.shape[1]
    gt = key > t
    eq = key == t
    n_gt = jnp.sum(gt.astype(jnp.int32), axis=1, keepdims=True)
    need = k_sel - n_gt
    if c <= 16384:  # both halves < 2**15: the packed sum cannot overflow
        cs = jnp.cumsum((gt.astype(jnp.int32) << 16) | eq.astype(jnp.int32), axis=1)
        gt_incl = lax.shift_right_logical(cs, np.int32(16))
        eq_incl = cs & np.int32(0xFFFF)
    else:
        gt_incl = jnp.cumsum(gt.astype(jnp.int32), axis=1)
        eq_incl = jnp.cumsum(eq.astype(jnp.int32), axis=1)
    take = gt | (eq & (eq_incl <= need))
    if greater_first:
        slot = jnp.where(gt, gt_incl, n_gt + eq_incl) - 1
    else:
        slot = gt_incl + jnp.minimum(eq_incl, need) - 1
    return take, slot


def _per_row(ref, rows, n_rows: int, rows_per: int):
    """``ref[row // rows_per]`` for each row ``[BR, 1]`` (padding rows read the last row's):
    one value shared by ``rows_per`` consecutive rows (e.g. a row's KV heads)."""
    r = jnp.minimum(rows, n_rows - 1)
    if rows_per > 1:
        r = lax.div(r, np.int32(rows_per))
    return plgpu.load(ref.at[r])


def _through_table(table_ref, rows, pos, mask, *, width: int, block: int):
    """``table[row, pos // block] * block + pos % block`` where ``mask`` (0 elsewhere): the token
    of slot ``pos`` of a row whose slots are whole blocks, ``table_ref`` flat ``[R * width]``."""
    if block & (block - 1) == 0:
        # positions are >= 0: a shift and a mask, not a signed division's fix-ups
        shift = block.bit_length() - 1
        slot, within = lax.shift_right_logical(pos, np.int32(shift)), pos & np.int32(block - 1)
    else:
        slot, within = lax.div(pos, np.int32(block)), lax.rem(pos, np.int32(block))
    entry = plgpu.load(table_ref.at[jnp.where(mask, rows * width + slot, 0)], mask=mask, other=0)
    return entry * block + within


def _select_kernel(
    *refs,
    first: bool,
    final: bool,
    has_counts: bool,
    n_rows: int,
    n_in: int,
    n_orig: int,
    chunk: int,
    k_sel: int,
    k_out: int,
    out_stride: int,
    block_rows: int,
    radix_bits: int,
    early_exit: bool,
    greater_first: bool = False,
    rows_per_count: int = 1,
    count_above: float | None = None,
    table_block: int = 0,
    table_width: int = 0,
    dense_limit: int | None = None,
    rows_per_dense: int = 1,
    has_append: bool = False,
    rows_per_append: int = 1,
    search: str = "radix",
):
    """One (row block, chunk) program of one level.

    Inputs (flat): level 1: ``scores f32[R*N]``; later levels:
    ``keys i32[R*M], pos i32[R*M]``; plus ``counts i32[R]`` if given; on the final level,
    ``table i32[R*table_width]`` if ``table_block``, ``dense i32[R / rows_per_dense]`` if
    ``dense_limit`` is set and ``append i32[R / rows_per_append]`` if ``has_append``.
    Outputs (flat): final: ``idx i32[R*out_stride]`` (``out_stride`` is k, or k + 1 with
    ``has_append``: the appended value in column k); else ``keys, pos i32[R*M']``; with ``count_above``
    (single level only) also ``n i32[R]``: ``min(k, #(valid scores > count_above))``, or a
    dense row's length.
    """
    if first:
        src_refs, rest = refs[:1], refs[1:]
    else:
        src_refs, rest = refs[:2], refs[2:]
    if has_counts:
        counts_ref, rest = rest[0], rest[1:]
    else:
        counts_ref = None
    table_ref = dense_ref = append_ref = None
    if final and table_block:
        table_ref, rest = rest[0], rest[1:]
    if final and dense_limit is not None:
        dense_ref, rest = rest[0], rest[1:]
    if final and has_append:
        append_ref, rest = rest[0], rest[1:]
    out_refs = rest

    br, c = block_rows, chunk
    row0 = pl.program_id(0) * br
    ci = pl.program_id(1)
    rows = row0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)  # [BR, 1]
    lane = lax.broadcasted_iota(jnp.int32, (1, c), 1)  # [1, C]
    col = ci * c + lane  # position within this level's input row
    row_ok = rows < n_rows
    live = row_ok & (col < n_in)  # [BR, C]
    src = rows * n_in + col

    if has_counts:
        cnt = _per_row(counts_ref, rows, n_rows, rows_per_count)
        cnt = jnp.clip(cnt, 0, n_orig)
    else:
        cnt = jnp.full((br, 1), n_orig, jnp.int32)

    if first:
        x = plgpu.load(src_refs[0].at[src], mask=live, other=0.0)
        valid = live & (col < cnt)
        key = jnp.where(valid, float_to_key(x), np.int32(INT32_MIN))
        pos = jnp.broadcast_to(col, (br, c))
    else:
        key = plgpu.load(src_refs[0].at[src], mask=live, other=np.int32(INT32_MIN))
        pos = plgpu.load(src_refs[1].at[src], mask=live, other=np.int32(0))
    tokens = None
    if table_ref is not None and first:
        # one level: every lane's token through the table, loaded now so that the gather's
        # latency hides under the search (after it, the store would wait for it)
        tokens = _through_table(table_ref, rows, col, live, width=table_width, block=table_block)
    dense = None
    if dense_ref is not None:
        # the dense fallback: a row whose context is at most dense_limit long attends to all of
        # it, positions arange(k) and its length as the count
        dense_len = _per_row(dense_ref, rows, n_rows, rows_per_dense)
        dense = row_ok & (dense_len <= dense_limit)  # [BR, 1]

    n_valid = n_above = None  # None: the search counts the valid keys itself (if it needs them)
    if count_above is not None:
        # count_above's count and the search's count of valid keys in one reduction (two 16-bit
        # halves of one sum); a search that needs no count (radix, no early exit) ignores it
        n_valid, n_above = _count_valid_and_above(key, _float_key(count_above))
    t = _search_threshold(key, k_sel, radix_bits, early_exit, row_ok, search, n_valid)
    take, slot = _compaction(key, t, k_sel, greater_first=greater_first and final)
    take = take & row_ok

    oob = n_rows * out_stride  # masked lanes: see module docstring
    if count_above is not None:
        # the caller's count of scores above a floor (e.g. not -inf), from the row this program
        # holds anyway, instead of another pass over the scores in XLA
        n_above = jnp.minimum(n_above[:, 0], np.int32(k_out))  # [BR]
        if dense is not None:
            n_above = jnp.where(dense[:, 0], dense_len[:, 0], n_above)
        row_flat = rows[:, 0]
        plgpu.store(out_refs[1].at[jnp.where(row_ok[:, 0], row_flat, n_rows)], n_above, mask=row_ok[:, 0])
    if final:
        # Rows with fewer than k valid entries: the answer is all valid
        # positions (0..cnt-1) plus invalid fill, i.e. exactly arange(k).
        # Writing that directly keeps fill positions < N at every level
        # (a chunked level's fill may be padding lanes >= N).
        short = cnt < k_out
        if dense is not None:
            short = short | dense
        out = pos
        if tokens is not None:
            out = tokens
        elif table_ref is not None:
            # positions through the caller's block table: entry pos // block of the row, times
            # the block, plus pos % block, in place of an XLA pass over the selection after the
            # kernel (a later level's positions are known only now)
            out = _through_table(table_ref, rows, pos, take, width=table_width, block=table_block)
        dst = jnp.where(take & ~short, rows * out_stride + slot, oob)
        plgpu.store(out_refs[0].at[dst], out, mask=take & ~short)

        @pl.when(jnp.max(short.astype(jnp.int32)) > 0)
        def _fill_short_rows():
            # a branch, not only a mask: a masked store still costs every lane its address and
            # a predicated instruction, and rows are rarely short
            fill = row_ok & short & (lane < k_out)
            dst2 = jnp.where(fill, rows * out_stride + lane, oob)
            fill_pos = jnp.broadcast_to(lane, (br, c))
            if table_ref is not None:
                # a short row's arange goes through the table too (on one level, lane ==
                # position); a dense row's stays positions
                mapped = tokens if tokens is not None else _through_table(
                    table_ref, rows, fill_pos, fill, width=table_width, block=table_block)
                fill_pos = mapped if dense is None else jnp.where(dense, fill_pos, mapped)
            plgpu.store(out_refs[0].at[dst2], fill_pos, mask=fill)
        if append_ref is not None:
            # the caller's value after the k positions (e.g. the newest block, which every row
            # attends): one store here in place of an XLA concatenate, a launch, after the kernel
            row_flat = rows[:, 0]
            last = _per_row(append_ref, rows, n_rows, rows_per_append)[:, 0]
            plgpu.store(out_refs[0].at[jnp.where(row_ok[:, 0], row_flat * out_stride + k_out, oob)], last,
                        mask=row_ok[:, 0])
    else:
        dst = jnp.where(take, rows * out_stride + ci * k_sel + slot, oob)
        plgpu.store(out_refs[0].at[dst], key, mask=take)
        plgpu.store(out_refs[1].at[dst], pos, mask=take)


def topk_pallas(
    scores,
    k: int,
    counts=None,
    *,
    max_single: int = DEFAULT_MAX_SINGLE,
    chunk: int | None = None,
    block_rows: int = 1,
    num_warps: int | None = None,
    num_stages: int = 1,
    radix_bits: int = 1,
    early_exit: bool = True,
    greater_first: bool = False,
    rows_per_count: int = 1,
    count_above: float | None = None,
    block_table=None,
    block_size: int | None = None,
    dense_lengths=None,
    dense_limit: int | None = None,
    rows_per_dense: int = 1,
    append=None,
    rows_per_append: int = 1,
    search: str = "radix",
    interpret: bool = False,
):
    """Kernel path: ``scores f32[R, N]``, ``counts i32[R] | None`` -> ``i32[R, k]``
    (``counts i32[R / rows_per_count]``: row ``r`` reads ``counts[r // rows_per_count]``).

    ``greater_first``: for a row with at least ``k`` valid entries, the final level writes
    the keys above the k-th largest first, then the ties at it (default: the taken
    positions in ascending order). Early exit stops at a threshold that need not be the
    k-th largest, which only matters where every lane is taken (``n_in <= k``): that
    level then searches all 32 bits.

    Tuning: ``max_single`` (longest row one program selects on; longer rows go
    multi-level), ``chunk`` (keys per program on non-final levels; power of
    two > k), ``block_rows`` (rows per program, single-level only; power of
    two), ``num_warps`` (default by lanes per program), ``num_stages``
    (Triton pipelining; there is no loop over memory, 1 is right),
    ``radix_bits`` (1, 2 or 4 key bits fixed per search round: 32/r rounds of
    2**r-1 counts each), ``early_exit`` (stop the search once #(key >= T) == k),
    ``search`` (``"radix"``: the bitwise search; ``"bracket"``: bisection plus
    interpolation on the key values, ``_bracket_search``; ``radix_bits`` is then unused).

    ``count_above`` (a float; single-level plans only, ``n <= max_single``): also return
    ``int32[R]``, ``min(k, #(valid entries > count_above))`` (NaN is not above anything),
    counted by the selecting program: ``(idx, n)``.

    ``block_table`` (``int32[R, W]`` with ``W * block_size >= N``) and ``block_size``: the final
    level writes each position ``p`` as ``block_table[row, p // block_size] * block_size +
    p % block_size`` (the token of slot ``p`` when the row's candidates are whole blocks), a
    short row's ``arange(k)`` included. ``dense_lengths`` (``int32[R / rows_per_dense]``) and
    ``dense_limit``: a row whose length is at most ``dense_limit`` (a context short enough to
    attend whole) gets positions ``arange(k)``, not mapped, and, with ``count_above``, its
    length as the count. ``append`` (``int32[R / rows_per_append]``): the result is
    ``i32[R, k + 1]``, each row's value in its last column (stored by the final level).
    """
    r, n = scores.shape
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    plan = plan_topk(n, k, max_single=max_single, chunk=chunk, block_rows=block_rows, num_warps=num_warps)
    if plan is None:
        raise ValueError(f"no top-k plan for N={n}, k={k}, chunk={chunk}, max_single={max_single}")
    if r * max(n, plan.levels[0].n_chunks * plan.levels[0].chunk) >= 2**31:
        raise ValueError("R * N must be < 2**31 (int32 offsets)")
    has_counts = counts is not None
    if count_above is not None and len(plan.levels) > 1:
        raise ValueError(f"count_above needs a single-level plan (N={n} <= max_single={max_single})")
    if has_counts and counts.shape[0] * rows_per_count != r:
        raise ValueError(f"counts [{counts.shape[0]}] x rows_per_count {rows_per_count} != rows {r}")
    extra = (counts.astype(jnp.int32),) if has_counts else ()
    final_extra = ()
    if block_table is not None:
        if block_size is None or isinstance(block_size, bool) or int(block_size) < 1:
            raise ValueError(f"block_table needs a positive int block_size, got {block_size!r}")
        if block_table.ndim != 2 or block_table.shape[0] != r or block_table.shape[1] * int(block_size) < n:
            raise ValueError(f"block_table must be [R={r}, W] with W * block_size >= N={n}, got "
                             f"{tuple(block_table.shape)} and block_size {block_size}")
        final_extra += (block_table.astype(jnp.int32).reshape(-1),)
    if (dense_lengths is None) != (dense_limit is None):
        raise ValueError("dense_lengths and dense_limit come together")
    if dense_lengths is not None:
        if dense_lengths.ndim != 1 or dense_lengths.shape[0] * rows_per_dense != r:
            raise ValueError(f"dense_lengths [{dense_lengths.shape}] x rows_per_dense {rows_per_dense} != rows {r}")
        final_extra += (dense_lengths.astype(jnp.int32),)
    if append is not None:
        if append.ndim != 1 or append.shape[0] * rows_per_append != r:
            raise ValueError(f"append [{append.shape}] x rows_per_append {rows_per_append} != rows {r}")
        final_extra += (append.astype(jnp.int32),)
    k_cols = k + (append is not None)

    srcs = (scores.astype(jnp.float32).reshape(r * n),)
    for lvl_i, lvl in enumerate(plan.levels):
        first = lvl_i == 0
        if lvl.final:
            out_stride = k_cols
            out_shape = (jax.ShapeDtypeStruct((r * k_cols,), jnp.int32),)
            if count_above is not None:
                out_shape += (jax.ShapeDtypeStruct((r,), jnp.int32),)
        else:
            out_stride = lvl.n_chunks * lvl.k_sel
            out_shape = (jax.ShapeDtypeStruct((r * out_stride,), jnp.int32),) * 2
        kern = functools.partial(
            _select_kernel,
            first=first,
            final=lvl.final,
            has_counts=has_counts,
            n_rows=r,
            n_in=lvl.n_in,
            n_orig=n,
            chunk=lvl.chunk,
            k_sel=lvl.k_sel,
            k_out=k,
            out_stride=out_stride,
            block_rows=lvl.block_rows,
            radix_bits=radix_bits,
            early_exit=early_exit and not (greater_first and lvl.final and lvl.n_in <= k),
            greater_first=greater_first,
            rows_per_count=rows_per_count,
            count_above=None if count_above is None else float(count_above),
            table_block=int(block_size) if block_table is not None else 0,
            table_width=block_table.shape[1] if block_table is not None else 0,
            dense_limit=None if dense_limit is None else int(dense_limit),
            rows_per_dense=rows_per_dense,
            has_append=append is not None,
            rows_per_append=rows_per_append,
            search=search,
        )
        outs = pl.pallas_call(
            kern,
            out_shape=out_shape,
            grid=(pl.cdiv(r, lvl.block_rows), lvl.n_chunks),
            compiler_params=plgpu.CompilerParams(num_warps=lvl.num_warps, num_stages=num_stages),
            interpret=interpret,
            name=f"topk_select_l{lvl_i}",
        )(*srcs, *extra, *(final_extra if lvl.final else ()))
        srcs = tuple(outs)
    if count_above is not None:
        return srcs[0].reshape(r, k_cols), srcs[1]
    return srcs[0].reshape(r, k_cols)
