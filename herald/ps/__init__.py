"""The embedding parameter server (one process per shard) and its client."""
