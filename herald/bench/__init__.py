"""Every ``herald bench ...`` subcommand: benchmarks, each against a baseline measured in the same run.

Layering: ``herald/cli.py`` > ``herald.bench`` > ``herald.testbed`` > ``herald.job`` > the
roles (``herald.dispatch``, ``herald.worker``, ``herald.scheduler``, ``herald.ps``,
``herald.loader``) > ``herald.contracts`` > the root modules. A module here may import anything
below it; nothing outside this package (but ``herald/cli.py``) imports it.

- :mod:`herald.bench.cli`: ``register``, the parsers of every subcommand; it imports only
  :mod:`herald.bench.options` (argparse), and a subcommand's module when the subcommand runs.
- :mod:`herald.bench.common`: the plain single-process PyTorch baseline and the helpers
  shared by the benches below.
- ``loader``, ``scheduler`` (with ``scheduler_threads``), ``ps``, ``capacity`` (with
  ``ackpeers``, the fake workers), ``kernels``, ``e2e``, ``scale`` (with ``gpu`` and
  ``torchrec_baseline`` and ``torchrec_dist``, TorchRec at N workers), ``network``, ``comm``
  (compression, groups), ``consistency``, ``device`` (with ``device_sections``,
  ``device_summary``, ``options_device``: one prepared GPU-machine run, docs/bench.md):
  one module per subcommand.
"""
