"""KV offloading to host memory (AsyncTLS Sec. 4.2 + SparseServe): the tiered
cache (:mod:`.tiers`), one offloaded decode step (:mod:`.step`) and capacity
planning (:mod:`.capacity`). The layer-by-layer engine that drives a model is
:mod:`models.layered`."""
