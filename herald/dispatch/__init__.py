"""The dispatcher: global batches -> scheduler -> micro-batches over ZeroMQ (docs/dispatch.md)."""
