"""The actors' names, and what Ray's state API says of an actor, without torch, so `status` answers
without loading the trainer's libraries.

Without a dashboard there is no state API: `actor_status` answers None, and callers learn of a death,
later, from the calls that fail.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NAMESPACE = "zocheck"
STATE_API_TIMEOUT_SECONDS = 10
"""The longest one state-API question may take."""
STATE_API_RETRY_SECONDS = 30.0
"""Seconds before a state API that did not answer is asked again."""


def shadow_name(run_id: str) -> str:
    return f"zocheck-shadow-{run_id}"


def trainer_name(run_id: str, rank: int | str = 0) -> str:
    """Rank 0 keeps the single trainer's name; rank r > 0 is `...-rank{r}`, the standby `...-standby`."""
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
    """The connected cluster's state API through one reused `StateApiClient`, since making one resolves
    the dashboard through the GCS."""

    def __init__(self, client):
        self._client = client
        self._ids: dict[tuple[str, str], str] = {}

    @classmethod
    def connect(cls, say=logger.info) -> ActorStates | None:
        """A client for the connected cluster, or None where its state API does not answer for it."""
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
        """The actor `actor_id` now, or None."""
        from ray.util.state.common import GetApiOptions, StateResource

        try:
            found = self._client.get(StateResource.ACTORS, actor_id, GetApiOptions(timeout=STATE_API_TIMEOUT_SECONDS))
        except Exception as exc:
            logger.debug("Ray's state API did not answer for actor %s: %s", actor_id, exc)
            return None
        return _status(found) if found is not None else None

    def named(self, name: str, namespace: str = NAMESPACE) -> ActorStatus | None:
        """The live actor named `name`, else a dead one, else None. The name is looked up again once its
        actor is dead, as a resumed run reuses it."""
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


_connected: tuple[str, float, ActorStates | None, bool] | None = None
"""(GCS address, when connected, its `ActorStates` or None, whether to ask again)."""


def actor_states() -> ActorStates | None:
    """The connected cluster's `ActorStates`, made once per cluster; None without one. A state API that failed
    slowly is not asked again, since Ray's client waits long for a dashboard that did not start."""
    global _connected
    import ray

    if not ray.is_initialized():
        return None
    address = ray.get_runtime_context().gcs_address
    if _connected is None or _connected[0] != address:
        _connected = _connect(address, logger.info)
    elif _connected[3] and time.monotonic() - _connected[1] > STATE_API_RETRY_SECONDS:
        _connected = _connect(address, logger.debug)  # said once already
    return _connected[2]


def _connect(address: str, say) -> tuple[str, float, ActorStates | None, bool]:
    began = time.monotonic()
    states = ActorStates.connect(say=say)
    now = time.monotonic()
    return address, now, states, states is None and now - began < STATE_API_TIMEOUT_SECONDS


def is_ours(exc: Exception) -> bool:
    """Whether `exc` is a zocheck-ray error, or Ray's report of one raised by a remote call."""
    return any(cls.__module__.startswith("zocheck_ray.") for cls in type(exc).__mro__)


def ray_reason(exc: BaseException) -> str:
    """Ray's reason for an actor's failure in one line: its report without the actor's details or a traceback."""
    from ray.exceptions import ActorDiedError

    lines = [line.rstrip() for line in str(exc).strip().splitlines() if line.strip()]
    if getattr(exc, "actor_init_failed", False) and lines:
        return f"its constructor raised {lines[-1].strip()}"
    said = [line for line in lines if not line[0].isspace() and not line.startswith("Traceback")
            and line != getattr(ActorDiedError, "BASE_ERROR_MSG", None)]
    return " ".join(said).rstrip(".") or type(exc).__name__


def actor_exists(name: str, namespace: str = NAMESPACE) -> bool:
    """Whether Ray has a live actor named `name`."""
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def actor_status(name: str, namespace: str = NAMESPACE) -> ActorStatus | None:
    """The state API's status of actor `name` now; None where it cannot say."""
    states = actor_states()
    return states.named(name, namespace) if states is not None else None


def describe_actor(name: str, namespace: str = NAMESPACE) -> str:
    """Actor `name`'s state, process and restarts, in words."""
    status = actor_status(name, namespace)
    if status is not None:
        return status.describe()
    if actor_states() is None:
        return _ask_actor(name, namespace)
    return "unknown to Ray's state API"


PROBE_SECONDS = 2.0
"""Seconds `describe_actor` waits for an actor's own answer without a state API."""


def _ask_actor(name: str, namespace: str) -> str:
    """The actor's own answer (its `pid`), for a cluster without a state API."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)  # held: a handle dropped mid-call is lost (Ray < 2.5x)
        pid = ray.get(actor.pid.remote(), timeout=PROBE_SECONDS)
    except ValueError:
        return "unknown to Ray (no actor of that name)"
    except ray.exceptions.GetTimeoutError:
        return f"not answering within {PROBE_SECONDS:g} s (busy, or being restarted)"
    except ray.exceptions.RayError as exc:
        return f"not answering: {str(exc).splitlines()[0]}"
    except AttributeError:  # an actor of another kind under the name
        return "an actor that is not zocheck-ray's (it has no `pid`)"
    return f"ALIVE (pid {pid}, by its own answer: Ray's state API does not answer without a dashboard)"
