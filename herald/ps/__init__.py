"""The embedding parameter server (one process per shard) and its client.

Tables and their sparse optimizers are declared with :class:`herald.spec.TableConfig`.

Public API (docs/ps.md):

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
from herald.ps.config import ShardLimits
from herald.ps.local import LocalShards
from herald.ps.rows import apply_gradients, init_rows, shard_of

__all__ = ["CheckpointError", "Handle", "LocalShards", "PSClient", "ShardLimits", "apply_gradients", "init_rows",
           "shard_of"]
