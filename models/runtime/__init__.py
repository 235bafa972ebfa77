"""Runners over a loaded :class:`models.Model`: the tiered offload runner (KV blocks in
pinned host memory), tensor and data parallelism over a mesh, and AsyncSpade's cache
rank on a second device. Each takes the model and keeps its ``init_cache / prefill /
decode_step`` API."""

from models.runtime.cache_rank import CacheRankModel, with_cache_rank
from models.runtime.sharding import Parallelism, ShardedModel, shard
from models.runtime.tiered import TieredRunner

__all__ = ["CacheRankModel", "Parallelism", "ShardedModel", "TieredRunner", "shard", "with_cache_rank"]
