"""Which Ray cluster `connect_ray` joins and what it says before connecting: `ray.init`'s documented
address rules and token variables, read without Ray (the connections themselves: test_cli_clusters.py)."""

from __future__ import annotations

import os
import socket

import pytest

from zocheck_ray.actors.connect import (
    RAY_START_WHY,
    RayConnectionError,
    check_reachable,
    cluster_to_join,
    use_token_at_hand,
)


@pytest.fixture(autouse=True)
def machine(monkeypatch, tmp_path):
    """No Ray address, token or mode in the environment; Ray's temp dir and the home directory in `tmp_path`."""
    for name in [n for n in os.environ if n.startswith("RAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def record_ray_start(tmp_path, address: str) -> None:
    """What `ray start` leaves for `ray.init` to find."""
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address + "\n")


def test_an_address_is_used_as_it_is_and_local_starts_a_local_instance(machine, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    record_ray_start(machine, "10.0.0.3:6379")
    assert cluster_to_join("10.0.0.1:6379") == ("10.0.0.1:6379", "--address")
    assert cluster_to_join("ray://10.0.0.1:10001") == ("ray://10.0.0.1:10001", "--address")
    assert cluster_to_join("local") == (None, "")


def test_without_an_address_ray_address_comes_first_then_the_ray_start_cluster(machine, monkeypatch):
    record_ray_start(machine, "10.0.0.3:6379")
    for address in (None, "auto"):
        assert cluster_to_join(address) == ("10.0.0.3:6379", RAY_START_WHY)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert cluster_to_join(None) == ("10.0.0.2:6379", "RAY_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert cluster_to_join(None) == (None, "")


def test_with_no_cluster_none_starts_a_local_instance_and_auto_says_what_to_pass():
    assert cluster_to_join(None) == (None, "")
    with pytest.raises(RayConnectionError, match=r"^no Ray cluster found on this machine .*pass --address HOST:PORT$"):
        cluster_to_join("auto")


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "head-node", "head:port"])
def test_an_address_that_is_not_a_gcs_address_is_named(monkeypatch, address):
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(RayConnectionError) as raised:
        cluster_to_join(None)
    assert str(raised.value).startswith(f"{address!r} (RAY_ADDRESS) is not the address of a Ray cluster's GCS")


def test_an_address_where_nothing_listens_is_named_with_its_source():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once it is closed
    with pytest.raises(RayConnectionError) as raised:
        check_reachable(f"127.0.0.1:{closed}", "--address")
    assert str(raised.value).startswith(f"no Ray cluster answers at 127.0.0.1:{closed} (--address: connection refused)")


def test_an_address_where_something_listens_is_reachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}", "--address")


@pytest.mark.parametrize("source", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"])
def test_a_token_at_hand_turns_on_token_mode_for_a_cluster_to_join(machine, monkeypatch, source):
    if source == "RAY_AUTH_TOKEN":
        monkeypatch.setenv("RAY_AUTH_TOKEN", "t0ken")
    else:
        path = machine / ".ray" / "auth_token" if source == "~/.ray/auth_token" else machine / "token"
        path.parent.mkdir(exist_ok=True)
        path.write_text("t0ken\n")
        if source == "RAY_AUTH_TOKEN_PATH":
            monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    use_token_at_hand("10.0.0.1:6379")
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_token_mode_is_left_alone_where_set_without_a_token_or_for_a_local_instance(monkeypatch):
    use_token_at_hand("10.0.0.1:6379")  # no token at hand
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0ken")
    use_token_at_hand("local")  # Ray's own default for a local instance
    use_token_at_hand(None)
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    use_token_at_hand("10.0.0.1:6379")
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
