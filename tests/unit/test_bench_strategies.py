"""The checkpointing strategies of the benchmarks, without Ray: what each writes, what each
recovers from, and that every one of them trains and recovers the same bits."""

import pytest

from benchmarks.baselines import Strategy, StrategyTrainer, paper_strategies
from benchmarks.common import bench_job
from benchmarks.overhead_strategies import lowest_at_every_k, size_ratio
from benchmarks.recovery_comparison import fit_line
from zocheck_ray.storage import SnapshotStore, read_log


def _job(tmp_path, name):
    return bench_job(model="tiny-opt", steps=20, storage=str(tmp_path), run_id=f"strategies-{name}",
                     shadow={"snapshot_interval": 4})


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    trainer = StrategyTrainer(_job(tmp, "zocheck"), str(tmp / "z"), Strategy("zocheck"))
    trainer.run(10)
    trainer.close()
    return trainer.state_hash()


@pytest.mark.parametrize("strategy, image_step", [("log-only", 0), ("sync:3", 9), ("async:3", 9)])
def test_a_restarted_baseline_replays_its_log_from_its_newest_checkpoint(tmp_path, reference_hash, strategy,
                                                                       image_step):
    s = Strategy.parse(strategy)
    url = str(tmp_path / s.slug)
    first = StrategyTrainer(_job(tmp_path, s.slug), url, s)
    first.run(10)
    first.close()  # closing waits for the async write, so its checkpoint of step 9 is committed
    assert [r.step for r in read_log(url, after_step=-1)] == list(range(10))
    assert SnapshotStore(url).latest().step == image_step
    again = StrategyTrainer(_job(tmp_path, s.slug), url, s)
    assert again.recovery["image_step"] == image_step
    assert again.recovery["replayed_records"] == 10 - image_step
    assert again.state_hash() == first.state_hash() == reference_hash
    again.run(12)  # the log continues after the recovered step
    again.close()
    assert [r.step for r in read_log(url, after_step=-1)] == list(range(12))


def test_checkpoints_are_counted_on_the_training_thread_only_for_checkpointing_strategies(tmp_path):
    costs = {}
    for s in (Strategy("log-only"), Strategy("sync", 3), Strategy("async", 3)):
        trainer = StrategyTrainer(_job(tmp_path, s.slug), str(tmp_path / s.slug), s)
        trainer.run(7)
        trainer.close()
        costs[s.name] = trainer.critical_path()
    assert costs["log-only"]["checkpoints"] == 0 and costs["log-only"]["checkpoint_seconds"] == 0
    for name in ("sync K=3", "async K=3"):
        assert costs[name]["checkpoints"] == 2 and costs[name]["checkpoints_persisted"] == 2
        assert costs[name]["checkpoint_seconds"] > 0
    for path in costs.values():
        assert path["steps"] == 7 and path["publish_seconds"] > 0
        assert path["cumulative_seconds"] == pytest.approx(path["publish_seconds"] + path["checkpoint_seconds"])


def test_strategy_names_parse_and_bad_ones_are_refused():
    assert [s.name for s in paper_strategies()] == [
        "log-only", "sync K=7", "sync K=300", "sync K=1000", "async K=7", "async K=300", "async K=1000", "zocheck"]
    assert Strategy.parse("async K=7") == Strategy.parse("async:7") == Strategy.parse("async-7") == Strategy("async", 7)
    for bad in ("sync", "log-only:3", "async:0", "checkfreq:7"):
        with pytest.raises(ValueError, match="strategy"):
            Strategy.parse(bad)


def test_the_lowest_cost_check_compares_zocheck_with_each_checkpointing_strategy_at_each_k():
    rows = [{"strategy": "zocheck", "cumulative_seconds": 0.001}, {"strategy": "log-only", "cumulative_seconds": 0.002},
            {"strategy": "sync K=7", "cumulative_seconds": 0.5}, {"strategy": "async K=7", "cumulative_seconds": 0.0005}]
    lowest = lowest_at_every_k(rows, (7,))
    assert not lowest["met"] and lowest["by_k"]["7"]["others"] == {"sync K=7": 0.5, "async K=7": 0.0005}
    assert lowest["log_only_over_zocheck"] == pytest.approx(2.0)
    rows[3]["cumulative_seconds"] = 0.05
    assert lowest_at_every_k(rows, (7,))["met"]


def test_the_size_ratio_is_one_plus_the_staging_copy_over_k_appends_and_is_fitted_linearly():
    rows = [{"params": p, "dtype": "fp32", "publish_us_median": 2.0, "steps": 3, "staging_copy_ms": p / 1e6}
            for p in (10_000_000, 100_000_000, 400_000_000)]
    ratio = size_ratio(rows, every=1000)
    assert [s["params"] for s in ratio["sizes"]] == [100_000_000, 400_000_000]  # from 100M on
    assert [s["ratio"] for s in ratio["sizes"]] == [pytest.approx(51.0), pytest.approx(201.0)]
    assert ratio["projected_ratio"] == pytest.approx(1 + 8e9 / 1e6 * 1e3 / 2000) and ratio["met"]
    assert fit_line([1, 2, 3], [3, 5, 7]) == (pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.0))
