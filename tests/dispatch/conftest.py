"""The scripted-peer fixture of test_dispatcher_peers.py, shared with test_pipeline.py."""

from test_dispatcher_peers import job_of  # noqa: F401
