"""`bench adapters` at the built-in small size: the shadow holds 2x the adapter, the snapshot is the adapter."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.adapters import add_arguments, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see conftest


def test_the_shadow_and_the_snapshot_scale_with_the_adapter():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    doc = run(parser.parse_args(["--size", "tiny-opt", "--methods", "full", "lora", "--rank", "2", "--steps", "4"]))
    full, lora = doc["results"]
    assert full["exact"] and lora["exact"]
    assert lora["state_bytes"] < full["state_bytes"] / 10  # the frozen base is not in the state
    for row in (full, lora):
        assert row["peak_held_bytes"] == 2 * row["state_bytes"]  # the replica and one image, nothing else
        assert row["state_bytes"] < row["snapshot_bytes"] < row["state_bytes"] + (16 << 10)  # + config, manifest
    ((target),) = doc["targets"]
    assert target["target"].startswith("lora: shadow peak within 10% of 2x the adapter's bytes")


def test_a_report_exits_1_unless_every_target_is_met_and_every_row_exact(tmp_path, capsys):
    from benchmarks.common import report_exact_targets

    columns = [("name", "name", ""), ("exact", "exact", "")]
    target = {"target": "shadow <= 2.1x", "measured": "2.000x", "met": True}
    good = {"results": [{"name": "lora", "exact": True}], "targets": [target]}
    assert report_exact_targets(good, columns, tmp_path / "a.json") == 0
    assert json.loads((tmp_path / "a.json").read_text()) == good
    assert "  met: shadow <= 2.1x (2.000x)" in capsys.readouterr().out
    assert report_exact_targets({**good, "targets": [{**target, "met": False}]}, columns, None) == 1
    assert "  NOT met: shadow <= 2.1x (2.000x)" in capsys.readouterr().out
    assert report_exact_targets({**good, "results": [{"name": "lora", "exact": False}]}, columns, None) == 1
