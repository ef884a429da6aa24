"""NOTE [front doors] (herald/inputs.py): every bad input to a ``herald`` command ends with exit
status 2 (usage) or 1 and one line naming the input, the value and the fix, before any
socket or process starts: never a raw exception name, never a hang.

The table below is argv -> (exit status, the first words of the error). The cases that
start no socket run in this process (``herald.cli.main``); those that once hung run as
subprocesses under a timeout, the hang guard.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from herald import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
#: A raw exception's name in a message (``TypeError``, ``ZMQError``...); herald's own lines say ``error:``.
RAW = re.compile(r"\b[A-Za-z]*(Error|Exception)\b|Traceback")
#: The hang guard of one subprocess case, seconds (each ends within a few seconds; the
#: margin is for a loaded 2-core host starting Python).
HANG_GUARD_S = 60

PS = ["serve", "ps", "--shard", "0", "--num-shards", "1"]
WORKER = ["serve", "worker", "--dispatcher", "tcp://127.0.0.1:1"]
DISPATCHER = ["serve", "dispatcher", "--ps", "tcp://127.0.0.1:1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The files the cases name: a binary file, a FIFO, a plain file, tables files, a token."""
    root = tmp_path_factory.mktemp("front")
    out = {"root": str(root)}
    (root / "binary").write_bytes(bytes(range(256)) * 4)
    out["binary"] = str(root / "binary")
    (root / "plain").write_text("x\n")
    out["plain"] = str(root / "plain")
    os.mkfifo(root / "fifo")
    out["fifo"] = str(root / "fifo")
    (root / "folder").mkdir()
    out["folder"] = str(root / "folder")
    token = root / "token"
    token.write_bytes(b"\xff\xfe\x00binary")
    token.chmod(0o600)
    out["token"] = str(token)
    (root / "wide.json").write_text('[{"name": "t", "dim": 5000}]')  # valid, but over --max-dim 4096
    out["wide"] = str(root / "wide.json")
    for name, content in TABLE_FILES.items():
        path = root / f"tables-{name}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        out[f"tables-{name}"] = str(path)
    return out


def _table(**fields):
    return [{"name": "t", "dim": 4, **fields}]


#: ``--tables FILE`` contents -> the words their error starts with (after ``--tables FILE:``).
TABLE_FILES = {
    "no-name": [{"dim": 4}],
    "no-dim": [{"name": "t"}],
    "dim-true": _table(dim=True),
    "dim-float": _table(dim=4.5),
    "dim-string": _table(dim="4"),
    "dim-zero": _table(dim=0),
    "dim-negative": _table(dim=-3),
    "optimizer-string": _table(optimizer="adagrad"),
    "optimizer-list": _table(optimizer=["sgd"]),
    "optimizer-unknown": _table(optimizer={"name": "lamb"}),
    "optimizer-key": _table(optimizer={"name": "sgd", "momentum": 0.9}),
    "lr-string": _table(optimizer={"name": "sgd", "lr": "0.1"}),
    "lr-infinity": '[{"name": "t", "dim": 4, "optimizer": {"name": "sgd", "lr": Infinity}}]',
    "lr-nan": '[{"name": "t", "dim": 4, "optimizer": {"name": "sgd", "lr": NaN}}]',
    "lr-zero": _table(optimizer={"name": "sgd", "lr": 0}),
    "lr-true": _table(optimizer={"name": "sgd", "lr": True}),
    "eps-negative": _table(optimizer={"name": "adagrad", "eps": -1}),
    "beta-one": _table(optimizer={"name": "adam", "beta1": 1.0}),
    "decay-string": _table(optimizer={"name": "sgd", "weight_decay": "x"}),
    "name-long": [{"name": "n" * 10_000, "dim": 4}],
    "name-empty": [{"name": "", "dim": 4}],
    "name-number": [{"name": 7, "dim": 4}],
    "name-control": [{"name": "a\nb", "dim": 4}],
    "names-twice": [{"name": "t", "dim": 4}, {"name": "t", "dim": 8}],
    "init-unknown": _table(init="ones"),
    "init-scale-inf": '[{"name": "t", "dim": 4, "init_scale": -Infinity}]',
    "dtype": _table(dtype="float16"),
    "unknown-key": _table(colour="red"),
    "empty-list": [],
    "object": {"name": "t", "dim": 4},
    "entry-string": ["t"],
    "entry-null": [None],
    "not-json": "[{name: t}]",
    "nested": "[" * 100_000 + "]" * 100_000,
}
TABLE_ERRORS = {
    "no-name": "table: missing setting(s) ['name']",
    "no-dim": "table: missing setting(s) ['dim']",
    "dim-true": "table 't': dim must be a positive int, got True",
    "dim-float": "table 't': dim must be a positive int, got 4.5",
    "dim-string": "table 't': dim must be a positive int, got '4'",
    "dim-zero": "table 't': dim must be a positive int, got 0",
    "dim-negative": "table 't': dim must be a positive int, got -3",
    "optimizer-string": "table 't': optimizer must be a mapping",
    "optimizer-list": "table 't': optimizer must be a mapping",
    "optimizer-unknown": "optimizer 'lamb' is unknown",
    "optimizer-key": "unknown setting(s) ['momentum'] for table 't' optimizer",
    "lr-string": "optimizer lr must be a finite number > 0, got '0.1'",
    "lr-infinity": "optimizer lr must be a finite number > 0, got inf",
    "lr-nan": "optimizer lr must be a finite number > 0, got nan",
    "lr-zero": "optimizer lr must be a finite number > 0, got 0",
    "lr-true": "optimizer lr must be a finite number > 0, got True",
    "eps-negative": "optimizer eps must be a finite number >= 0, got -1",
    "beta-one": "adam beta1 must be a finite number in [0, 1), got 1.0",
    "decay-string": "weight_decay must be a finite number >= 0, got 'x'",
    "name-long": "table name must be a non-empty printable string of at most 256 characters",
    "name-empty": "table name must be a non-empty printable string",
    "name-number": "table name must be a non-empty printable string",
    "name-control": "table name must be a non-empty printable string",
    "names-twice": "table names must be unique",
    "init-unknown": "table 't': init 'ones' is unknown",
    "init-scale-inf": "table 't': init_scale must be a finite number >= 0, got -inf",
    "dtype": "table 't': dtype 'float16' unsupported",
    "unknown-key": "unknown setting(s) ['colour'] for table",
    "empty-list": "lists no table",
    "object": "must hold a JSON list of table mappings, got a dict",
    "entry-string": "a table declaration must be a mapping, got str",
    "entry-null": "a table declaration must be a mapping, got NoneType",
    "not-json": "is not valid JSON",
    "nested": "nests too deeply",
}

