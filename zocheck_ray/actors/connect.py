"""Which Ray cluster a run uses, and how a later `zocheck-ray status` finds it.

`connect_ray` joins the cluster it is told of or starts a local instance, and says which in
one line, using only what Ray documents. Ray reads RAY_AUTH_MODE when it is imported, so this
module imports Ray only in `connect_ray`; the token mode must be the cluster's, so it is asked
of the cluster (`cluster_wants_token`).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable

from zocheck_ray.actors.names import NAMESPACE

RAY_START_WHY = "the cluster `ray start` runs on this machine"
_CALLS_REFUSED = ("its processes call this one without a token, which token mode refuses, and Ray ends every actor "
                  "of the run before it runs")
GCS_FIRST_REQUEST = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""The request `ray.init` sends a cluster's GCS first, by its gRPC name (its message is empty)."""


TOKEN_AUTH_SINCE = (2, 52)
"""The Ray release that brought token authentication: before it Ray ignores RAY_AUTH_MODE."""


@functools.cache
def ray_has_token_auth() -> bool:
    """Whether the installed Ray knows token authentication; read from its metadata, since importing Ray would fix
    its mode."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("ray").split(".")[:2]) >= TOKEN_AUTH_SINCE


class RayConnectionError(ConnectionError):
    """The Ray cluster cannot be found or reached, or refuses this process; the message says what to do."""


def _ray_start_address() -> str | None:
    """The GCS address the latest `ray start` here recorded, read where `ray.init` documents it looks."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        return Path(temp, "ray", "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of HOST:PORT or ray://HOST:PORT; None for anything else."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")  # an IPv6 host
    return (host, int(port)) if host and "/" not in host and port.isdigit() else None


def cluster_to_join(address: str | None) -> tuple[str | None, str]:
    """(address, why) that `ray.init(address)` joins by its documented rules; (None, "") for a local
    instance."""
    if address == "local":
        return None, ""
    if address not in (None, "auto"):
        joined, why = address, "--address"
    elif os.environ.get("RAY_ADDRESS") not in (None, "", "auto"):
        joined, why = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
        if joined == "local":
            return None, ""
    elif (joined := _ray_start_address()) is not None:
        why = RAY_START_WHY
    elif address == "auto":
        raise RayConnectionError("no Ray cluster found on this machine (RAY_ADDRESS is not set and no `ray start` "
                                 "cluster runs): pass --address HOST:PORT")
    else:
        return None, ""
    if _host_port(joined) is None:
        raise RayConnectionError(f"{joined!r} ({why}) is not the address of a Ray cluster's GCS (HOST:PORT, the "
                                 "`ray start --port`, or ray://HOST:PORT for Ray Client)")
    return joined, why


def _auth_token() -> tuple[str | None, str]:
    """(token, source) that Ray would present, in Ray's documented order."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    for path, source in ((os.environ.get("RAY_AUTH_TOKEN_PATH"), "RAY_AUTH_TOKEN_PATH"),
                         (os.path.expanduser("~/.ray/auth_token"), "~/.ray/auth_token")):
        if path and os.path.isfile(path):
            with open(path) as f:
                return f.read().strip(), f"{source} ({path})"
    return None, ""


def _gcs_refuses(address: str, token: str | None = None, timeout: float = 5.0) -> bool | None:
    """Whether the GCS at `address` refuses `GCS_FIRST_REQUEST` with `token` (or none) as unauthenticated; None:
    no answer that says. Raw grpc, no Ray module."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        ask = channel.unary_unary(GCS_FIRST_REQUEST, request_serializer=bytes, response_deserializer=bytes)
        try:
            ask(b"", timeout=timeout, metadata=[("authorization", f"Bearer {token}")] if token else None)
        except grpc.RpcError as exc:
            return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


_asked: dict[str, bool] = {}


def cluster_wants_token(address: str) -> bool | None:
    """Whether the cluster at `address` uses token authentication; None where it did not say (asked again)."""
    if address not in _asked and (answer := _gcs_refuses(address)) is not None:
        _asked[address] = answer
    return _asked.get(address)


def use_token_at_hand(address: str | None) -> None:
    """With RAY_AUTH_MODE unset and a token at hand, set it to the cluster's mode (`token` or `disabled`), since Ray
    would guess; call before `import ray`."""
    try:
        joined, _ = cluster_to_join(address)
    except RayConnectionError:
        return  # `connect_ray` says so
    if joined is None or joined.startswith("ray://") or "RAY_AUTH_MODE" in os.environ or _auth_token()[0] is None \
            or not ray_has_token_auth():
        return
    os.environ["RAY_AUTH_MODE"] = "disabled" if cluster_wants_token(joined) is False else "token"


def check_reachable(address: str, why: str, timeout: float = 5.0) -> None:
    """Raise `RayConnectionError` unless `address` accepts TCP within `timeout` seconds, because Ray
    itself retries a dead address for a long time."""
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
        raise RayConnectionError(f"no Ray cluster answers at {address} ({why}: {reason}): is it running, and is "
                                 "that its GCS address (the `ray start --port`, 6379 by default)?") from None


