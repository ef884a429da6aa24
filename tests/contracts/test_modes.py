"""The consistency-mode registries (herald/contracts/modes.py and each role's; docs/consistency.md,
"Adding a mode"): one entry per vocabulary mode, settings validated and checked through one seam."""

import dataclasses
import subprocess
import sys
import types

import pytest
import torch

from herald.config import from_flags
from herald.contracts.consistency import ModeContext, ModeSettings
from herald.contracts.job import JobSpec
from herald.contracts.modes import (
    MODES,
    BoundedSettings,
    BspSettings,
    ConsistencyMode,
    GbaSettings,
    HybridSettings,
    check_mode,
    consistency_mode,
    mode_from_dict,
)
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.contracts.vocab import CONSISTENCY_MODES
from herald.dispatch.embedding_worker import no_embedding_worker
from herald.dispatch.modes import DISPATCH, dispatch_mode
from herald.errors import ConfigError
from herald.job.report import consistency_block
from herald.ps import wire
from herald.ps.modes import OP_SETS, OpSet
from herald.ps.server import ShardServer
from herald.worker.consistency_bounded import Bounded
from herald.worker.consistency_gba import GBA
from herald.worker.modes import PROTOCOLS, job_protocol
from herald.worker.protocol import ConsistencyProtocol

TABLE = TableConfig(name="t0", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1))
SETTINGS = {"bsp": BspSettings(), "bounded": BoundedSettings(3), "hybrid": HybridSettings(5), "gba": GbaSettings(4, 2)}


def _job(settings: ModeSettings) -> JobSpec:
    return JobSpec(tables=(TABLE,), dense_dim=0, ps=("tcp://127.0.0.1:1",), mode=settings)


def _executor() -> types.SimpleNamespace:
    """What the protocols' constructors read of a PlanExecutor."""
    return types.SimpleNamespace(cache=types.SimpleNamespace(capacity_rows=4), device=torch.device("cpu"), world_size=1)


def test_every_registry_has_exactly_the_vocabulary_modes():
    assert tuple(MODES) == CONSISTENCY_MODES
    assert all(isinstance(m, ConsistencyMode) and m.name == name == m.settings.name for name, m in MODES.items())
    assert tuple(PROTOCOLS) == CONSISTENCY_MODES
    assert all(issubclass(cls, ConsistencyProtocol) and cls.name == name for name, cls in PROTOCOLS.items())
    assert tuple(DISPATCH) == CONSISTENCY_MODES
    assert all(callable(d.serve) and callable(d.embedding_worker) for d in DISPATCH.values())
    assert tuple(OP_SETS) == CONSISTENCY_MODES
    assert all(sets and all(isinstance(s, OpSet) for s in sets) for sets in OP_SETS.values())
    assert tuple(SETTINGS) == CONSISTENCY_MODES


def test_the_shard_serves_every_modes_op_sets_and_the_admin_ops_every_op_once():
    server = ShardServer(0, 1)
    served = {op: type(handler) for op, (handler, _) in server.loop.ops.items()}
    assert set(served) == set(wire.OPS)
    for sets in OP_SETS.values():
        for s in sets:
            handler = getattr(server.op_sets, s.name)
            assert set(handler.ops()) == s.ops and all(served[op] is type(handler) for op in s.ops)
    admin = set(wire.OPS) - {op for sets in OP_SETS.values() for s in sets for op in s.ops}
    assert set(server.admin_ops.ops()) == admin


@pytest.mark.parametrize("name", CONSISTENCY_MODES)
def test_each_mode_settings_reach_its_protocol_and_round_trip(name):
    settings = SETTINGS[name]
    assert type(settings) is consistency_mode(name).settings
    protocol = job_protocol(_job(settings), _executor())
    assert type(protocol) is PROTOCOLS[name] and protocol.name == name
    assert mode_from_dict(settings.to_dict()) == settings
    assert JobSpec.from_dict(_job(settings).to_dict()).mode == settings
    cfg = TrainConfig.from_flags(consistency=name, **settings.flags())
    assert cfg.mode == settings and cfg.consistency == name
    assert TrainConfig.from_flags(cfg.flags()) == cfg


def test_protocols_take_their_settings():
    bounded = job_protocol(_job(BoundedSettings(3)), _executor())
    assert isinstance(bounded, Bounded) and bounded.staleness == 3
    gba = job_protocol(_job(GbaSettings(4, 2)), _executor())
    assert isinstance(gba, GBA) and (gba.m, gba.iota) == (4, 2)


def test_only_hybrid_runs_one_dispatcher_per_group_and_no_plan():
    assert [n for n, m in MODES.items() if m.independent_groups] == ["hybrid"]
    assert [n for n, m in MODES.items() if not m.planned_transmissions] == ["hybrid"]
    assert [n for n, m in MODES.items() if m.embedding_worker] == ["hybrid"]
    assert [n for n, d in DISPATCH.items() if d.embedding_worker is not no_embedding_worker] == ["hybrid"]
    assert [n for n, s in SETTINGS.items() if s.reads_early] == ["bounded"]
    assert not BoundedSettings(0).reads_early


