"""The embedding parameter server (one process per shard) and its client.

Public API (docs/ps.md):

- :class:`OptimizerConfig`, :class:`TableConfig`: table and sparse-optimizer settings.
- :func:`shard_of`, :func:`init_rows`, :func:`apply_gradients`: row functions shared
  with the worker cache (same numba kernels: bit-identical rows).
- :class:`PSClient` (+ :class:`Handle`): pull / push_grad / push_rows / stats /
  checkpoint / restore / shutdown against the shards.
- :class:`LocalShards`: shard processes on loopback for tests and local jobs, with
  their liveness check (NOTE [ps liveness], :mod:`herald.ps.watch`).
- :class:`ShardLimits`: what one shard accepts (NOTE [ps limits], docs/ps.md).
"""

from herald.ps.checkpoint import CheckpointError
from herald.ps.client import Handle, PSClient
from herald.ps.config import OptimizerConfig, ShardLimits, TableConfig
from herald.ps.local import LocalShards
from herald.ps.rows import apply_gradients, init_rows, shard_of

__all__ = ["CheckpointError", "Handle", "LocalShards", "OptimizerConfig", "PSClient", "ShardLimits", "TableConfig",
           "apply_gradients", "init_rows", "shard_of"]