def _check_token(address: str) -> None:
    """Raise `RayConnectionError` if RAY_AUTH_MODE=token and no token is at hand."""
    if os.environ.get("RAY_AUTH_MODE") == "token" and _auth_token()[0] is None:
        raise RayConnectionError(f"RAY_AUTH_MODE=token but no token was found for the Ray cluster at {address}: "
                                 "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
                                 "on its head prints it)")


def _check_mode(address: str, found: bool) -> None:
    """Refuse at once a token mode that is not the cluster's, saying what to set (Ray would retry, or lose every
    actor); `found`: the `ray start` cluster."""
    wants, mode = cluster_wants_token(address), os.environ.get("RAY_AUTH_MODE")
    token = _auth_token()[0]
    ray_turns_it_on = found and mode is None and token is not None
    if wants is None:
        return  # the cluster did not say: Ray's connection will
    if not wants:
        if mode == "token":
            raise RayConnectionError(f"RAY_AUTH_MODE=token, but the Ray cluster at {address} does not use token "
                                     f"authentication: {_CALLS_REFUSED}; unset RAY_AUTH_MODE (or set it to disabled) "
                                     "to join it")
        if ray_turns_it_on:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        return
    if ray_turns_it_on or (mode == "token" and _gcs_refuses(address, token) is not True):
        return  # Ray presents the token at hand, which the cluster takes (or did not say)
    raise _refused(address, asked=True)


def token_mode_mismatch() -> str | None:
    """The fix where this process is in token mode and the cluster it joined is not (a script joined it so)."""
    import ray

    if os.environ.get("RAY_AUTH_MODE") != "token" or not ray_has_token_auth() or not ray.is_initialized() or \
            cluster_wants_token(gcs := ray.get_runtime_context().gcs_address) is not False:
        return None
    return (f"RAY_AUTH_MODE=token, but the Ray cluster at {gcs} does not use token authentication: {_CALLS_REFUSED}; "
            "unset RAY_AUTH_MODE (or set it to disabled) where this process starts")


def _refused(address: str, asked: bool = False) -> RayConnectionError:
    """The error, with its fix, for a cluster that refused this process's connection, or (`asked`) our request."""
    token, source = _auth_token()
    mode = os.environ.get("RAY_AUTH_MODE")
    get_token = "(`ray get-auth-token` on its head prints it)"
    if token is None:
        fix = f"this process has no token: {'' if asked else 'if it uses token authentication, '}set RAY_AUTH_TOKEN " \
              f"to its token {get_token}"
    elif mode == "token":
        fix = f"it refuses the token from {source}: set RAY_AUTH_TOKEN to its token {get_token}"
    elif mode is not None:
        fix = f"RAY_AUTH_MODE={mode} keeps Ray from sending the token from {source}: set RAY_AUTH_MODE=token"
    else:  # Ray was imported before `use_token_at_hand` could set the mode
        fix = (f"RAY_AUTH_MODE is unset, so Ray does not send the token from {source}: set RAY_AUTH_MODE=token in "
               "the environment")
    said = "uses token authentication" if asked and mode != "token" else "did not let this process connect"
    return RayConnectionError(f"the Ray cluster at {address} {said}; {fix}")


def _local_runs_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"zocheck-ray-{os.getuid()}" / "local-runs"


def record_local_instance(run_id: str, address: str) -> None:
    """Note that `run_id` runs on the local instance at `address`, for `zocheck-ray status` here to
    find; the note goes when this process ends."""
    directory = _local_runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{run_id}.json"
    path.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    atexit.register(path.unlink, missing_ok=True)


def recorded_address(run_id: str) -> str | None:
    """The address `record_local_instance` noted for `run_id`, if its process still runs."""
    try:
        record = json.loads((_local_runs_dir() / f"{run_id}.json").read_text())
        os.kill(record["pid"], 0)  # the process that started it still runs
        return record["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def connect_ray(address: str | None = None, say: Callable[[str], None] | None = None, run_id: str | None = None,
                **kwargs) -> str | None:
    """`ray.init` in our namespace without worker logs, saying what was joined and why; returns the
    joined address, or None for a local instance. Raises `RayConnectionError`."""
    import ray

    joined, why = cluster_to_join(address)
    if joined is not None:
        check_reachable(joined, why)
        if not joined.startswith("ray://") and ray_has_token_auth():
            _check_token(joined)
            _check_mode(joined, found=why == RAY_START_WHY)
    # None and "auto" go as given, so Ray presents a token at hand as it does for a cluster it finds
    init_address = "local" if joined is None else address if address in (None, "auto") else joined
    refusals = (ConnectionError, *(() if (auth := getattr(ray.exceptions, "AuthenticationError", None)) is None
                                   else (auth,)))  # Ray 2.52 and later
    try:
        ray.init(address=init_address, namespace=NAMESPACE, log_to_driver=False, **kwargs)
    except refusals:
        if joined is None:
            raise
        raise _refused(joined) from None
    gcs = ray.get_runtime_context().gcs_address
    if joined is None and run_id is not None:
        record_local_instance(run_id, gcs)
    if say is not None:
        if joined is None:
            auth = "on; RAY_AUTH_MODE=disabled turns it off" if os.environ.get("RAY_AUTH_MODE") == "token" and \
                ray_has_token_auth() else "off"
            say(f"  ray: a local instance for this run at {gcs} (token authentication {auth})")
        else:
            say(f"  ray: joined the cluster at {gcs} ({why})")
    return joined
