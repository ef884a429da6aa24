"""The dispatcher: global batches -> scheduler -> micro-batches over ZeroMQ (docs/dispatch.md).

Besides the pipeline, acks, credits and checkpoint barriers it holds the ID-feature buffer
and Persia's embedding worker (``--consistency hybrid``), GBA's data and token lists
(``--consistency gba``), peer validation and ``herald serve dispatcher``.
"""
