"""The embedding parameter server (one process per shard) and its client.

Tables and their sparse optimizers are declared with :class:`herald.contracts.TableConfig`.

Public API (docs/ps.md):

- :func:`shard_of`, :func:`init_rows`, :func:`apply_gradients`: row functions shared
  with the worker cache (same numba kernels: bit-identical rows).
- :class:`PSClient` (+ :class:`Handle`): pull / push_grad / push_rows / stats /
  checkpoint / restore / shutdown against the shards.
- :class:`LocalShards`: shard processes on loopback for tests and local jobs, with
  their liveness check (NOTE [ps liveness], :mod:`herald.ps.watch`).
- :class:`ShardLimits`: what one shard accepts (NOTE [ps limits], docs/ps.md).
"""

from herald.lazy import lazy_exports

# Names are imported on first use (PEP 562, herald/lazy.py).
_EXPORTS = {
    "CheckpointError": "checkpoint",
    "Handle": "client",
    "PSClient": "client",
    "ShardLimits": "config",
    "LocalShards": "local",
    "apply_gradients": "rows",
    "init_rows": "rows",
    "shard_of": "rows",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
