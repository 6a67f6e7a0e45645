"""Shards and elastic groups, without Ray: who holds which shard, how the survivors deal a lost rank's, and how
a rank that lags one exchange behind catches up."""

import pytest

from zocheck_ray.runtime.parallel.elastic import catch_up, deal, exchange_number, standing
from zocheck_ray.runtime.parallel.shards import assign, decode, encode, merge, missing, reduce_in_shard_order


def test_each_rank_holds_a_contiguous_block_and_s_equal_to_k_is_todays_layout():
    assert assign(6, 1) == [(0, 1, 2, 3, 4, 5)]
    assert assign(6, 2) == [(0, 1, 2), (3, 4, 5)]
    assert assign(6, 4) == [(0,), (1, 2), (3,), (4, 5)]
    assert assign(3, 3) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="2 ranks cannot share 1 shards"):
        assign(1, 2)


def test_the_losses_are_added_in_shard_order_whoever_evaluated_them():
    pairs = [(0.1, 1.0), (1e16, 1.0), (-1e16, 1.0), (0.3, 1.0)]  # float64 addition is not associative
    by_rank = [[pairs[0], None, None, pairs[3]], [None, pairs[1], pairs[2], None]]
    merged = merge([decode(encode(table)) for table in by_rank])
    assert merged == pairs and missing(merged) == []
    expected = (((0.1 + 1e16) + -1e16) + 0.3) / 4.0
    assert reduce_in_shard_order(merged, merged) == (expected, expected)
    with pytest.raises(ValueError, match=r"shards \[1, 2\] were not evaluated"):
        reduce_in_shard_order(by_rank[0], merged)


def test_the_survivors_keep_their_shards_and_take_the_lost_ones_in_turn():
    assert deal([(0, 1), (2, 3), (4, 5)], [1]) == [(0, 1, 2), (3, 4, 5)]
    assert deal([(0, 1, 2), (3, 4, 5)], [0]) == [(0, 1, 2, 3, 4, 5)]
    assert deal([(0,), (1,), (2,), (3,)], [0, 2]) == [(0, 1), (2, 3)]


def test_a_laggard_adopts_the_table_a_survivor_completed():
    table = [(1.0, 2.0), (3.0, 2.0)]
    ahead = standing(exchange_number(5, 1), True, (exchange_number(5, 0), table), 2)
    behind = standing(exchange_number(5, 0), True, (exchange_number(4, 1), table), 2)
    assert catch_up([ahead, behind], exchange_number(5, 0)) == table
    assert catch_up([ahead, behind], exchange_number(5, 1)) is None  # the one ahead evaluates and repeats
    level = standing(exchange_number(5, 0), True, None, 2)
    assert catch_up([level, level], exchange_number(5, 0)) is None
