"""The Kafka source, its settings and position, and record decoding.

``herald produce`` (publishing into a topic) is :mod:`herald.loader.produce`.
"""
