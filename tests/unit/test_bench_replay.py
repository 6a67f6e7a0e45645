"""`bench replay`'s verdicts on given figures: the speed target follows what bounds the replay."""

from __future__ import annotations

import pytest

from benchmarks.replay import BANDWIDTH_TARGET, CEILING_TARGET, ceiling_target, check_targets


def row(fused: float, limit: float, generator: float, dtype: str = "fp32", eager: float = 1.0) -> dict:
    return {"dtype": dtype, "optimizer": "zo-sgd", "perturbation": "gaussian", "fused_step_seconds": fused,
            "bandwidth_limit_seconds": limit, "generator_seconds": generator, "speedup_over_eager": eager / fused}


def test_generator_bound_replay_within_80_percent_of_the_generator_meets_the_target():
    # this machine's shape: the generator alone (30 ms) costs more than one read and one write (8 ms)
    verdict = ceiling_target(row(fused=36e-3, limit=8e-3, generator=30e-3))
    assert verdict["bound"] == "generator" and verdict["met"]
    assert f"{CEILING_TARGET:.0%} of the generator-bound ceiling" in verdict["target"]
    assert "retired" in verdict["target"]
    # both fractions are reported: 8/36 of the limit, 30/36 of the ceiling, the generator allows 8/30
    assert verdict["measured"] == ("22% of the bandwidth limit, 83% of the ceiling "
                                   "(the generator alone allows 27% of the limit)")


def test_generator_bound_replay_slower_than_80_percent_of_the_generator_misses():
    verdict = ceiling_target(row(fused=40e-3, limit=8e-3, generator=30e-3))  # 75% of the ceiling
    assert verdict["bound"] == "generator" and not verdict["met"]
    assert "75% of the ceiling" in verdict["measured"]


def test_exactly_80_percent_of_the_ceiling_meets_it():
    assert ceiling_target(row(fused=10.0, limit=1.0, generator=8.0))["met"]


def test_memory_bound_replay_keeps_the_50_percent_bandwidth_target():
    # a fast generator: memory traffic (10 ms) is the ceiling
    met = ceiling_target(row(fused=18e-3, limit=10e-3, generator=4e-3))
    assert met["bound"] == "memory" and met["met"]
    assert f"{BANDWIDTH_TARGET:.0%} of the bandwidth limit (memory-bound)" in met["target"]
    assert "56% of the bandwidth limit, 56% of the ceiling" in met["measured"]
    missed = ceiling_target(row(fused=25e-3, limit=10e-3, generator=4e-3))  # 40% of the limit
    assert missed["bound"] == "memory" and not missed["met"]


def test_targets_keep_20x_eager_and_judge_only_fp32_against_the_ceiling():
    rows = [row(fused=36e-3, limit=8e-3, generator=30e-3, eager=0.9),  # 25x eager, generator-bound, met
            row(fused=50e-3, limit=4e-3, generator=30e-3, dtype="bf16", eager=0.5)]  # 10x eager
    targets = check_targets(rows, {"fp32": 1.2})
    by_name = {t["target"]: t for t in targets}
    assert by_name["fp32 zo-sgd gaussian: fused >= 20x eager"]["met"]
    assert not by_name["bf16 zo-sgd gaussian: fused >= 20x eager"]["met"]
    assert [t["bound"] for t in targets if "bound" in t] == ["generator"]  # bf16 is not judged on bandwidth
    assert by_name["fp32: zo-adam within 2.5x of zo-sgd"]["met"]


@pytest.mark.parametrize("limit, generator", [(8e-3, 30e-3), (10e-3, 4e-3)])
def test_the_ceiling_is_the_slower_of_memory_traffic_and_generator(limit, generator):
    verdict = ceiling_target(row(fused=max(limit, generator), limit=limit, generator=generator))
    assert verdict["met"] and "100% of the ceiling" in verdict["measured"]
