"""Fixtures for integration tests that start real services.

``no_test_bed_left_behind`` (autouse): fails the session if a multi-host test bed it
opened (herald/testbed) is still there at the end.

``ray``: the ``ray`` module (``herald train --launcher ray``); missing, the tests that need
it fail under ``CI=true`` and are skipped (with the reason) otherwise.

``kafka_broker``: one real Kafka 0.9.0.1 broker per test session (see
:mod:`herald.loader.kafka.broker`), yielding its bootstrap address ``"127.0.0.1:PORT"``.
When it cannot start, the tests that need it fail under ``CI=true`` and are
skipped (with the reason) otherwise.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import uuid

import pytest

from herald.loader.kafka.broker import API_VERSION, BrokerError, KafkaBroker

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # ``from proc_tree import ...``


@pytest.fixture(scope="session", autouse=True)
def no_test_bed_left_behind():
    """At the end of the session, no multi-host test bed this process opened is left
    (NOTE [test bed teardown] in herald/testbed/netns.py): a leftover fails the session."""
    yield
    from herald.testbed.netns import beds_of

    left = beds_of(os.getpid())  # this session's beds only: other sessions may be running theirs
    if left:
        pytest.fail(
            f"test beds left behind by this session: {left} (they are closed at exit; otherwise "
            "`python -m herald.testbed cleanup`)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def kafka_broker():
    """Bootstrap address of a real Kafka broker started once for the session (clients: api_version=(0, 9))."""
    broker = KafkaBroker()
    try:
        broker.start()
    except (BrokerError, OSError) as exc:
        broker.stop()
        message = f"could not start the Kafka test broker: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message + " (set CI=true to make this a failure)")
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def kafka_topic(request) -> str:
    """A fresh topic name for one test (auto-created by the broker on first use)."""
    name = re.sub(r"[^a-zA-Z0-9._-]", "-", request.node.name)[:60]
    return f"herald-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def kafka_api_version() -> tuple[int, int]:
    """The ``api_version`` every client must pass to the test broker."""
    return API_VERSION


@pytest.fixture(scope="module")
def ray():
    """The ``ray`` module, or fail (CI) / skip (elsewhere) naming the fix."""
    try:
        import ray
        import ray.cluster_utils  # noqa: F401  (the two-node cluster)
    except ImportError as exc:
        message = f"Ray is not installed ({exc}): pip install -e '.[ray]' (make test installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message + " (set CI=true to make this a failure)")
    return ray