#: argv -> (exit status, the first words of the error line after ``error:``). ``{name}`` is a
#: path of :func:`files`.
CASES = [
    # herald serve ps: numbers and cross-checks
    (
        ["serve", "ps", "--shard", "0", "--num-shards", "100000"],
        2,
        "argument --num-shards: must be an integer in 1..64",
    ),
    (["serve", "ps", "--shard", "0", "--num-shards", "0"], 2, "argument --num-shards: must be an integer in 1..64"),
    (["serve", "ps", "--shard", "-1", "--num-shards", "2"], 2, "argument --shard: must be an integer in 0..63"),
    (["serve", "ps", "--shard", "x", "--num-shards", "2"], 2, "argument --shard: must be an integer"),
    (["serve", "ps", "--shard", "3", "--num-shards", "2"], 2, "--shard 3 must be below --num-shards 2"),
    (["serve", "ps", "--shard", "2", "--num-shards", "2"], 2, "--shard 2 must be below --num-shards 2"),
    ([*PS, "--seed", "-1"], 2, "argument --seed: must be an integer in 0.."),
    ([*PS, "--max-dim", "0"], 2, "argument --max-dim: must be an integer in 1.."),
    ([*PS, "--max-keys-per-request", "-5"], 2, "argument --max-keys-per-request: must be an integer in 1.."),
    ([*PS, "--max-contributors", "70000"], 2, "argument --max-contributors: must be an integer in 1..65535"),
    ([*PS, "--max-tables", "100000"], 2, "argument --max-tables: must be an integer in 1..65536"),
    ([*PS, "--max-rows", "-1"], 2, "argument --max-rows: must be an integer in 0.."),
    ([*PS, "--max-shard-bytes", "1e9"], 2, "argument --max-shard-bytes: must be an integer"),
    ([*PS, "--max-shard-bytes", "99999999999999999999"], 2, "argument --max-shard-bytes: must be an integer"),
    ([*PS, "--aggregation-timeout-ms", "0"], 2, "argument --aggregation-timeout-ms: must be an integer in 1.."),
    # herald serve ps: endpoints
    ([*PS, "--bind", "tcp://127.0.0.1:99999"], 2, "argument --bind: 'tcp://127.0.0.1:99999': the port must be"),
    ([*PS, "--bind", "tcp://127.0.0.1:-5"], 2, "argument --bind: 'tcp://127.0.0.1:-5': the port must be"),
    ([*PS, "--bind", "tcp://127.0.0.1:65536"], 2, "argument --bind: 'tcp://127.0.0.1:65536': the port must be"),
    ([*PS, "--bind", "tcp://127.0.0.1"], 2, "argument --bind: 'tcp://127.0.0.1': expected tcp://HOST:PORT"),
    ([*PS, "--bind", "tcp://:5555"], 2, "argument --bind: 'tcp://:5555': expected tcp://HOST:PORT"),
    ([*PS, "--bind", "tcp://a b:5555"], 2, "argument --bind: 'tcp://a b:5555': expected tcp://HOST:PORT"),
    ([*PS, "--bind", "inproc://x"], 2, "argument --bind: 'inproc://x': an inproc:// endpoint lives inside one"),
    ([*PS, "--bind", "ipc:///nonexistent/dir/s.ipc"], 2, "argument --bind: 'ipc:///nonexistent/dir/s.ipc': the folder"),
    ([*PS, "--bind", "ipc://"], 2, "argument --bind: 'ipc://': expected ipc:///PATH"),
    ([*PS, "--bind", "ipc:///tmp/" + "s" * 200], 2, "argument --bind: 'ipc:///tmp/sss"),
    ([*PS, "--bind", "udp://127.0.0.1:5"], 2, "argument --bind: 'udp://127.0.0.1:5': transport udp://"),
    ([*PS, "--bind", "garbage"], 2, "argument --bind: 'garbage' is not an endpoint"),
    ([*PS, "--bind", ""], 2, "argument --bind: must be a ZeroMQ endpoint"),
    ([*PS, "--bind", "tcp://0.0.0.0:5555"], 1, "ps shard 0: tcp://0.0.0.0:5555 is not a loopback endpoint"),
    ([*PS, "--bind", "tcp://*:5555"], 1, "ps shard 0: tcp://*:5555 is not a loopback endpoint"),
    # herald serve ps: paths
    ([*PS, "--checkpoint-root", "/nonexistent"], 1, "--checkpoint-root /nonexistent: no such folder"),
    ([*PS, "--checkpoint-root", "{plain}"], 1, "--checkpoint-root {plain} is a file, not a folder"),
    ([*PS, "--ready-file", "/nonexistent/dir/ready"], 1, "--ready-file /nonexistent/dir/ready: the folder"),
    ([*PS, "--ready-file", "{folder}"], 1, "--ready-file {folder} is a folder, not a file"),
    ([*PS, "--ready-file", "/proc/ready"], 1, "--ready-file /proc/ready: /proc is a kernel file system"),
    ([*PS, "--token-file", "{token}"], 1, "--token-file {token} is not UTF-8 text"),
    ([*PS, "--token-file", "/nonexistent"], 1, "--token-file /nonexistent: no such file"),
    ([*PS, "--token-file", "{fifo}"], 1, "--token-file {fifo} is a FIFO"),
    ([*PS, "--keys", "/nonexistent"], 1, "keys folder /nonexistent has no server.key_secret"),
    ([*PS, "--tables", "{binary}"], 1, "--tables {binary} is not UTF-8 text"),
    ([*PS, "--tables", "/nonexistent.json"], 1, "--tables /nonexistent.json: no such file"),
    ([*PS, "--tables", "{folder}"], 1, "--tables {folder} is a folder"),
    ([*PS, "--tables", "{fifo}"], 1, "--tables {fifo} is a FIFO"),
    ([*PS, "--tables", "/dev/zero"], 1, "--tables /dev/zero is a character device"),
    ([*PS, "--tables", "{wide}", "--max-dim", "4096"], 1, "table 't': dim 5000 exceeds"),
    *[([*PS, "--tables", f"{{tables-{name}}}"], 1, f"--tables {{tables-{name}}}") for name in TABLE_FILES],
    # herald serve worker
    (["serve", "worker", "--dispatcher", "garbage", "--rank", "0", "--world-size", "1"], 2, "argument --dispatcher:"),
    (["serve", "worker", "--dispatcher", "tcp://127.0.0.1:99999"], 2, "argument --dispatcher: 'tcp://127.0.0.1:99999'"),
    (["serve", "worker", "--dispatcher", "tcp://127.0.0.1:*"], 2, "argument --dispatcher: 'tcp://127.0.0.1:*'"),
    (["serve", "worker", "--dispatcher", "tcp://127.0.0.1:0"], 2, "argument --dispatcher: 'tcp://127.0.0.1:0'"),
    (["serve", "worker", "--dispatcher", "inproc://d"], 2, "argument --dispatcher: 'inproc://d': an inproc://"),
    ([*WORKER, "--rank", "-1", "--world-size", "2"], 2, "argument --rank: must be an integer in 0..63"),
    ([*WORKER, "--rank", "0", "--world-size", "0"], 2, "argument --world-size: must be an integer in 1..64"),
    ([*WORKER, "--rank", "0", "--world-size", "-1"], 2, "argument --world-size: must be an integer in 1..64"),
    ([*WORKER, "--rank", "3", "--world-size", "2"], 2, "--rank 3 must be below --world-size 2"),
    ([*WORKER, "--rank", "2", "--world-size", "2"], 2, "--rank 2 must be below --world-size 2"),
    ([*WORKER, "--rank", "0", "--world-size", "100"], 2, "argument --world-size: must be an integer in 1..64"),
    ([*WORKER, "--rank", "0", "--world-size", "1", "--timeout-ms", "0"], 2, "argument --timeout-ms: must be"),
    ([*WORKER, "--rank", "0", "--world-size", "1", "--timeout-ms", "-5"], 2, "argument --timeout-ms: must be"),
    ([*WORKER, "--rank", "0", "--world-size", "1", "--device", "gpu"], 2, "argument --device: must be auto, cpu"),
    ([*WORKER, "--rank", "0", "--world-size", "1", "--cache-device", "x"], 2, "argument --cache-device: invalid"),
    ([*WORKER, "--rank", "0", "--world-size", "1", "--keys", "/nonexistent"], 1, "keys folder /nonexistent has no"),
    # herald serve dispatcher
    (["serve", "dispatcher", "--ps", "garbage"], 1, "--ps 'garbage' is not an endpoint"),
    (["serve", "dispatcher", "--ps", "tcp://127.0.0.1:1,inproc://x"], 1, "--ps 'inproc://x': an inproc://"),
    (["serve", "dispatcher", "--ps", "tcp://127.0.0.1:70000"], 1, "--ps 'tcp://127.0.0.1:70000': the port"),
    (["serve", "dispatcher"], 1, "herald serve dispatcher needs --ps"),
    ([*DISPATCHER, "--bind", "inproc://d"], 2, "argument --bind: 'inproc://d'"),
    ([*DISPATCHER, "--bind", "tcp://127.0.0.1:99999"], 2, "argument --bind: 'tcp://127.0.0.1:99999'"),
    ([*DISPATCHER, "--dispatcher-rank", "256"], 2, "argument --dispatcher-rank: must be an integer in 0..255"),
    ([*DISPATCHER, "--dispatcher-rank", "-1"], 2, "argument --dispatcher-rank: must be an integer in 0..255"),
    ([*DISPATCHER, "--dist-init", "garbage"], 1, "--dist-init 'garbage' is not an endpoint"),
    ([*DISPATCHER, "--sample-id-log", "{folder}"], 1, "--sample-id-log {folder} is a folder"),
    ([*DISPATCHER, "--source", "{fifo}"], 1, "--source {fifo} is a FIFO"),
    ([*DISPATCHER, "--workers", "0"], 1, "--workers must be an integer in 1..64"),
    # herald train
    (["train", "--run-dir", "/dev/null"], 2, "--run-dir /dev/null is a character device, not a folder"),
    (["train", "--run-dir", "{plain}"], 2, "--run-dir {plain} is a file, not a folder"),
    (["train", "--run-dir", "{plain}/below"], 2, "--run-dir {plain}/below: {plain} is a file, not a folder"),
    (["train", "--run-dir", "/proc/herald-run"], 2, "--run-dir /proc/herald-run: /proc is a kernel file system"),
    (["train", "--run-dir", "/proc/self/x/y"], 2, "--run-dir /proc/self/x/y: /proc"),
    (["train", "--run-dir", "/sys/herald"], 2, "--run-dir /sys/herald: /sys is a kernel file system"),
    (["train", "--run-dir", ""], 2, "--run-dir must be a folder path"),
    (["train", "--source", "{fifo}"], 2, "--source {fifo} is a FIFO, which cannot be read to its end"),
    (["train", "--source", "/dev/zero"], 2, "--source /dev/zero is a character device"),
    (["train", "--source", "/nonexistent.parquet"], 2, "--source /nonexistent.parquet: no such file"),
    (["train", "--steps", "99999999999999999999"], 2, "--steps must be an integer >= 1 and at most 2**63 - 1"),
    (["train", "--steps", "0"], 2, "--steps must be an integer >= 1"),
    (["train", "--batch-size", "99999999999999999999"], 2, "--batch-size must be an integer >= 1 and at most"),
    (["train", "--epochs", "0"], 2, "--epochs must be an integer >= 1"),
    (["train", "--workers", "1000"], 2, "--workers must be an integer in 1..64"),
    (["train", "--ps-shards", "100000"], 2, "--ps-shards must be an integer in 1..64"),
    (["train", "--seed", "-1"], 2, "--seed must be an integer in 0.."),
    (["train", "--timeout-ms", "5"], 2, "--timeout-ms must be an integer in 100.."),
    (["train", "--lr", "inf"], 2, "--lr must be a finite number > 0, got inf"),
    (["train", "--lr", "nan"], 2, "--lr must be a finite number > 0, got nan"),
    (["train", "--dense-lr", "-1"], 2, "--dense-lr must be a finite number > 0"),
    (["train", "--cache-ratio", "2"], 2, "--cache-ratio must be a finite number in (0, 1]"),
    (["train", "--eval-fraction", "1"], 2, "--eval-fraction must be a finite number in [0, 1)"),
    (["train", "--embedding-dim", "0"], 2, "--embedding-dim must be an integer in 1..4096"),
    (["train", "--embedding-dim", "true"], 2, "argument --embedding-dim: invalid int value"),
    (["train", "--keys", "/nonexistent"], 2, "keys folder /nonexistent has no server.key_secret"),
    (["train", "--launcher", "ray", "--ray-address", "ray://h:1"], 2, "--ray-address ray://h:1: Ray Client"),
    (["train", "--launcher", "ray", "--ray-address", "127.0.0.1:99999"], 2, "--ray-address '127.0.0.1:99999'"),
    (["train", "--ray-address", "auto"], 2, "--ray-address is a setting of the Ray launcher"),
    # herald keys, datagen, convert, produce
    (["keys", "generate", "{plain}"], 1, "DIR {plain} is a file, not a folder"),
    (["keys", "generate", "/proc/herald-keys"], 1, "DIR /proc/herald-keys: /proc is a kernel file system"),
    (["datagen", "--out", "x.parquet", "--rows", "-1"], 2, "argument --rows: must be an integer in 0.."),
    (["datagen", "--out", "x.parquet", "--rows", "10", "--row-group-rows", "0"], 2, "argument --row-group-rows:"),
    (["datagen", "--out", "/dev/null/x.parquet", "--rows", "10"], 1, "--out /dev/null/x.parquet: the folder"),
    (["datagen", "--out", "/proc/x", "--rows", "10"], 1, "--out /proc/x: /proc is a kernel file system"),
    (["datagen", "--out", "o.parquet", "--rows", "10", "--fit", "{fifo}"], 1, "--fit {fifo} is a FIFO"),
    (["convert", "{fifo}", "o.parquet"], 1, "SRC {fifo} is a FIFO"),
    (["convert", "/nonexistent.tsv", "o.parquet"], 1, "SRC /nonexistent.tsv: no such file"),
    (["convert", "{plain}", "{folder}"], 1, "DST {folder} is a folder, not a file"),
    (["convert", "{plain}", "/nonexistent/o.parquet"], 1, "DST /nonexistent/o.parquet: the folder"),
    (["produce", "{plain}", "--bootstrap", "nohost", "--topic", "t"], 2, "argument --bootstrap: a broker 'nohost'"),
    (["produce", "{plain}", "--bootstrap", "h:99999", "--topic", "t"], 2, "argument --bootstrap: a broker 'h:99999'"),
    (["produce", "{plain}", "--bootstrap", "h:9092", "--topic", "a/b"], 2, "argument --topic: must be 1..249"),
    (["produce", "{plain}", "--bootstrap", "h:9092", "--topic", "t", "--rate", "inf"], 2, "argument --rate:"),
    (["produce", "{plain}", "--bootstrap", "h:9092", "--topic", "t", "--rows-per-message", "0"], 2, "argument"),
    (["produce", "{fifo}", "--bootstrap", "h:9092", "--topic", "t"], 1, "SOURCE {fifo} is a FIFO"),
]


