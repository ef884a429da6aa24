"""Tables of different widths through one client (NOTE [mixed widths] in herald/ps/router.py):
flat operations and step messages take and give rows padded to the widest table, and send
one flat part per table shape; over real shards they equal the per-table operations."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError
from herald.ps import LocalShards, PSClient

TABLES = [
    TableConfig("small", 4, OptimizerConfig("sgd", lr=0.1)),
    TableConfig("mid", 8, OptimizerConfig("adagrad", lr=0.1)),
    TableConfig("wide", 16, OptimizerConfig("rowwise_adagrad", lr=0.1)),
]
DIM = max(t.dim for t in TABLES)
WIDTH = max(t.row_width for t in TABLES)


def _padded(per_table: dict, tabs: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The padded rows of ``(tabs, keys)`` from per-table pulls ``{t: rows in order of keys[tabs == t]}``."""
    out = np.zeros((keys.shape[0], WIDTH), np.float32)
    for t, rows in per_table.items():
        out[tabs == t, : TABLES[t].row_width] = rows
    return out


def _split(tabs, keys, values, width_of):
    """``{t: (keys, values[:, :width_of(t)])}`` of padded ``values``."""
    return {
        t: (keys[tabs == t], np.ascontiguousarray(values[tabs == t, : width_of(t)])) for t in np.unique(tabs).tolist()
    }


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_steps_of_two_clients_equal_per_table_operations(wire):
    rng = np.random.default_rng(0)
    keys = np.arange(1, 300, dtype=np.uint64) * 7919
    tabs = (keys % 3).astype(np.uint16)
    with LocalShards(num_shards=2, tables=TABLES, seed=2) as a, LocalShards(num_shards=2, tables=TABLES, seed=2) as b:
        clients = [PSClient(a.addresses, TABLES, timeout_ms=20_000, wire_dtype=wire) for _ in range(2)]
        ref = PSClient(b.addresses, TABLES, timeout_ms=20_000, wire_dtype=wire)
        for c in clients:
            c.max_keys_per_request = 50  # pushes ahead of the message and late pulls too
        try:
            for step in range(3):
                grads = [rng.standard_normal((keys.shape[0], DIM)).astype(np.float32) for _ in range(2)]
                contrib = np.full(keys.shape[0], 2, np.uint16)
                own = [keys[:120] + np.uint64(1 + r) for r in range(2)]
                rows = [np.abs(rng.standard_normal((120, WIDTH))).astype(np.float32) for _ in range(2)]
                pulls = [keys[::2] if r == 0 else np.concatenate([keys[1::2], own[0][:5]]) for r in range(2)]
                out = [None, None]

                def run(r):
                    out[r] = np.array(
                        clients[r]
                        .step_async(
                            step,
                            r,
                            2,
                            rows=(tabs[:120], own[r], rows[r]),
                            grads=(tabs, keys, grads[r], contrib),
                            pull=((pulls[r] % 3).astype(np.uint16), pulls[r]),
                        )
                        .wait()
                    )

                threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                for r in range(2):  # the reference: per-table requests at each table's own width
                    g = _split(tabs, keys, grads[r], lambda t: TABLES[t].dim)
                    ref.push_grad_async({t: (k, v, contrib[: k.shape[0]]) for t, (k, v) in g.items()}, step, r).wait()
                    ref.push_rows_async(_split(tabs[:120], own[r], rows[r], lambda t: TABLES[t].row_width)).wait()
                for r in range(2):
                    pt = (pulls[r] % 3).astype(np.uint16)
                    got = ref.pull_async({t: pulls[r][pt == t] for t in range(3)}).wait()
                    want = _padded(got, pt, pulls[r])
                    assert out[r].shape == (pulls[r].shape[0], WIDTH)
                    np.testing.assert_array_equal(out[r], want, err_msg=f"step {step} rank {r}")
        finally:
            for c in clients + [ref]:
                c.close()


def test_flat_and_clocked_operations_pad_and_refuse_unpadded_arrays():
    keys = np.arange(1, 40, dtype=np.uint64)
    tabs = (keys % 3).astype(np.uint16)
    with LocalShards(num_shards=2, tables=TABLES, seed=5) as shards, PSClient(shards.addresses, TABLES) as client:
        rows = np.zeros((keys.shape[0], WIDTH), np.float32)
        for t in range(3):
            rows[tabs == t, : TABLES[t].row_width] = t + 1
        client.push_rows_flat_async(tabs, keys, rows).wait()
        np.testing.assert_array_equal(client.pull_flat_async(tabs, keys).wait(), rows)  # zeros beyond each width
        per = client.pull_async({t: keys[tabs == t] for t in range(3)}).wait()
        assert all(per[t].shape == (int((tabs == t).sum()), TABLES[t].row_width) for t in range(3))
        one = tabs == 2  # keys of one shape only, padded all the same
        np.testing.assert_array_equal(client.pull_flat_async(tabs[one], keys[one]).wait(), rows[one])
        handle, _ = client.push_rows_clocked_flat_async(tabs, keys, rows * 2, np.ones(keys.shape[0], np.uint64), True)
        c_g, _ = handle.wait()
        assert c_g.tolist() == [1] * keys.shape[0]
        handle, _ = client.pull_clocked_flat_async(tabs, keys, np.ones(keys.shape[0], bool), c_g, 0)
        cg, fetched, _, _ = handle.wait()
        assert not fetched.any() and cg.tolist() == c_g.tolist()  # every copy valid: nothing sent
        handle, _ = client.pull_clocked_flat_async(tabs, keys, np.zeros(keys.shape[0], bool), c_g, 0)
        _, fetched, got, _ = handle.wait()
        assert fetched.all()
        np.testing.assert_array_equal(got, rows * 2)
        with pytest.raises(ConfigError, match="padded to the widest"):
            client.push_rows_flat_async(tabs, keys, rows[:, :4])
        with pytest.raises(ConfigError, match="padded to the widest"):
            client.push_grad_flat_async(
                tabs, keys, np.zeros((keys.shape[0], 4), np.float32), np.ones(39, np.uint16), 0, 0
            )
