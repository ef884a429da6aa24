"""The consistency-mode registry (herald/contracts/modes.py; docs/consistency.md, "Adding a mode"):
one entry per vocabulary mode, whose entry points resolve to what each role runs."""

import inspect
import subprocess
import sys
import types

import pytest

from herald.contracts import consistency as checks
from herald.contracts.job import JobSpec
from herald.contracts.modes import MODES, ConsistencyMode, consistency_mode, resolve
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.contracts.vocab import CONSISTENCY_MODES
from herald.errors import ConfigError
from herald.job.report import consistency_block
from herald.ps.wire import OPS
from herald.worker.protocol import ConsistencyProtocol, make_protocol

TABLE = TableConfig(name="t0", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1))


def _job(mode: str, **settings) -> JobSpec:
    return JobSpec(tables=(TABLE,), dense_dim=0, ps=("tcp://127.0.0.1:1",), consistency=mode, **settings)


def test_every_vocabulary_mode_has_one_entry_in_order():
    assert tuple(MODES) == CONSISTENCY_MODES
    assert all(isinstance(m, ConsistencyMode) and m.name == name for name, m in MODES.items())


@pytest.mark.parametrize("name", CONSISTENCY_MODES)
def test_every_entry_point_resolves(name):
    mode = consistency_mode(name)
    protocol = mode.resolve("protocol")
    assert inspect.isclass(protocol) and issubclass(protocol, ConsistencyProtocol) and protocol.name == name
    assert callable(mode.resolve("serve")) and callable(mode.resolve("report"))
    assert mode.embedding_worker is None or callable(mode.resolve("embedding_worker"))
    assert mode.ps_ops and set(mode.ps_ops) <= set(OPS)
    assert mode.settings_check is None or getattr(checks, mode.settings_check.__name__) is mode.settings_check
    assert set(mode.flags) <= set(TrainConfig.__dataclass_fields__)


@pytest.mark.parametrize(
    "name, settings, expected",
    [
        ("bsp", {}, {}),
        ("bounded", {"staleness": 3}, {"staleness": 3}),
        ("hybrid", {"hybrid_expiry_steps": 5}, {}),
        ("gba", {"gba_buffer": 4, "gba_threshold": 2}, {"gba_buffer": 4, "gba_threshold": 2}),
    ],
)
def test_protocol_settings_come_from_the_job_and_fit_the_protocol(name, settings, expected):
    mode = consistency_mode(name)
    got = mode.protocol_settings(_job(name, **settings))
    assert got == expected
    inspect.signature(mode.resolve("protocol")).bind(object(), **got)  # the executor, then the settings


def test_only_hybrid_runs_one_dispatcher_per_group_and_no_plan():
    assert [n for n, m in MODES.items() if m.independent_groups] == ["hybrid"]
    assert [n for n, m in MODES.items() if not m.planned_transmissions] == ["hybrid"]
    assert [n for n, m in MODES.items() if m.embedding_worker] == ["hybrid"]


def test_unknown_mode_is_a_config_error_naming_the_known_ones():
    for bad in ("eventual", "", None):
        with pytest.raises(ConfigError, match="unknown consistency mode") as info:
            consistency_mode(bad)
        assert all(name in str(info.value) for name in CONSISTENCY_MODES)
    with pytest.raises(ConfigError, match="bsp, bounded, hybrid, gba"):
        make_protocol("eventual", executor=None)


def test_resolve_names_a_bad_entry_point():
    assert resolve("herald.contracts.modes:ConsistencyMode.resolve") is ConsistencyMode.resolve
    for ref, words in (
        ("herald.contracts.modes", "malformed"),
        ("herald.no_such_module:x", "no module"),
        ("herald.contracts.modes:no_such_name", "no attribute"),
    ):
        with pytest.raises(ConfigError, match=words):
            resolve(ref)
    broken = ConsistencyMode.__new__(ConsistencyMode)  # an entry whose reference went stale
    object.__setattr__(broken, "name", "stale")
    object.__setattr__(broken, "serve", "herald.dispatch.dispatcher:no_such_strategy")
    with pytest.raises(ConfigError, match="'stale', serve"):
        broken.resolve("serve")
    with pytest.raises(ConfigError, match="not one of its entry points"):
        consistency_mode("bsp").resolve("ps_ops")
    with pytest.raises(ConfigError, match="not an entry point"):
        ConsistencyMode(name="x", protocol="herald.worker.protocol.BSP", serve="a:b", report="a:b", ps_ops=("pull",))


def test_report_blocks_keep_their_settings_and_fields():
    def cfg(mode, **kw):
        return types.SimpleNamespace(
            consistency=mode,
            slow_worker="1:5",
            staleness=3,
            gba_buffer=0,
            workers=2,
            gba_threshold=1,
            max_inflight_steps=2,
            hybrid_expiry=None,
            **kw,
        )

    assert consistency_block(cfg("bsp"), [])["settings"] == {"slow_worker": "1:5"}
    assert list(consistency_block(cfg("bounded"), [])["settings"].items()) == [("staleness", 3), ("slow_worker", "1:5")]
    assert consistency_block(cfg("gba"), [])["settings"] == {"gba_buffer": 2, "gba_threshold": 1, "slow_worker": "1:5"}
    hybrid = consistency_block(cfg("hybrid"), [])
    assert hybrid["staleness_unit"] == "steps" and hybrid["gradient_rows_pushed"] == 0
    for name in CONSISTENCY_MODES:
        assert consistency_block(cfg(name), [])["mode"] == name
    assert consistency_block(types.SimpleNamespace(), [])["mode"] == "bsp"  # a config without the field


def test_the_registry_loads_nothing_heavy():
    code = (
        "import sys, herald.contracts.modes; heavy = {'torch', 'numba', 'zmq'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
