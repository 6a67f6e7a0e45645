"""The actors' names, and what Ray's state API says of an actor, without torch: read by `status`, which must
answer without loading the trainer's libraries (`tests/unit/test_setup.py`), as well as by the controller.

The state API is served by the cluster's dashboard. Where the cluster runs without one, `actor_status` answers
None and callers learn of a death from the calls that fail (`ActorDiedError`, `ActorUnavailableError`), which
is slower (Ray first waits for the death's details) but tells the same.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NAMESPACE = "zocheck"
STATE_API_TIMEOUT_SECONDS = 10
"""The longest one question to the state API may take (a busy dashboard answers late; none answers None)."""
STATE_API_RETRY_SECONDS = 30.0
"""How long a cluster whose state API did not answer is taken to have none before it is asked again."""


def shadow_name(run_id: str) -> str:
    return f"zocheck-shadow-{run_id}"


def trainer_name(run_id: str, rank: int | str = 0) -> str:
    """The process created for rank 0 keeps the single trainer's name; rank r > 0's is `...-rank{r}`, the
    standby's `...-standby`. After a promotion the controller's group knows which process serves a rank."""
    return f"zocheck-trainer-{run_id}" + (f"-rank{rank}" if rank else "")


@dataclass(frozen=True)
class ActorStatus:
    """One actor as Ray's state API reports it."""

    actor_id: str
    state: str
    """`PENDING_CREATION`, `ALIVE`, `RESTARTING`, `DEAD`, ..."""
    restarts: int
    pid: int | None = None
    node_id: str | None = None

    def describe(self) -> str:
        node = (self.node_id or "-")[:12]
        return f"{self.state} (pid {self.pid or '-'} on node {node}, {self.restarts} restarts)"


class ActorStates:
    """The connected cluster's state API through one `StateApiClient`, reused for every question (making one
    resolves the dashboard's address through the GCS). Actors are found by name, once, then by id: a name is
    filtered in the dashboard over every actor it knows, an id in the GCS."""

    def __init__(self, client):
        self._client = client
        self._ids: dict[tuple[str, str], str] = {}
        """(namespace, name) -> the id of the live actor of that name when it was last looked up."""

    @classmethod
    def connect(cls, say=logger.info) -> ActorStates | None:
        """A client for the cluster this process is connected to, or None where its state API does not answer
        for it (no dashboard, or the dashboard's port is another cluster's: it must know this node); `say`
        tells which."""
        import ray
        from ray.util.state import StateApiClient
        from ray.util.state.common import GetApiOptions, StateResource

        context = ray.get_runtime_context()
        try:
            client = StateApiClient(address=context.gcs_address)
            node = client.get(StateResource.NODES, context.get_node_id(),
                              GetApiOptions(timeout=STATE_API_TIMEOUT_SECONDS))
        except Exception as exc:  # ServerUnavailable (no dashboard), a timeout, a cluster without the address
            say("Ray's state API does not answer (%s): actors' deaths are seen when calls to them fail",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None
        if node is None:
            say("Ray's state API at the dashboard's address serves another cluster: actors' deaths are seen when "
                "calls to them fail")
            return None
        return cls(client)

    def by_id(self, actor_id: str) -> ActorStatus | None:
        """The actor `actor_id` now; None where it is unknown or the state API does not answer."""
        from ray.util.state.common import GetApiOptions, StateResource

        try:
            found = self._client.get(StateResource.ACTORS, actor_id, GetApiOptions(timeout=STATE_API_TIMEOUT_SECONDS))
        except Exception as exc:
            logger.debug("Ray's state API did not answer for actor %s: %s", actor_id, exc)
            return None
        return _status(found) if found is not None else None

    def named(self, name: str, namespace: str = NAMESPACE) -> ActorStatus | None:
        """The actor named `name` now: the live one of that name (one at most), else a dead one; None where
        there is none or the state API does not answer. A dead actor's name may be taken by a new actor (a run
        resumed under its run id): the name is looked up again once the actor it named is dead."""
        key = (namespace, name)
        if key in self._ids:
            status = self.by_id(self._ids[key])
            if status is None or status.state != "DEAD":
                return status
        from ray.util.state.common import ListApiOptions, StateResource

        try:
            found = self._client.list(
                StateResource.ACTORS, ListApiOptions(filters=[("name", "=", name), ("ray_namespace", "=", namespace)],
                                                     detail=True, timeout=STATE_API_TIMEOUT_SECONDS),
                raise_on_missing_output=False)
        except Exception as exc:
            logger.debug("Ray's state API did not answer for actor %s: %s", name, exc)
            return None
        statuses = [_status(actor) for actor in found]
        live = [s for s in statuses if s.state != "DEAD"]
        if live:
            self._ids[key] = live[0].actor_id
        return (live or statuses or [None])[0]


def _status(actor) -> ActorStatus:
    return ActorStatus(actor_id=actor.actor_id, state=actor.state, restarts=actor.num_restarts or 0, pid=actor.pid,
                       node_id=actor.node_id)


_connected: tuple[str, float, ActorStates | None] | None = None
"""(the cluster's GCS address, when it was connected, its `ActorStates` or None)."""


def actor_states() -> ActorStates | None:
    """The connected cluster's `ActorStates`, made once per cluster (and asked again a while after it did not
    answer); None where there is none (Ray not connected, or its state API does not answer)."""
    global _connected
    import ray

    if not ray.is_initialized():
        return None
    address = ray.get_runtime_context().gcs_address
    if _connected is None or _connected[0] != address:
        _connected = (address, time.monotonic(), ActorStates.connect())
    elif _connected[2] is None and time.monotonic() - _connected[1] > STATE_API_RETRY_SECONDS:
        _connected = (address, time.monotonic(), ActorStates.connect(say=logger.debug))  # said once already
    return _connected[2]


def actor_status(name: str, namespace: str = NAMESPACE) -> ActorStatus | None:
    """What the state API says of the actor named `name` now (`ActorStates.named`); None where it cannot say."""
    states = actor_states()
    return states.named(name, namespace) if states is not None else None


def describe_actor(name: str, namespace: str = NAMESPACE) -> str:
    """What Ray's state API says of the actor named `name`, in words: its state (ALIVE, RESTARTING, DEAD, ...),
    its process and its restarts."""
    status = actor_status(name, namespace)
    if status is not None:
        return status.describe()
    if actor_states() is None:
        return _ask_actor(name, namespace)
    return "unknown to Ray's state API"


PROBE_SECONDS = 2.0
"""How long `describe_actor` waits for an actor's own answer where Ray's state API does not answer."""


def _ask_actor(name: str, namespace: str) -> str:
    """The actor's own answer (its `pid`), where Ray's state API does not answer (no dashboard)."""
    import ray

    try:
        pid = ray.get(ray.get_actor(name, namespace=namespace).pid.remote(), timeout=PROBE_SECONDS)
    except ValueError:
        return "unknown to Ray (no actor of that name)"
    except ray.exceptions.GetTimeoutError:
        return f"not answering within {PROBE_SECONDS:g} s (busy, or being restarted)"
    except ray.exceptions.RayError as exc:
        return f"not answering: {str(exc).splitlines()[0]}"
    return f"ALIVE (pid {pid}, by its own answer: Ray's state API does not answer without a dashboard)"
