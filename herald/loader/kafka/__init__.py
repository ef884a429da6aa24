"""The Kafka source, its settings and position, record decoding, and ``herald produce``."""
