"""`Retention`: which snapshots outlive the newest `keep`, in `retention.json` beside `snapshots/`.

    store.save(step, state, meta, hold=True)           # kept until released or pinned
    store.set_retention(Retention(pins={"best_dev": 40}, released_through=60))

A held snapshot waits for its caller's decision. A damaged file (its SHA-256) releases nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zocheck_ray.storage.fs import Storage

logger = logging.getLogger(__name__)

RETENTION_FILE = "retention.json"


class Retention(BaseModel):
    """Pinned steps and the release point of held ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pins: dict[str, int] = Field(default_factory=dict)
    """Name -> step never pruned."""
    released_through: int = -1
    """Held snapshots up to here are pruned as any other."""
    notes: dict[str, Any] = Field(default_factory=dict)
    """JSON beside each pin."""

    def keeps(self, step: int, held: bool) -> bool:
        """Whether the snapshot of `step` (`held`: saved with `hold`) is kept."""
        return step in self.pins.values() or (held and step > self.released_through)

    def encode(self) -> bytes:
        body = self.model_dump(mode="json")
        body["sha256"] = hashlib.sha256(_canonical(self.model_dump(mode="json"))).hexdigest()
        return json.dumps(body, indent=1, sort_keys=True).encode()


def read_retention(storage: Storage) -> Retention:
    """The run's `Retention` (empty without a file, or a damaged one)."""
    try:
        data = storage.read_bytes(RETENTION_FILE)
    except FileNotFoundError:
        return Retention()
    try:
        body = json.loads(data)
        claimed = body.pop("sha256")
        if hashlib.sha256(_canonical(body)).hexdigest() != claimed:
            raise ValueError("it fails its own checksum")
        return Retention.model_validate(body)
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
        logger.warning("%s is damaged (%s): every held snapshot is kept", storage.url_of(RETENTION_FILE), exc)
        return Retention()


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
