"""A multi-host test bed on one machine (docs/testbed.md).

- :mod:`herald.testbed.netns`: :class:`TestBed`, network namespaces as hosts on a
  bridge with shaped links (NOTE [test bed network], NOTE [test bed teardown]);
  :func:`cleanup_stale`.
- :mod:`herald.testbed.job`: :func:`run_job`, a herald job across the bed's hosts
  (NOTE [test bed job]); the programs it starts besides ``herald serve ps|worker``:
  :mod:`~herald.testbed.dispatcher`, :mod:`~herald.testbed.store`.
- ``python -m herald.testbed run|up|cleanup``; the network benchmark of ``herald`` runs
  its schedules on a bed (docs/testbed.md, "Tests and benchmark").

Needs Linux, root, ``ip`` and ``tc`` (iproute2).
"""

from herald.testbed.links import TestBedError
from herald.testbed.netns import TestBed, cleanup_stale, list_namespaces

__all__ = ["TestBed", "TestBedError", "cleanup_stale", "list_namespaces"]
