"""``asynctls`` (AsyncTLS): two-level selection, a Quest GEMM block filter then Double
Sparsity's label-score token selection inside the kept blocks, with the one-step lag
(Sec. 4.2) that lets an offloaded cache prefetch the next step's blocks.

State per layer (:class:`TwoLevelState`): Double Sparsity's label cache, the per-block key
boxes of the Quest filter (exact, or 8-bit codes), and with ``lag=True`` the blocks the
previous step's query chose.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_jax.methods.double_sparsity import DoubleSparsity
from sparse_jax.methods.quest import BlockBoxes, check_group_reduce
from sparse_jax.methods.registry import register
from sparse_jax.ops.scoring import (
    QuantizedBoxes,
    block_label_scores,
    block_label_topk,
    block_minmax,
    build_label_cache,
    quantize_block_boxes,
    quest_block_scores,
    quest_block_scores_quantized,
    update_block_minmax,
    update_label_cache,
    update_quantized_block_boxes,
)
from sparse_jax.ops.selection import topk_indices
from sparse_jax.selection import Selection


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwoLevelState:
    """AsyncTLS's per-layer state. ``prev_blocks int32[B, Hkv, n-1]`` (``lag=True``
    only, else None): the blocks the previous step's query chose for this step."""

    boxes: BlockBoxes | QuantizedBoxes
    labels: object
    prev_blocks: object = None


