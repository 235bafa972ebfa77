"""Capacity planning: device and host bytes of a batch, checked before allocating.

:func:`footprint` adds up, array by array, what :mod:`models.runtime.tiered` allocates
for ``batch`` rows of capacity ``max_len`` (``mode``: "dense" = every layer's
KV on the device, no method state; "sparse" = the same plus the sparse
method's state; "offload" = the tiers of :mod:`sparse_jax.offload.tiers`,
dense layers resident). :func:`check_fits` raises :class:`CapacityError` with
the breakdown when either memory would overflow; :func:`max_batch` is the
largest batch that fits.

Device budget: the allocator's limit (``memory_stats()["bytes_limit"]``)
minus ``reserve`` for XLA's temporaries (default 2 GiB). Host budget: the
kernel's ``MemAvailable`` times ``host_fraction`` (default 0.85: pinned pages
cannot be swapped, and the process needs room besides the tier), capped by XLA's
pinned-host pool (64 GiB on a GPU unless set; :func:`plan_pinned_host_limit` sets it from
the machine before the GPU client starts).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from sparse_jax.layers import LayerSpec

GiB = 1 << 30
MODES = ("dense", "sparse", "offload")


class CapacityError(ValueError):
    """The requested batch does not fit (raised before any allocation)."""


@dataclasses.dataclass(frozen=True)
class Footprint:
    device: dict[str, int]
    host: dict[str, int]

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def describe(self) -> str:
        def part(d):
            return ", ".join(f"{k} {v / GiB:.2f}" for k, v in d.items() if v)

        return (f"device {self.device_bytes / GiB:.2f} GiB ({part(self.device)}); "
                f"host {self.host_bytes / GiB:.2f} GiB ({part(self.host) or 'nothing'})")


def footprint(cfg, method, *, batch: int, max_len: int, mode: str, dtype_bytes: int = 2,
              pool_slots: int | None = None, shared: bool = False, host_pages: int | None = None,
              prefill_rows: int | None = None, staging_buffers: int = 0) -> Footprint:
    """Bytes of weights, caches and tiers (not XLA temporaries) for ``cfg`` (a
    :class:`models.config.ModelConfig`) and ``method`` (an AsyncTLS-like method
    for "sparse"/"offload"; ignored for "dense"). ``shared``: the offloaded tier's
    pool is shared by the rows, ``pool_slots`` per (layer, KV head) (default: the
    batch times the per-row default), plus two ring slots per row. ``host_pages``: the
    host tier is a pool of that many pages of one block (every KV head), shared by the
    rows (:mod:`sparse_jax.offload.tiers`), not ``batch x max_len``. ``prefill_rows``: the rows
    whose layer K/V a prefill holds at once (default ``batch``: a batch prefilled together; a
    serving engine's prompts one at a time, its empty batch built without them:
    :meth:`models.runtime.tiered.TieredRunner.empty_state`). ``staging_buffers``: with ``host_pages``,
    the pinned host buffers a prefill stages at once, each one layer's K or V of a prompt's
    blocks (``[blocks, Hkv, bs, D]``, its rows padded to a power of two) on its way into the
    pages (:mod:`models.runtime.tiered_prefill`): up to 2.1 GB beside the pages for a 64K prompt."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    b, hkv, d, s = int(batch), cfg.num_kv_heads, cfg.head_dim, int(max_len)
    e = dtype_bytes
    kv_layer = 2 * b * hkv * s * d * e
    dev = {"weights": cfg.num_params() * e, "logits": 2 * b * cfg.vocab_size * 4}
    host: dict[str, int] = {}
    if mode == "dense":
        dev["kv"] = cfg.num_layers * kv_layer
        return Footprint(dev, host)
    if mode == "offload":
        method = method.for_offload()
    n_sparse = sum(method.is_sparse_layer(i, cfg.num_layers) for i in range(cfg.num_layers))
    bs = method.offload_block_size or getattr(method, "block_size", 64)
    nb = s // bs
    n1 = method.offload_blocks_per_step(s) if mode == "offload" else 0
    state = state_bytes(method, batch=b, num_kv_heads=hkv, max_len=s, head_dim=d, dtype_bytes=e,
                        num_q_heads=cfg.num_heads)
    dev["kv_dense_layers"] = (cfg.num_layers - n_sparse) * kv_layer
    dev["method_state"] = n_sparse * state
    if mode == "sparse":
        dev["kv_sparse_layers"] = n_sparse * kv_layer
        return Footprint(dev, host)
    p = 2 * n1 if pool_slots is None else int(pool_slots)  # pool.default_pool_slots
    if shared:
        p = b * 2 * n1 if pool_slots is None else int(pool_slots)
        dev["slot_pool"] = n_sparse * 2 * hkv * (p + 2 * b) * bs * d * e
        dev["block_tables"] = n_sparse * 4 * hkv * (b * nb + 2 * p)
    else:
        dev["slot_pool"] = n_sparse * 2 * b * hkv * (p + 2) * bs * d * e
        dev["block_tables"] = n_sparse * 4 * b * hkv * (nb + 2 * p)
    dev["gather_lists"] = n_sparse * 2 * 4 * b * hkv * max(n1, 0)
    rows = b if prefill_rows is None else int(prefill_rows)
    dev["prefill_layer"] = 2 * (kv_layer // b) * rows  # one layer's K/V and its block layout, while it is built
    if host_pages is None:
        host["kv_blocks"] = n_sparse * kv_layer
    else:
        host["kv_pages"] = n_sparse * 2 * int(host_pages) * hkv * bs * d * e
        if staging_buffers:
            host["prefill_staging"] = staging_bytes(staging_buffers, max_len=s, block_size=bs, num_kv_heads=hkv,
                                                    head_dim=d, dtype_bytes=e)
        dev["host_block_table"] = 4 * b * nb
    return Footprint(dev, host)


def state_bytes(method, *, batch, num_kv_heads, max_len, head_dim, dtype_bytes=2, num_q_heads=None) -> int:
    """Bytes of ``method.init_state(...)`` for one layer (traced, nothing allocated)."""
    import jax.numpy as jnp

    dtype = {2: jnp.bfloat16, 4: jnp.float32}[dtype_bytes]
    shapes = jax.eval_shape(lambda: method.init_state(LayerSpec(sparse=True), batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                                                      head_dim=head_dim, dtype=dtype, num_q_heads=num_q_heads))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def round_up_in_octave(n: int, steps: int, multiple: int = 1) -> int:
    """``n`` rounded up to the next of ``steps`` equal steps of its octave (the octave from the
    largest power of two below ``n``), each step a multiple of ``multiple`` (at least one):
    padding of at most ``1/steps``, and ``steps`` sizes an octave to compile. The prompt
    buckets of a layer-by-layer prefill (:func:`models.serving.buckets.segmented_bucket`) and
    a prefill's staged blocks (:func:`staged_rows`) both round this way."""
    octave = 1 << (int(n) - 1).bit_length() - 1
    step = max(multiple, octave // steps // multiple * multiple)
    return -(-int(n) // step) * step


def staged_rows(n: int) -> int:
    """The blocks a prefill's page gather of ``n`` blocks (and so its staging buffer) is padded
    to: a power of two up to 8, then the next of four steps an octave (at most a quarter
    more), so few gathers compile. Padded to a power of two before (2026-12-06), a 133,120
    cache's longest prompt (2,079 blocks of 64) staged 4,096: 9.0 GiB of benchmark C's pinned
    host memory for 18 buffers where 2,560 need 5.6."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length() if n <= 8 else round_up_in_octave(n, 4)


def staging_bytes(buffers: int, *, max_len: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: int = 2) -> int:
    """Pinned host bytes of ``buffers`` prefill staging buffers (:func:`footprint`'s
    ``staging_buffers``): each one layer's K or V of the longest prompt's blocks, ``[blocks,
    Hkv, bs, D]`` with the blocks padded as the gather pads them (:func:`staged_rows`)."""
    nb = max(int(max_len) // int(block_size), 1)
    return int(buffers) * staged_rows(nb) * num_kv_heads * block_size * head_dim * dtype_bytes


#: the first region XLA's pinned-host pool maps (tsl::BFCAllocator with ``allow_growth``)
BFC_FIRST_REGION = 2 << 20


def bfc_fits(limit: int, sizes, first_region: int | None = None) -> int:
    """How many of the arrays of ``sizes`` (bytes, allocated in that order, none freed) a growing
    best-fit allocator of ``limit`` bytes places: XLA's pinned-host pool maps a new region only
    when no free chunk fits, each region twice the last (grown first until the array fits), the
    last one cut to what the limit leaves, and no array spans two regions. So arrays just over a
    power-of-two fraction of the regions strand nearly one array's bytes at every region's end:
    on the H100 (2026-12-07) 68 host page arrays of 1.503 GiB and 2.81 GiB of staging, passed by a
    105 GiB budget to 0.01 GiB, failed at the 68th array; this model places 67 of them (regions of
    2, 2, 4, 8, 16, 32 and 41 GiB hold 1, 1, 2, 5, 10, 21 and 27). A model of the allocator's
    policy, used to plan below it: what it says fits, the allocator should place. ``first_region``:
    :data:`BFC_FIRST_REGION` unless given."""
    free, mapped, placed = [], 0, 0
    region = int(BFC_FIRST_REGION if first_region is None else first_region)
    for size in sizes:
        size = int(size)
        fits = [i for i, f in enumerate(free) if f >= size]
        if fits:
            best = min(fits, key=lambda i: free[i])
            free[best] -= size
        else:
            grew = False
            while size > region:
                region *= 2
                grew = True
            got = min(region, int(limit) - mapped)
            if got < size:
                return placed
            mapped += got
            free.append(got - size)
            if not grew:
                region *= 2
        placed += 1
    return placed


def pages_the_pool_places(pages: int, *, limit: int, page_bytes: int, arrays: int, staging: int = 0,
                          staging_buffers: int = 0) -> int:
    """The most host pages (at most ``pages``) whose ``arrays`` page arrays (one per offloaded
    layer's K and V, ``page_bytes / arrays`` a page each), then ``staging_buffers`` prefill
    staging buffers of ``staging`` bytes each, :func:`bfc_fits` places whole under the pinned
    pool's ``limit``."""
    per_page = int(page_bytes) // int(arrays)
    need = int(arrays) + int(staging_buffers)

    def placed(n: int) -> bool:
        return bfc_fits(limit, [n * per_page] * int(arrays) + [int(staging)] * int(staging_buffers)) == need

    if placed(pages):
        return int(pages)
    lo, hi = 0, int(pages)  # placed(lo) holds (nothing to place but the staging), placed(hi) does not
    if not placed(lo):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if placed(mid) else (lo, mid)
    return lo


def autotune_scratch_bytes(params) -> int:
    """Device bytes XLA's GEMM autotuner may claim while it compiles a program over
    ``params`` after the caches are allocated: it runs each candidate on redzone copies of
    the fusion's operands, and a fusion that slices one layer out of a stacked weight takes
    the whole stack as its operand, so the largest leaf bounds it. Measured on the H100
    (2026-11-28): an offloaded Qwen3-8B engine of 16 slots passed the capacity check without
    this term, then compiling its decode step failed to allocate 3.39 GiB, the stacked MLP
    weight ``bf16[36, 12288, 4096]``."""
    return max((int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params)), default=0)


def device_budget(reserve: int = 2 * GiB) -> int | None:
    """Usable device bytes (None when the backend reports no limit, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else int(limit) - reserve


#: MemAvailable (bytes) at the process's first reading (:func:`mem_available`): XLA's pinned-host
#: allocator keeps freed memory pooled for the process, which MemAvailable then no longer
#: counts, so later readings would shrink by every engine built and dropped before
#: (H100: a load benchmark's second offloaded method saw 16.9 of 96 GiB)
_FIRST_MEM_AVAILABLE: int | None = None

#: the environment variable XLA's GPU client reads, once, when it starts: the limit (GiB) of its
#: pool of pinned host memory (a BFC allocator over ``cudaHostAlloc`` growing on demand), which
#: every ``pinned_host`` array is allocated from
PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
#: that limit when the variable is unset (XLA's ``GetGpuHostAllocator``): 64 GiB whatever the
#: machine has. An offloaded Qwen3-8B batch of 4 x 128K (75.5 GiB of host tier) passed a planner
#: that read only MemAvailable, then failed in this allocator (2026-12-01, H200 box of 128 GiB)
XLA_DEFAULT_PINNED_GIB = 64


def mem_available() -> int | None:
    """The kernel's ``MemAvailable`` in bytes, read once per process (the first call: best
    before the first pinned allocation, since XLA keeps freed pinned memory pooled); None
    where ``/proc/meminfo`` is missing."""
    global _FIRST_MEM_AVAILABLE
    if _FIRST_MEM_AVAILABLE is None:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        _FIRST_MEM_AVAILABLE = int(line.split()[1]) * 1024
        except OSError:
            pass
    return _FIRST_MEM_AVAILABLE


def pinned_pool_limit() -> int | None:
    """Bytes XLA's pinned-host pool may hold: :data:`PINNED_LIMIT_ENV` when set, else XLA's
    default of :data:`XLA_DEFAULT_PINNED_GIB` on a GPU; None elsewhere (the CPU client's
    ``pinned_host`` memory is ordinary memory, with no pool of its own)."""
    limit = os.environ.get(PINNED_LIMIT_ENV)
    if limit:
        return int(float(limit) * GiB)
    return XLA_DEFAULT_PINNED_GIB * GiB if jax.default_backend() == "gpu" else None


def host_budget(host_fraction: float = 0.85) -> int | None:
    """``MemAvailable * host_fraction``, capped by XLA's pinned-host pool limit
    (:func:`pinned_pool_limit`: 64 GiB on a GPU unless :func:`plan_pinned_host_limit` or the
    user set it); None when neither is known.

    The budget is per footprint: it does not subtract what other live objects hold."""
    avail = mem_available()
    avail = None if avail is None else int(avail * host_fraction)
    cap = pinned_pool_limit()
    if cap is not None:
        avail = cap if avail is None else min(avail, cap)
    return avail


def host_budget_note(host_fraction: float = 0.85) -> str:
    """Where :func:`host_budget` comes from, in words (for the lines that say what bounds a batch)."""
    avail, cap = mem_available(), pinned_pool_limit()
    parts = []
    if avail is not None:
        parts.append(f"{host_fraction:.0%} of MemAvailable {avail / GiB:.1f} GiB")
    if cap is not None:
        src = PINNED_LIMIT_ENV if os.environ.get(PINNED_LIMIT_ENV) else "XLA's default"
        parts.append(f"XLA's pinned pool {cap / GiB:.0f} GiB ({src})")
    budget = host_budget(host_fraction)
    return ("unknown" if budget is None else f"{budget / GiB:.1f} GiB usable: the least of " + " and ".join(parts)
            if len(parts) > 1 else f"{budget / GiB:.1f} GiB usable: {parts[0]}")


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public form: whether a client exists yet

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else True


def plan_pinned_host_limit(host_fraction: float = 0.85) -> str:
    """Size XLA's pinned-host pool from this machine, before its GPU client starts: set
    :data:`PINNED_LIMIT_ENV` to ``MemAvailable * host_fraction`` (whole GiB), unless the user
    set it. Without this the pool stops at 64 GiB on a box of any size, and a batch the host
    budget admitted fails to allocate. Returns a line saying what the limit is and why.

    Call it before anything starts jax's backends (``jax.devices()``, the first array):
    afterwards the client has read the variable, and this only says so."""
    given = os.environ.get(PINNED_LIMIT_ENV)
    if given:
        return f"pinned host pool: {given} GiB ({PINNED_LIMIT_ENV}, as set)"
    if _backend_started():
        return (f"pinned host pool: XLA's limit stands ({XLA_DEFAULT_PINNED_GIB} GiB on a GPU; the backend had "
                f"started before the planner could set {PINNED_LIMIT_ENV})")
    avail = mem_available()
    if avail is None:
        return f"pinned host pool: XLA's limit stands ({XLA_DEFAULT_PINNED_GIB} GiB on a GPU; MemAvailable unknown)"
    gib = max(1, int(avail * host_fraction) // GiB)
    os.environ[PINNED_LIMIT_ENV] = str(gib)
    return (f"pinned host pool: {gib} GiB ({host_fraction:.0%} of MemAvailable {avail / GiB:.1f} GiB; "
            f"{PINNED_LIMIT_ENV}={gib})")


def check_fits(fp: Footprint, *, device_limit: int | None, host_limit: int | None, what: str = "") -> None:
    """Raise :class:`CapacityError` (with the breakdown) when ``fp`` overflows a limit."""
    label = f"{what}: " if what else ""
    if device_limit is not None and fp.device_bytes > device_limit:
        raise CapacityError(
            f"{label}needs {fp.device_bytes / GiB:.2f} GiB of device memory but {device_limit / GiB:.2f} GiB are "
            f"usable ({fp.describe()}). Use a smaller batch or context, or offload the KV cache to host memory.")
    if host_limit is not None and fp.host_bytes > host_limit:
        raise CapacityError(
            f"{label}needs {fp.host_bytes / GiB:.2f} GiB of pinned host memory but {host_limit / GiB:.2f} GiB are "
            f"available ({fp.describe()}). Use a smaller batch or context.")


def max_batch(cfg, method, *, max_len: int, mode: str, device_limit: int | None, host_limit: int | None,
              dtype_bytes: int = 2, pool_slots: int | None = None, limit: int = 4096) -> int:
    """Largest batch whose footprint fits both limits (0 when none does)."""
    best = 0
    for b in range(1, limit + 1):
        fp = footprint(cfg, method, batch=b, max_len=max_len, mode=mode, dtype_bytes=dtype_bytes,
                       pool_slots=pool_slots)
        try:
            check_fits(fp, device_limit=device_limit, host_limit=host_limit)
        except CapacityError:
            break
        best = b
    return best
