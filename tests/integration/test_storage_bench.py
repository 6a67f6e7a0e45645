"""The storage benchmark (`zocheck-ray bench storage`) runs end to end and reports what it compared.

Only the shape of the report is checked here; the figures belong to the benchmark itself.
"""

from __future__ import annotations

import json

from benchmarks.storage import TARGET_SAVE_RATIO, run


def test_storage_benchmark_compares_saves_with_plain_writes_locally_and_on_s3(tmp_path, capsys):
    path = tmp_path / "storage.json"
    out = run(size_mb=16, s3_size_mb=16, repeats=1, records=200, json_path=str(path), directory=str(tmp_path))
    assert json.loads(path.read_text()) == out
    local, s3 = out["snapshot"]
    assert (local["target"], s3["target"]) == ("local", "s3")
    assert local["bytes"] == s3["bytes"] == 16 << 20
    assert local["baseline"] == "plain fsspec write + one fsync"
    for row in (local, s3):
        assert row["save_vs_baseline"] > 0
        assert row["meets_target"] == (row["save_vs_baseline"] >= TARGET_SAVE_RATIO)
        assert len(row["load_average_before"]) == 3 and len(row["save_s_all"]) == 1
    assert "load_average_at_end" in out["machine"]
    printed = capsys.readouterr().out
    assert f"vs target >= {TARGET_SAVE_RATIO:.2f}" in printed and "load average" in printed
    assert [p for p in tmp_path.iterdir() if p.name.startswith("zocheck-bench-")] == []  # cleaned up
