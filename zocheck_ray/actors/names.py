"""The actors' names and what the GCS says of an actor, without torch: read by `status`, which must answer
without loading the trainer's libraries (`tests/unit/test_setup.py`), as well as by the controller."""

from __future__ import annotations

NAMESPACE = "zocheck"


def shadow_name(run_id: str) -> str:
    return f"zocheck-shadow-{run_id}"


def trainer_name(run_id: str, rank: int | str = 0) -> str:
    """The process created for rank 0 keeps the single trainer's name; rank r > 0's is `...-rank{r}`, the
    standby's `...-standby`. After a promotion the controller's group knows which process serves a rank."""
    return f"zocheck-trainer-{run_id}" + (f"-rank{rank}" if rank else "")


def actor_entry(actor) -> dict:
    """The GCS's actor table entry of `actor` (`State`, `NumRestarts`, ...), or {} where it cannot be read.

    Ray has no public way to ask without the dashboard; its GCS actor table says it at once, where a task
    sent to a restarting actor waits on Ray's death-info timer (1 s or more) before it fails."""
    try:
        from ray._private.state import actors

        return actors(actor_id=actor._actor_id.hex()) or {}
    except Exception:  # another Ray, or the table is unreachable: callers fall back to calling the actor
        return {}


def actor_state(actor) -> str | None:
    """The GCS's state of `actor` now (`ALIVE`, `RESTARTING`, `DEAD`, ...), or None where it cannot be read."""
    return actor_entry(actor).get("State")


def describe_actor(actor) -> str:
    """What the GCS's actor table says of `actor`, in words: its state (ALIVE, RESTARTING, DEAD, ...), its
    process and its restarts; "unknown" where the table cannot be read."""
    entry = actor_entry(actor)
    if not entry:
        return "unknown"
    where = entry.get("Address") or {}
    return (f"{entry.get('State', 'unknown')} (pid {entry.get('Pid') or '-'} on {where.get('IPAddress') or '-'}, "
            f"{entry.get('NumRestarts', 0)} restarts)")
