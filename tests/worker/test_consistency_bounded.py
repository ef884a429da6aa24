"""NOTE [bounded reads]: HET's CheckValid and the key-set membership it relies on."""

import numpy as np

from herald.scheduler.plan import KeySet
from herald.worker.consistency_bounded import check_valid, member
from herald.worker.protocol import registered


def _u(*v):
    return np.array(v, np.uint64)


def test_check_valid_is_hets_two_conditions():
    # c_s, c_c, c_g; s = 2
    c_s, c_c, c_g = _u(5, 5, 5, 5, 5), _u(5, 7, 8, 5, 5), _u(5, 7, 8, 7, 8)
    assert check_valid(c_s, c_c, c_g, 2).tolist() == [True, True, False, True, False]
    # s = 0: only a copy as recent as the PS (and without unsynchronised local updates)
    assert check_valid(c_s, c_c, c_g, 0).tolist() == [True, False, False, False, False]


def test_member_matches_table_and_id():
    keys = KeySet(np.array([0, 1, 1, 2], np.int32), _u(7, 7, 9, 7))
    of = KeySet(np.array([1, 2, 0], np.int32), _u(7, 8, 9))
    assert member(keys, of).tolist() == [False, True, False, False]
    assert member(keys, KeySet.empty()).tolist() == [False] * 4


def test_bounded_is_registered():
    assert set(registered()) >= {"bsp", "bounded"}