@register("asynctls")
@dataclasses.dataclass(frozen=True)
class AsyncTLS(DoubleSparsity):
    """Two-level selection: a Quest GEMM block filter keeps ``kb`` blocks, then
    Double-Sparsity token selection runs inside them.

    Defaults from AsyncTLS (Sec. 5): 64-token blocks, ``kb = 128`` blocks (8,192
    candidate tokens; at contexts up to that the filter keeps everything),
    ``head_dim // 4`` label channels (32 of 128 for GQA) ranked by AsyncTLS's
    max|q|*max|k| rule, INT4 labels, budgets 512/1024/2048 tokens. The paper
    names no dense layers, sink or window; we keep layers 0-1 dense as Quest
    and DS do. The newest block is always among the candidates.

    ``lag`` (Sec. 4.2): with ``lag=True`` the block filter runs one step
    ahead: the ``kb - 1`` blocks searched at step ``t`` were chosen by the
    query of step ``t - 1`` (for the first decode step, by the last prompt
    token's query), which is what lets an offloaded cache prefetch them while
    step ``t - 1`` still computes. ``lag=False`` (default) chooses them with
    the current query. The offloaded cache (:mod:`sparse_jax.offload`) runs
    ``lag=True`` and matches this method's resident output.
    """

    block_size: int = 64
    kb: int = 128
    ranking: str = "maxabs"
    lag: bool = False
    #: benchmarks on random weights only (0 = the real method): random weights have no
    #: temporal locality, so with ``lag`` the next step's block set is this step's with
    #: ``round(churn * (kb-1))`` blocks replaced, emulating a hit rate measured on real
    #: text; the filter still runs, so its cost is paid
    churn: float = 0.0
    #: how the filter combines a KV head's query heads' block bounds: "max" (default: a block
    #: any one head wants ranks high) or "sum" (AsyncTLS's GEMM form; see ``Quest.group_reduce``).
    #: Measured on Gemma 3 (4 query heads per KV head, H100, 100 prompts a task): "sum" loses
    #: several times the points "max" loses at 16K and 32K (docs/methods.md, 'The group
    #: reduction measured')
    group_reduce: str = "max"
    #: the second level's kernels without a sink or window (``block_label_topk(fused=...)``):
    #: True runs one kernel that normalizes, selects and maps to tokens; False the label
    #: normalization, the top-k (which also counts the unmasked slots) and XLA's token map;
    #: None (default) the op's default (``sparse_jax.ops.scoring.FUSED_LABEL_TOPK``). Measured on the H100 (128K,
    #: K=2048, 2026-11-28): a tie in the model path (docs/kernels.md, 'The fused second level
    #: in the model path')
    fused_selection: bool | None = None
    #: the filter's block boxes: 8 (default) as 8-bit codes over each channel's range, the max
    #: rounded up and the min down (half the bytes for the filter to read, and the Quest bound
    #: stays a bound; ``pallas_kernels.quantized_boxes``), or None in the cache's dtype. On the
    #: H200 (2026-11-28) the method step got faster at the same RULER scores on Gemma 3 within
    #: a few prompts (docs/methods.md, the ``asynctls`` row of 'Per method'; docs/kernels.md,
    #: '8-bit block boxes')
    box_bits: int | None = 8

    def __post_init__(self):
        check_group_reduce(self.name, self.group_reduce)
        if self.fused_selection not in (None, True, False):
            raise ValueError(f"{self.name}: fused_selection must be True, False or None, got {self.fused_selection!r}")
        if self.box_bits not in (None, 8):
            raise ValueError(f"{self.name}: box_bits must be None (boxes in the cache's dtype) or 8, got {self.box_bits!r}")

    @property
    def cache_multiple(self) -> int:
        return self.block_size

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        super().check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)
        if max_len % self.block_size:
            raise ValueError(f"asynctls: the cache length ({max_len}) must be a multiple of block_size ({self.block_size})")
        if self.kb < 1:
            raise ValueError("asynctls: kb must be >= 1")

    def filter_blocks(self, max_len: int) -> int:
        """Blocks the filter picks besides the newest: ``min(kb, S / block) - 1``."""
        return min(self.kb, max_len // self.block_size) - 1

    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        shape = (batch, num_kv_heads, max_len // self.block_size, head_dim)
        labels = super().init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                                    head_dim=head_dim, dtype=dtype, num_q_heads=num_q_heads)
        prev = None
        if self.lag:
            prev = jnp.zeros((batch, num_kv_heads, self.filter_blocks(max_len)), jnp.int32)
        if self.box_bits == 8:
            boxes = QuantizedBoxes.zeros(*shape)
        else:
            boxes = BlockBoxes(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        return TwoLevelState(boxes, labels, prev)

    def prefill_state(self, state, k, v, lengths, layer):
        return self.state_from_keys(k, lengths, layer.data["channels"], state.prev_blocks)

    # The state updates and the token selection take the label channels as an
    # argument, so the offloaded cache (sparse_jax.offload), whose layers share
    # one compiled step, runs exactly these functions.
    def state_from_keys(self, k, lengths, channels, prev_blocks=None) -> TwoLevelState:
        """Boxes and labels of a whole layer cache ``k [B,Hkv,S,D]``."""
        upper, lower = block_minmax(k, lengths, block_size=self.block_size, impl=self.impl)
        if self.box_bits == 8:
            boxes = quantize_block_boxes(upper, lower, lengths, block_size=self.block_size)
        else:
            boxes = BlockBoxes(upper, lower)
        labels = self._laid_out(build_label_cache(k, channels, impl=self.impl))
        return TwoLevelState(boxes, labels, prev_blocks)

    def append_key(self, state, k_new, positions, channels) -> TwoLevelState:
        """``state`` with one appended key per row, ``k_new [B,Hkv,D]`` at ``positions``."""
        if isinstance(state.boxes, QuantizedBoxes):
            boxes = update_quantized_block_boxes(state.boxes, k_new, positions, block_size=self.block_size)
        else:
            boxes = BlockBoxes(*update_block_minmax(state.boxes.upper, state.boxes.lower, k_new, positions,
                                                    block_size=self.block_size))
        labels = update_label_cache(state.labels, k_new, channels, positions)
        return TwoLevelState(boxes, labels, state.prev_blocks)

    def select_tokens(self, q, state, blocks, lengths, channels, capacity, *, with_newest=False):
        """Top tokens by label score inside ``blocks [B,Hkv,n-1]`` and the newest
        block: ``(positions int32[B,Hkv,K], counts int32[B,Hkv])``. ``with_newest``:
        ``blocks [B,Hkv,n]`` already end with the newest (``pick_blocks(with_newest=True)``).

        The labels are scored over the block ids (``block_label_scores``: the
        kernel makes the positions in registers, so no candidate array is written
        for it), in :meth:`expand_blocks`'s order and with its mask: a short row's
        ``arange`` blocks already hold its newest block unless that is block
        ``n-1``, so the appended copy is counted out; tokens at or past ``lengths``
        score 0."""
        if with_newest:
            all_blocks, newest = blocks, (lengths - 1) // self.block_size
            blocks = blocks[..., :-1]
        else:
            all_blocks, newest = self._with_newest(blocks, lengths)
        n1 = blocks.shape[-1]
        scored = jnp.where(newest < n1, n1, n1 + 1)[:, None].astype(jnp.int32)  # [B, 1]: every KV head
        if not self.sink and not self.window:
            # AsyncTLS as published: the top tokens of the candidates, scored, chosen and
            # mapped to positions by one op (block_label_topk), without the candidate array
            # and masks of the path below; its mask is that path's, so the same tokens are chosen.
            c = all_blocks.shape[-1] * self.block_size
            budget = min(self.budget, capacity if capacity is not None else c)
            # a row no longer than the budget attends its whole context (fallback_to_dense's
            # rule), decided by the selecting kernel as it writes the tokens
            return block_label_topk(q, state.labels, channels, all_blocks, scored, lengths,
                                    block_size=self.block_size, k=min(budget, c), impl=self.impl,
                                    fused=self.fused_selection, dense_budget=budget)
        scores = block_label_scores(q, state.labels, channels, all_blocks, scored, lengths,
                                    block_size=self.block_size, impl=self.impl)
        cand, cand_counts = self.expand_blocks(blocks, lengths)  # positions for the top-k's masks and gather
        return self.select_from_scores(scores, lengths, cand, cand_counts, capacity=capacity)

    def prefill_query_state(self, state, q_last, lengths, layer):
        if not self.lag:
            return state
        # the first decode step has length lengths + 1: its newest block is lengths // bs
        prev = self.pick_blocks(q_last, state.boxes, lengths // self.block_size)
        return dataclasses.replace(state, prev_blocks=prev)

    def append_state(self, state, kv, positions, layer):
        return self.append_key(state, kv.newest_keys(positions), positions, layer.data["channels"])

    def pick_blocks(self, q, boxes, newest, *, with_newest=False):
        """The filter: ``int32[B, Hkv, n-1]`` best blocks by the Quest bound among
        blocks ``< newest int32[B]`` (the newest block is attended anyway).
        Rows with ``newest <= n-1`` get ``arange(n-1)``: all their blocks (and
        some past the context, which :meth:`expand_blocks` counts out).
        ``with_newest``: ``int32[B, Hkv, n]``, ``newest`` appended (by the top-k kernel as it
        stores, not by a concatenate after it)."""
        if isinstance(boxes, QuantizedBoxes):
            scores = quest_block_scores_quantized(q, boxes, group_reduce=self.group_reduce, impl=self.impl)
        else:
            scores = quest_block_scores(q, boxes.upper, boxes.lower, group_reduce=self.group_reduce, impl=self.impl)
        b, hkv, nb = scores.shape
        n1 = min(self.kb, nb) - 1
        last = newest.astype(jnp.int32)[:, None]  # [B, 1]: every KV head of the row
        if n1 < 1:  # a one-block filter: the newest block alone
            return jnp.broadcast_to(last[..., None], (b, hkv, 1)) if with_newest else jnp.zeros((b, hkv, 0), jnp.int32)
        # blocks at or past the newest are not candidates: the top-k's count leaves them out
        # (as an -inf mask did, without a pass over the scores); a row with at most n1 blocks
        # before its newest gets arange(n1), written by the kernel (its dense fallback) rather
        # than by a select after it
        return topk_indices(scores, n1, last, impl=self.impl, dense_lengths=last, dense_limit=n1,
                            append=last if with_newest else None)

    def _with_newest(self, blocks, lengths):
        """``(blocks [B,Hkv,n-1]`` with each row's newest block appended ``[B,Hkv,n]``,
        ``newest int32[B])``."""
        b, hkv, _ = blocks.shape
        newest = (lengths - 1) // self.block_size
        return jnp.concatenate([blocks, jnp.broadcast_to(newest[:, None, None], (b, hkv, 1))], -1), newest

    def expand_blocks(self, blocks, lengths):
        """Candidate tokens of ``blocks [B,Hkv,n-1]`` plus the newest block (last):
        ``(positions int32[B,Hkv,n*bs], counts int32[B,Hkv])``, the first
        ``counts`` real. A short row's ``arange`` blocks hold its newest block at
        index ``newest``, so its first ``lengths`` candidates are ``0..L-1``."""
        bs = self.block_size
        b, hkv, n1 = blocks.shape
        all_blocks, newest = self._with_newest(blocks, lengths)
        tokens = (all_blocks[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(b, hkv, -1)
        short = newest <= n1
        counts = jnp.where(short, lengths, n1 * bs + lengths - newest * bs)
        return tokens, jnp.broadcast_to(counts[:, None], (b, hkv)).astype(jnp.int32)

    def select(self, q, kv, lengths, state, carry, layer):
        channels = layer.data["channels"]
        if self.lag:
            indices, counts = self.select_tokens(q, state, state.prev_blocks, lengths, channels, kv.capacity)
        else:  # the filter's blocks with the newest appended, as the label kernels read them
            blocks = self.pick_blocks(q, state.boxes, (lengths - 1) // self.block_size, with_newest=True)
            indices, counts = self.select_tokens(q, state, blocks, lengths, channels, kv.capacity,
                                                 with_newest=True)
        if not self.lag:
            return Selection.tokens(indices, counts), state, carry
        # this query picks the next step's blocks (its newest block is lengths // bs): the
        # selection's prefetch, which an offloaded cache copies while this step computes
        nxt = self.pick_blocks(q, state.boxes, lengths // self.block_size)
        if self.churn > 0 and nxt.shape[-1]:
            nxt = _churned(nxt, state.prev_blocks, lengths // self.block_size, lengths - 1, self.churn)
        sel = Selection.tokens(indices, counts, prefetch=nxt, block_size=self.block_size, within_prefetch=True)
        return sel, dataclasses.replace(state, prev_blocks=nxt), carry

    # -- offloading: the lagged filter is what lets the blocks move a step early --------
    def for_offload(self):
        return dataclasses.replace(self, lag=True)

    @property
    def offload_block_size(self):
        return self.block_size if self.lag else None

    def offload_blocks_per_step(self, max_len):
        return max(self.filter_blocks(max_len), 1)

    def check_offload(self, max_len):
        if self.sink or self.window:
            raise ValueError("offloaded asynctls: sink/window tokens are not supported (the paper uses none)")
        n1 = self.filter_blocks(max_len)
        if self.budget > (n1 + 1) * self.block_size:
            raise ValueError(
                f"offloaded asynctls: the budget ({self.budget}) exceeds the candidate tokens "
                f"((kb) * block = {(n1 + 1) * self.block_size}); raise kb")

    def first_prefetch(self, state):
        return state.prev_blocks


def _churned(real, prev, newest_next, pos, churn):
    """Last step's set with its first ``round(churn * n1)`` blocks moved (benchmarks)."""
    n1 = real.shape[-1]
    c = max(1, round(churn * n1))
    elig = jnp.maximum(newest_next - 1, 1)[:, None, None]
    shift = 1 + (pos[:, None, None] * 7919) % jnp.maximum(elig - 1, 1)
    moved = (prev + shift) % elig
    sim = jnp.where(jnp.arange(n1) < c, moved, prev)
    long = (newest_next > n1 + 1)[:, None, None]  # short rows keep the real (complete) set
    # keep the real filter in the graph: its cost is what the benchmark measures
    return jnp.where(long & (real != -12345), sim, real).astype(jnp.int32)
