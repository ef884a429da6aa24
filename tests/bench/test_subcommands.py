"""``herald bench``'s subcommands: each registered one names a module and an entry that
exist, and the argument handling of ``kafka`` and of ``scheduler``'s ``--compare-ref`` /
``--pool-vs-prange`` (the measurements themselves need a broker or minutes)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

from herald.bench import scheduler_compare
from herald.bench.cli import SUBCOMMANDS
from herald.bench.scheduler_timing import timing_worker
from herald.cli import build_parser, main
from herald.errors import ConfigError


@pytest.mark.parametrize("name, module, entry", [(s[0], s[1], s[4].get("entry", "run")) for s in SUBCOMMANDS])
def test_every_subcommand_names_a_module_with_its_entry(name, module, entry):
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"herald bench {name}: no module {module}"
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    assert entry in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{module} has no {entry}()"


def test_bench_kafka_defaults_and_options():
    args = build_parser().parse_args(["bench", "kafka"])
    assert (args.rows, args.batch, args.rows_per_message, args.bootstrap, args.criteo) == (
        200_000,
        4096,
        2048,
        None,
        None,
    )
    args = build_parser().parse_args(["bench", "kafka", "--rows", "10", "--bootstrap", "127.0.0.1:9092"])
    assert args.rows == 10 and args.bootstrap == "127.0.0.1:9092"


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--rows", "0"], "--rows"),
        (["--rows-per-message", "0"], "--rows-per-message"),
        (["--criteo", "/no/such.tsv"], "--criteo"),
    ],
)
def test_bench_kafka_rejects_bad_arguments_before_starting_a_broker(extra, words, capsys):
    assert main(["bench", "kafka", "--bootstrap", "127.0.0.1:1", *extra]) == 1
    assert words in capsys.readouterr().err


def test_bench_scheduler_compare_options_parse():
    args = build_parser().parse_args(["bench", "scheduler", "--compare-ref", "HEAD~1", "--cases", "0,2", "--no-plans"])
    assert args.compare_ref == "HEAD~1" and args.cases == "0,2" and args.no_plans and not args.pool_vs_prange
    args = build_parser().parse_args(["bench", "scheduler", "--pool-vs-prange"])
    assert args.pool_vs_prange and args.compare_ref is None and args.after_root is None


def test_case_indices():
    assert scheduler_compare.case_indices(None) == list(range(len(scheduler_compare.CASES)))
    assert scheduler_compare.case_indices("0,2") == [0, 2]
    for bad in ("9", "-1", "a", "0,,1"):
        with pytest.raises(ConfigError, match="--cases"):
            scheduler_compare.case_indices(bad)


def test_bench_scheduler_rejects_bad_cases_before_measuring(capsys):
    assert main(["bench", "scheduler", "--compare-ref", "HEAD", "--cases", "7"]) == 1
    assert "--cases" in capsys.readouterr().err


def test_timing_worker_times_every_step_and_digests_the_counts():
    data = "synthetic://criteo?rows=640&seed=0"
    a = timing_worker(data, "herald", 2, 32, True)
    b = timing_worker(data, "herald", 2, 32, False)
    assert len(a["submit_ms"]) == len(a["cpu_ms"]) == 10 and min(a["submit_ms"]) > 0
    assert a["counts"] == b["counts"]  # plans or not, the same counts
    assert timing_worker(data, "vanilla", 2, 32, True)["counts"] != a["counts"]
