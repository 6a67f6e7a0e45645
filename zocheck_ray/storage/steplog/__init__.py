"""The durable step log: `StepLog` and its readers (`log.py`), over segments of records (`segments.py`)."""

from __future__ import annotations

from zocheck_ray.core.lazy import on_first_use

__getattr__, __dir__ = on_first_use(globals(), {
    "log": ("StepLog", "read_log", "read_records", "AUTO_SEAL_RETRY_SECONDS", "LISTING_ATTEMPTS"),
    "segments": ("LOG_DIR", "SEGMENT_MAGIC", "first_logged_step", "list_segments", "parse_segment",
                 "segment_writer"),
})
