"""``herald bench ...``: every benchmark subcommand; see :mod:`herald.cli`.

- ``herald bench loader [--rows N] [--repeats R] [--quick]`` (:mod:`herald.bench.loader`)
- ``herald bench scheduler --data PATH_OR_URL --workers 8 --batch-size 128 --cache-ratio 0.1
  [--quality] [--scaling] [--memory-keys N] [--threads N,N] [--out DIR]`` (:mod:`herald.bench.scheduler`),
  or ``--compare-ref REF`` / ``--pool-vs-prange`` (:mod:`herald.bench.scheduler_compare`)
- ``herald bench kafka``: the Kafka source, tsv vs arrow records vs Parquet (:mod:`herald.bench.kafka`)
- ``herald bench ps``: pull/push throughput against one shard next to a numpy memcpy (:mod:`herald.bench.ps`)
- ``herald bench step --workers N --shards S``: one shard's CPU time per global step (:mod:`herald.bench.step`)
- ``herald bench dispatcher``: the dispatcher's capacity (:mod:`herald.bench.capacity`)
- ``herald bench e2e | scale | network``: herald jobs against vanilla, plain PyTorch and
  TorchRec (:mod:`herald.bench.e2e`, :mod:`herald.bench.scale`, :mod:`herald.bench.network`)
- ``herald bench compression | groups`` (:mod:`herald.bench.comm`, docs/compression.md)
- ``herald bench consistency`` (:mod:`herald.bench.consistency`, docs/consistency.md)
- ``herald bench kernels``: the worker cache's hot path against FBGEMM (:mod:`herald.bench.kernel_speed`)
- ``herald bench device --out DIR [--smoke] [--wheels DIR]``: one prepared GPU-machine run
  (:mod:`herald.bench.device`)

Building the parsers imports :mod:`herald.bench.options` only: a bench module is imported
when its subcommand runs, and its docstring (the ``--help`` description) is read from its
source when ``--help`` asks for it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pathlib
from collections.abc import Callable

from herald.bench import options


def module_doc(module: str) -> str | None:
    """The docstring of ``module``, read from its source file without importing it."""
    spec = importlib.util.find_spec(module)
    return ast.get_docstring(ast.parse(pathlib.Path(spec.origin).read_text()), clean=False)


class _ModuleHelp(argparse.Action):
    """``-h, --help`` of a bench subcommand whose description is its module's docstring
    (:func:`module_doc`, read only when the help is printed)."""

    def __init__(
        self,
        option_strings,
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        *,
        module: str,
        help="show this help message and exit",
    ):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)
        self.module = module

    def __call__(self, parser, namespace, values, option_string=None):
        parser.description = module_doc(self.module)
        parser.print_help()
        parser.exit()


def _runner(module: str, entry: str) -> Callable[[argparse.Namespace], int]:
    """A parser's ``func``: ``module.entry(args)``, exit status 0 (a failure raises)."""

    def run(args: argparse.Namespace) -> int:
        # imported when the subcommand runs, not at registration: start-up cost of `herald --help` (torch, numba)
        getattr(importlib.import_module(module), entry)(args)
        return 0

    return run


def _add(
    bench,
    name: str,
    module: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    help: str,
    *,
    entry: str = "run",
    described: bool = True,
    raw: bool = True,
) -> None:
    """Add ``herald bench NAME``: the options of ``add_arguments``, run by ``module.entry(args)``;
    ``described``: ``--help`` shows the module's docstring (``raw``: as written, else re-wrapped)."""
    b = bench.add_parser(
        name,
        help=help,
        add_help=not described,
        formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter,
    )
    if described:
        b.add_argument("-h", "--help", action=_ModuleHelp, module=module)
    add_arguments(b)
    b.set_defaults(func=_runner(module, entry))


