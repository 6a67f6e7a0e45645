"""Which Ray cluster a run uses, and how a later `zocheck-ray status` finds it.

`connect_ray` joins the cluster it is told of (`--address`, `RAY_ADDRESS`, the one `ray
start` runs on this machine) or starts a local instance, and says which in one line; a
local instance is recorded with the run's id so `status RUN` finds it. A cluster that
cannot be reached, or refuses this process's token, is named in one line before Ray
prints anything.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import ray

from zocheck_ray.actors.names import NAMESPACE


class RayConnectionError(ConnectionError):
    """The Ray cluster to use cannot be found or reached, or refuses this process; the message says
    which address and what to do."""


def cluster_to_join(address: str | None) -> tuple[str | None, str]:
    """(the GCS address `ray.init(address)` connects to, why that one), or (None, "") when it starts a
    local instance: `address` itself, `RAY_ADDRESS`, or the cluster `ray start` runs on this machine."""
    from ray._private.services import canonicalize_bootstrap_address

    if address == "local":
        return None, ""
    if address not in (None, "auto"):
        return address, "--address"
    try:
        joined = canonicalize_bootstrap_address(address)
    except ConnectionError:  # "auto" and no cluster
        raise RayConnectionError("no Ray cluster found on this machine (RAY_ADDRESS is not set and no `ray start` "
                                 "cluster runs): pass --address HOST:PORT") from None
    except ValueError:
        raise RayConnectionError(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r} is not the address of a Ray "
                                 "cluster's GCS (HOST:PORT, the `ray start --port`)") from None
    if joined is None:
        return None, ""
    return joined, ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the cluster `ray start` runs on this "
                                                                          "machine")


def _auth_token() -> tuple[str | None, str]:
    """The token Ray would present, and where it comes from (Ray's order: the variable, the file it names,
    ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    for path, source in ((os.environ.get("RAY_AUTH_TOKEN_PATH"), "RAY_AUTH_TOKEN_PATH"),
                         (os.path.expanduser("~/.ray/auth_token"), "~/.ray/auth_token")):
        if path and os.path.isfile(path):
            with open(path) as f:
                return f.read().strip(), f"{source} ({path})"
    return None, ""


def check_cluster(address: str, timeout: float = 10.0) -> None:
    """Ask the GCS at `address` (HOST:PORT) for its cluster id, as `ray.init` would first: one quick call
    instead of Ray's retries, each a warning, before a traceback. Raises `RayConnectionError` saying what
    is missing: nothing answers, the cluster wants a token and none is at hand, or it refuses the one at
    hand. When it takes this process's token, Ray is told to present it (RAY_AUTH_MODE=token, if unset)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    def ask(token: str | None):
        with grpc.insecure_channel(address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout,
                                  metadata=[("authorization", f"Bearer {token}")] if token else None)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    answer = ask(None)
    if answer == grpc.StatusCode.OK:
        return
    if answer != grpc.StatusCode.UNAUTHENTICATED:
        raise RayConnectionError(f"no Ray cluster answers at {address} ({answer.name.lower()}): is it running, and is "
                                 "that its GCS address (the `ray start --port`, 6379 by default)?")
    token, source = _auth_token()
    if token is None:
        raise RayConnectionError(f"the Ray cluster at {address} uses token authentication and no token was found: "
                                 "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
                                 "on its head prints it)")
    if ask(token) != grpc.StatusCode.OK:
        raise RayConnectionError(f"the Ray cluster at {address} refuses the token from {source}: set RAY_AUTH_TOKEN "
                                 "to its token (`ray get-auth-token` on its head prints it)")
    _send_token(address, source)


def _send_token(address: str, source: str) -> None:
    """Have Ray present this process's token (RAY_AUTH_MODE=token, if unset), or say what keeps it from it."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:  # as Ray does when it turns token authentication on for a local instance
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = mode = "token"
        Config.initialize("")
    if mode != "token":
        raise RayConnectionError(f"the Ray cluster at {address} uses token authentication, but RAY_AUTH_MODE={mode} "
                                 f"keeps Ray from sending the token from {source}: set RAY_AUTH_MODE=token")


def _local_runs_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"zocheck-ray-{os.getuid()}" / "local-runs"


def record_local_instance(run_id: str, address: str) -> None:
    """Note, for `zocheck-ray status RUN_ID` on this machine, that `run_id` runs on the local instance at
    `address`, which this process started (a local instance is not found as a `ray start` cluster is).
    The note goes when this process ends; one left by a killed process is recognised by its pid."""
    directory = _local_runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{run_id}.json"
    path.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    atexit.register(path.unlink, missing_ok=True)


def recorded_address(run_id: str) -> str | None:
    """The address of the local instance a running process started for `run_id` (`record_local_instance`)."""
    try:
        record = json.loads((_local_runs_dir() / f"{run_id}.json").read_text())
        os.kill(record["pid"], 0)  # the process that started it still runs
        return record["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def connect_ray(address: str | None = None, say: Callable[[str], None] | None = None, run_id: str | None = None,
                **kwargs) -> str | None:
    """`ray.init` in our namespace, worker logs kept out of the driver's output, and Ray's token-
    authentication warning (printed on every local start) replaced by one line of ours, which says
    what was joined and why, or the address of the local instance started (`say`).

    Returns the address of the cluster joined, or None when a local instance was started for this
    process (`address` None and no cluster to join, or "local"); `zocheck-ray status` then finds run
    `run_id` there (`record_local_instance`). Raises `RayConnectionError`, before `ray.init`, when the
    cluster to join cannot be reached or refuses this process."""
    import logging

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    joined, why = cluster_to_join(address)
    if joined is not None and not joined.startswith("ray://"):
        check_cluster(joined)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **kwargs)
    gcs = ray.get_runtime_context().gcs_address
    if joined is None and run_id is not None:
        record_local_instance(run_id, gcs)
    if say is not None:
        if joined is None:
            auth = "on; RAY_AUTH_MODE=disabled turns it off" if os.environ.get("RAY_AUTH_MODE") == "token" else "off"
            say(f"  ray: a local instance for this run at {gcs} (token authentication {auth})")
        else:
            say(f"  ray: joined the cluster at {gcs} ({why})")
    return joined