def test_unknown_mode_is_a_config_error_naming_the_known_ones():
    for bad in ("eventual", "", None):
        with pytest.raises(ConfigError, match="unknown consistency mode") as info:
            consistency_mode(bad)
        assert all(name in str(info.value) for name in CONSISTENCY_MODES)
    with pytest.raises(ConfigError, match="bsp, bounded, hybrid, gba"):
        dispatch_mode("eventual")
    with pytest.raises(ConfigError, match="unknown setting"):
        mode_from_dict({"name": "bounded", "bound": 2})
    with pytest.raises(ConfigError, match="unknown consistency mode"):
        mode_from_dict({"staleness": 2})


def test_settings_go_through_one_check_against_the_job():
    @dataclasses.dataclass(frozen=True)
    class Impostor(ModeSettings):
        name = "bsp"

    with pytest.raises(ConfigError, match="takes a BspSettings, got Impostor"):
        check_mode(Impostor(), ModeContext())
    with pytest.raises(ConfigError, match="its settings class is 'bsp'"):
        ConsistencyMode(name="gba", settings=BspSettings)
    with pytest.raises(ConfigError, match="drop --replicate-below"):
        check_mode(HybridSettings(), ModeContext(replicated=True))
    with pytest.raises(ConfigError, match="must divide the global batch of 6"):
        check_mode(GbaSettings(), ModeContext(workers=4, global_batch=6))
    with pytest.raises(ConfigError, match="does not support --groups"):
        check_mode(GbaSettings(), ModeContext(groups=2))
    check_mode(GbaSettings(3), ModeContext(workers=2, global_batch=6, resume=True, checkpoint_every=5))
    with pytest.raises(ConfigError, match="--replicate-below"):
        _job(HybridSettings()).replace(replicated_tables=(0,))
    assert GbaSettings().for_job(ModeContext(workers=3)) == GbaSettings(3)
    assert BoundedSettings(2).for_job(ModeContext(workers=3)) == BoundedSettings(2)


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"consistency": "bsp", "staleness": 2}, "--staleness 2 bounds the reads of --consistency bounded"),
        ({"consistency": "gba", "hybrid_expiry": 0}, "--hybrid-expiry drops the expired gradients"),
        ({"consistency": "bounded", "gba_threshold": 1}, "--gba-buffer and --gba-threshold set GBA's"),
        ({"consistency": "hybrid", "gba_buffer": -1}, "--gba-buffer must be an integer in 0..4096"),
        ({"consistency": "bsp", "hybrid_expiry": "x"}, "--hybrid-expiry must be an integer"),
    ],
)
def test_a_mode_option_given_to_another_mode_is_refused_naming_it(flags, words):
    with pytest.raises(ConfigError, match="no meaning for --consistency|must be an integer") as info:
        from_flags(TrainConfig, flags)
    assert words in str(info.value)


def test_report_blocks_keep_their_settings_and_fields():
    def cfg(mode, **kw):
        return TrainConfig.from_flags(consistency=mode, slow_worker="1:5", workers=2, **kw)

    assert consistency_block(cfg("bsp"), [])["settings"] == {"slow_worker": "1:5"}
    bounded = consistency_block(cfg("bounded", staleness=3), [])
    assert list(bounded["settings"].items()) == [("staleness", 3), ("slow_worker", "1:5")]
    gba = consistency_block(cfg("gba", gba_threshold=1), [])
    assert gba["settings"] == {"gba_buffer": 2, "gba_threshold": 1, "slow_worker": "1:5"}
    hybrid = consistency_block(cfg("hybrid"), [])
    assert hybrid["staleness_unit"] == "steps" and hybrid["gradient_rows_pushed"] == 0
    assert hybrid["settings"]["hybrid_expiry"] is None
    for name in CONSISTENCY_MODES:
        assert consistency_block(cfg(name), [])["mode"] == name
    assert consistency_block(types.SimpleNamespace(), [])["mode"] == "bsp"  # a config without the field


def test_the_registry_loads_nothing_heavy():
    code = (
        "import sys, herald.contracts.modes; heavy = {'torch', 'numba', 'zmq'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_mode_name_is_compared_outside_the_contracts():
    """A mode's behaviour comes from its registry entries and settings, never from comparing
    its name (docs/consistency.md, "Adding a mode"): no ``== "gba"``, ``in ("bsp", ...)``."""
    import pathlib
    import re

    name = "|".join(CONSISTENCY_MODES)
    compared = re.compile(
        rf"""(==|!=|\bin|\bis)\s*[(\[{{]?\s*["']({name})["']|["']({name})["']\s*(==|!=|\bin\b|\bnot in\b)"""
    )
    root = pathlib.Path(__file__).resolve().parents[2] / "herald"
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if "contracts" not in path.relative_to(root).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert not found, found
