"""`bench adapters` at the built-in small size: the shadow holds 2x the adapter, the snapshot is the adapter."""

from __future__ import annotations

import argparse

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