#: every ``herald bench`` subcommand: ``(name, module, add_arguments, help, options of _add)``
SUBCOMMANDS = (
    (
        "loader",
        "herald.bench.loader",
        options.add_loader_arguments,
        "samples/s: Parquet, Criteo TSV and herald's DataLoader dataset vs a plain torch DataLoader",
        {"entry": "main", "described": False},
    ),
    (
        "scheduler",
        "herald.bench.scheduler",
        options.add_scheduler_arguments,
        "Herald Table 2: transmissions of vanilla/laia/plan/herald/costaware, scheduling time, quality vs brute force",
        {"entry": "main", "described": False},
    ),
    (
        "kafka",
        "herald.bench.kafka",
        options.add_kafka_arguments,
        "Kafka source samples/s from a real broker: tsv vs arrow records vs Parquet (same run)",
        {},
    ),
    (
        "ps",
        "herald.bench.ps",
        options.add_ps_arguments,
        "PS pull/push throughput vs numpy memcpy (one shard)",
        {"entry": "main", "described": False},
    ),
    (
        "step",
        "herald.bench.step",
        options.add_step_arguments,
        "one PS shard's CPU time per global step of an N-worker job (requests replayed in process)",
        {},
    ),
    (
        "dispatcher",
        "herald.bench.capacity",
        options.add_dispatcher_arguments,
        "dispatcher capacity: samples/s with workers that ack at once",
        {},
    ),
    (
        "e2e",
        "herald.bench.e2e",
        options.add_e2e_arguments,
        "herald vs vanilla end to end: samples/s and bytes moved (same run)",
        {"raw": False},
    ),
    (
        "scale",
        "herald.bench.scale",
        options.add_scale_arguments,
        "herald with 1, 2, 4, ... workers vs plain single-process PyTorch (samples/s, scaling factor, "
        "phases; same run)",
        {},
    ),
    (
        "network",
        "herald.bench.network",
        options.add_network_arguments,
        "vanilla, laia, plan, herald, costaware across hosts with shaped links (network-namespace test "
        "bed, root; samples/s, bytes, AUC; same run)",
        {},
    ),
    # compression, groups: docs/compression.md
    (
        "compression",
        "herald.bench.comm",
        options.add_compression_arguments,
        "fp32 vs fp16/bf16/int8 wire: bytes, samples/s, AUC (same run)",
        {"entry": "run_compression"},
    ),
    (
        "groups",
        "herald.bench.comm",
        options.add_groups_arguments,
        "HT groups G = 1, 2 with and without a straggler: samples/s, AUC, lag",
        {"entry": "run_groups"},
    ),
    # consistency modes with and without a straggler: docs/consistency.md
    (
        "consistency",
        "herald.bench.consistency",
        options.add_consistency_arguments,
        "bsp, bounded (s = 1, 4, 16), hybrid and gba (iota = 0, 4), with and without a straggler (2x each "
        "mode's own step by default): AUC, log loss, samples/s and its ratio to bsp, transmissions (same run)",
        {},
    ),
    # DIN on MovieLens against a plain PyTorch DIN and NCF: docs/models.md
    (
        "din",
        "herald.bench.din",
        options.add_din_arguments,
        "herald --model din (2 workers, bsp) vs a plain single-process PyTorch DIN and herald ncf on "
        "MovieLens: held-out AUC per seed and median (same run)",
        {},
    ),
    # one prepared GPU-machine run: the CUDA tests, scale, step, gpu, a profile, arrivals
    (
        "device",
        "herald.bench.device",
        options.add_device_arguments,
        "one GPU-machine run (<= 8 min on 16 cores): CUDA exactness tests, scale with TorchRec at N, step, "
        "herald GPU vs PyTorch GPU, a profile, the shards' arrivals; --smoke: the same at tiny sizes",
        {},
    ),
    # the worker cache's hot path against FBGEMM TBE, one thread
    (
        "kernels",
        "herald.bench.kernel_speed",
        options.add_kernels_arguments,
        "worker cache hot path (numba) vs FBGEMM TBE on the CPU, one thread",
        {},
    ),
)


def register(commands, bench, serve) -> None:
    """Add every ``herald bench`` subcommand of :data:`SUBCOMMANDS` (``commands`` and ``serve`` get none)."""
    for name, module, add_arguments, help, kw in SUBCOMMANDS:
        _add(bench, name, module, add_arguments, help, **kw)
