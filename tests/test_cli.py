"""The ``herald`` command line: error lines and exit codes (herald/cli.py), and the
dispatcher settings of ``herald serve dispatcher`` (herald/job/serve_dispatcher.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from herald import cli
from herald.errors import ConfigError, HeraldError
from herald.job.cli import config_from_args
from herald.job.recovery.failover import SHARD_FAILED_EXIT, ShardLost
from herald.job.serve_dispatcher import dispatcher_config


class _Stopped(HeraldError):
    """Like ``herald.job.launcher.JobInterrupted``: a clean stop on SIGINT (128 + 2)."""

    exit_code = 130


def _raising(exc: BaseException):
    """A stand-in for :func:`herald.cli.build_parser` whose only command raises ``exc``."""

    def build() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="herald")

        def run(_args):
            raise exc

        parser.set_defaults(func=run)
        return parser

    return build


@pytest.mark.parametrize(
    "exc, code",
    [
        (HeraldError("worker 1 failed: boom"), 1),
        (ConfigError("--workers must be >= 1"), 1),
        (ShardLost("PS shard 0 went silent; latest checkpoint: none"), SHARD_FAILED_EXIT),
    ],
)
def test_every_error_line_starts_with_the_error_prefix_and_keeps_its_exit_code(monkeypatch, capsys, exc, code):
    monkeypatch.setattr(cli, "build_parser", _raising(exc))
    assert cli.main([]) == code
    assert capsys.readouterr().err == f"herald: error: {exc}\n"


def test_a_clean_stop_on_a_signal_is_not_an_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", _raising(_Stopped("interrupted by SIGINT at step 3; report in r")))
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "herald: interrupted by SIGINT at step 3; report in r\n"


def _serve_dispatcher_args(*extra: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(
        [
            "serve",
            "dispatcher",
            "--source",
            "synthetic://criteo?rows=64",
            "--workers",
            "3",
            "--ps",
            "tcp://127.0.0.1:1",
            *extra,
        ]
    )


def test_serve_dispatcher_passes_its_job_settings_to_the_dispatcher():
    args = _serve_dispatcher_args(
        "--max-inflight-steps",
        "5",
        "--timeout-ms",
        "7000",
        "--dispatcher-rank",
        "4",
        "--bind",
        "tcp://127.0.0.1:0",
        "--checkpoint-every",
        "9",
    )
    disp = dispatcher_config(config_from_args(args), args)
    assert (disp.num_workers, disp.max_inflight_steps, disp.peer_timeout_ms) == (3, 5, 7000)
    assert (disp.dispatcher_rank, disp.bind, disp.checkpoint_every_steps) == (4, "tcp://127.0.0.1:0", 9)
    default = _serve_dispatcher_args()  # bsp: 3, so the next micro-batch is there before a step's message
    assert dispatcher_config(config_from_args(default), default).max_inflight_steps == 3
    hybrid = _serve_dispatcher_args("--consistency", "hybrid")  # its window bounds staleness
    assert dispatcher_config(config_from_args(hybrid), hybrid).max_inflight_steps == 2


def test_serve_dispatcher_names_the_flag_of_a_setting_out_of_range(capsys):
    with pytest.raises(SystemExit) as info:  # argparse's usage error (NOTE [front doors] in herald/inputs.py)
        _serve_dispatcher_args("--dispatcher-rank", "256")
    assert info.value.code == 2
    assert "argument --dispatcher-rank: must be an integer in 0..255, got 256" in capsys.readouterr().err


# ``python -m herald ARGS`` that prints, on its way out, which heavy modules it had imported
_RUN_AND_LIST_HEAVY_IMPORTS = (
    "import runpy, sys\n"
    "sys.argv = ['herald', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('herald', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    print(sorted(m for m in ('torch', 'numba', 'zmq', 'pyarrow') if m in sys.modules))\n"
)


def test_cli_process_rejects_a_bad_value_before_any_heavy_import(tmp_path):
    """The options are checked before torch (or numba, zmq, pyarrow) is imported and before
    anything starts: what makes the refusal immediate, asserted without a clock."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AND_LIST_HEAVY_IMPORTS, "train", "--dense-lr", "nan", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "herald: error: --dense-lr must be a finite number > 0, got nan"
    assert done.stdout.strip() == "[]", f"imported before the refusal: {done.stdout.strip()}"
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
