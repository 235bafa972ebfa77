"""KV offloading to host memory (AsyncTLS Sec. 4.2 + SparseServe), for any method
whose selection names blocks: the tiers (:mod:`.tiers`), the offloaded layer as
a KV view and its decode step (:mod:`.pool`), and capacity planning
(:mod:`.capacity`). The layer driver (:mod:`models.driver`) runs offloaded
layers inside the one decode program; :mod:`models.runtime.tiered` builds the tiers
and saves completed blocks."""