def _fill(text: str, files: dict[str, str]) -> str:
    return re.sub(r"\{([a-z-]+)\}", lambda m: files.get(m.group(1), m.group(0)), text)


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if re.match(r"herald[a-z ]*: error: ", line)]
    assert len(lines) == 1, err
    return lines[0].split(": error: ", 1)[1]


@pytest.mark.parametrize("argv, code, words", CASES, ids=[" ".join(c[0])[:80] for c in CASES])
def test_bad_input_ends_with_one_line_naming_it(argv, code, words, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative outputs (o.parquet) land here
    monkeypatch.delenv("RANK", raising=False)
    argv = [_fill(a, files) for a in argv]
    try:
        got = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        got = exc.code
    err = capsys.readouterr().err
    line = _error_line(err)
    assert got == code, err
    expected = _fill(words, files)
    name = pathlib.Path(argv[-1]).stem.removeprefix("tables-")
    if argv[-2:-1] == ["--tables"] and name in TABLE_ERRORS:
        expected = f"--tables {argv[-1]}"
        assert TABLE_ERRORS[name] in line, line
    assert line.startswith(expected), line
    assert not RAW.search(err), err


def test_every_tables_file_case_has_its_error():
    assert set(TABLE_FILES) == set(TABLE_ERRORS)
    assert len(CASES) >= 100


def _run_all(commands: list[list[str]], env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """Run ``python -m herald ARGV`` for each of ``commands`` at once; each under the hang guard."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "herald", *argv],
            cwd=env["CWD"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in commands
    ]
    out = []
    for argv, p in zip(commands, procs):
        try:
            stdout, stderr = p.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"herald {' '.join(argv)} still ran after {HANG_GUARD_S} s (a hang)")
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


def test_inputs_that_once_hung_end_naming_what_is_missing(files, tmp_path):
    """A worker with no dispatcher there, a FIFO as the source, a Ray address nobody
    listens at: each once waited without end."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CWD": str(tmp_path)}
    env.pop("RANK", None)
    cases = [
        (
            ["serve", "worker", "--dispatcher", "tcp://127.0.0.1:1", "--rank", "0", "--world-size", "1",
             "--timeout-ms", "500"],
            1,
            "no dispatcher listens at --dispatcher tcp://127.0.0.1:1 (waited 500 ms)",
        ),
        (
            ["serve", "worker", "--dispatcher", f"ipc://{files['root']}/none.ipc", "--rank", "1", "--world-size",
             "2", "--timeout-ms", "500"],
            1,
            f"no dispatcher listens at --dispatcher ipc://{files['root']}/none.ipc",
        ),
        (["train", "--source", files["fifo"]], 2, f"--source {files['fifo']} is a FIFO"),
        (
            ["train", "--launcher", "ray", "--ray-address", "127.0.0.1:1"],
            2,
            "--ray-address 127.0.0.1:1: nothing listens there",
        ),
    ]  # fmt: skip
    results = _run_all([argv for argv, _, _ in cases], env)
    for (argv, code, words), result in zip(cases, results):
        assert result.returncode == code, (argv, result.stderr)
        assert _error_line(result.stderr).startswith(words), result.stderr
        assert not RAW.search(result.stderr), result.stderr


def test_a_source_shorter_than_one_global_batch_is_named_before_any_process(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "small.parquet"
    assert cli.main(["datagen", "--out", str(source), "--rows", "40", "--quiet"]) == 0
    argv = ["train", "--source", str(source), "--workers", "2", "--batch-size", "32", "--run-dir", str(tmp_path / "r")]
    assert cli.main(argv) == 1
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"--source {source}: its training split has 36 rows, fewer than one global batch"), line
    assert "--workers 2 x --batch-size 32 = 64" in line


def test_produce_to_a_port_that_is_not_kafka_names_the_broker(tmp_path):
    """A port that accepts connections but never answers as Kafka (a listening socket that
    never reads): the producer's bootstrap gives up within its timeout and says so."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        bootstrap = f"127.0.0.1:{listener.getsockname()[1]}"
        argv = ["produce", "--bootstrap", bootstrap, "--topic", "t", "--limit", "10", "--no-progress",
                "--client-option", "bootstrap_timeout_ms=1000", "synthetic://criteo?rows=10"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "CWD": str(tmp_path)}
        (result,) = _run_all([argv], env)
    assert result.returncode == 1, result.stderr
    assert _error_line(result.stderr).startswith(f"no Kafka broker answered at {bootstrap}"), result.stderr
    assert not RAW.search(result.stderr), result.stderr
