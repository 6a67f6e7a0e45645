"""`python -m benchmarks restore` at a small size: both paths and the copy land the same bytes, and the
figures it reports are the ones it measured."""

from benchmarks.restore import TARGET, markdown, measure
from support import pushes_allowed


def test_the_shadows_write_the_trainers_read_and_a_copy_each_restore_the_image_exactly():
    doc = measure(40 << 20, rounds=2, say=lambda line: None)
    assert doc["exact"] is True
    rows = {r["path"]: r for r in doc["rows"]}
    assert set(rows) == {"copy", "write", "read"}
    allowed = pushes_allowed()
    assert doc["product_path"] == ("write" if allowed else "read") and (doc["write_refused"] is None) == allowed
    for path in ("copy", "read") + (("write",) if allowed else ()):
        row = rows[path]
        assert len(row["rounds_gbps"]) == 2 and row["gbps"] == max(row["rounds_gbps"]) > 0
        assert row["fraction"] == row["gbps"] / rows["copy"]["gbps"]
    taken = rows[doc["product_path"]]
    assert doc["target"]["restore_at_least_half_a_copy"] == (taken["gbps"] >= TARGET * rows["copy"]["gbps"])
    assert doc["tensors"] > 1 and doc["threads"] >= 1
    assert "| write |" in markdown(doc)
