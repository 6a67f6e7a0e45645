"""Ray transport for `Trainer` and `Shadow`: actors and the link between them.

Records travel trainer -> shadow in batches from one publishing thread, so Ray keeps them
in order; each reply says what the shadow holds, so the trainer re-sends what a restarted
shadow lacks. Images stay in the shadow's memory (`host/image.py`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayError

from zocheck_ray.host.memory import frombuffer
from zocheck_ray.host.image import ImageGoneError, ImageLayout, WindowPlan, handle_layout, open_image, transfer
from zocheck_ray.runtime.messages import AdapterIdentity, PushReply, RecoveryOffer
from zocheck_ray.actors.names import NAMESPACE, actor_status, shadow_name
from zocheck_ray.actors.shadow_actor import ShadowActor, shadow_writer  # noqa: F401  (see there)
from zocheck_ray.core import StepRecord
from zocheck_ray.core.record import decode_records

logger = logging.getLogger(__name__)

POLL_FIRST_SECONDS, POLL_MOST_SECONDS = 0.005, 0.05
"""Seconds of the first and the longest pause of `pauses`."""


def pauses(first: float = POLL_FIRST_SECONDS, most: float = POLL_MOST_SECONDS):
    """Pauses from `first` growing by half up to `most`: a quick state is seen at once, and a long
    wait costs little CPU."""
    pause = first
    while True:
        yield pause
        pause = min(most, pause * 1.5)


def call_when_alive(submit, timeout: float = 300.0):
    """ray.get(submit()), retried while Ray restarts the actor behind it."""
    deadline = time.monotonic() + timeout
    waits = pauses()
    while True:
        try:
            return ray.get(submit())
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(next(waits))


def died_since(name: str, restarts: int | None) -> bool:
    """Whether the state API says actor `name` died since it had `restarts` restarts; False where it
    cannot say."""
    status = actor_status(name)
    return status is not None and (status.state in ("RESTARTING", "DEAD") or (
        restarts is not None and status.restarts > restarts))


def wait_until_restarted(name: str, restarts: int | None, timeout: float = 300.0) -> None:
    """Return once actor `name` is alive after more than `restarts` restarts (or dead, or after
    `timeout`), as a call sent during the restart waits on Ray's retry timer."""
    if restarts is None:
        return wait_until_alive(name, timeout)
    deadline, waits = time.monotonic() + timeout, pauses()
    while time.monotonic() < deadline:
        status = actor_status(name)
        if status is None or status.state == "DEAD" or (status.state == "ALIVE" and status.restarts > restarts):
            return
        time.sleep(next(waits))


def wait_until_alive(name: str, timeout: float = 300.0) -> None:
    """Return once the state API reports actor `name` alive or dead, or after `timeout`."""
    deadline, waits = time.monotonic() + timeout, pauses()
    while time.monotonic() < deadline:
        status = actor_status(name)
        if status is None or status.state in ("ALIVE", "DEAD"):
            return
        time.sleep(next(waits))


def wait_until_dead(probes: list[Callable[[], ray.ObjectRef]], timeout: float = 60.0) -> bool:
    """Whether every actor that `probes` call (a cheap method each) raises `ActorDiedError` within
    `timeout`; a probe that still returns is sent again."""
    deadline, waits, alive = time.monotonic() + timeout, pauses(), list(probes)
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sent = {probe(): probe for probe in alive}
        done, _ = ray.wait(list(sent), num_returns=len(sent), timeout=left)
        if len(done) < len(sent):
            return False
        alive = []
        for ref in done:
            try:
                ray.get(ref)
            except ActorDiedError:
                continue
            except RayError:  # restarting, or the method failed: it is not dead yet
                pass
            alive.append(sent[ref])
        if alive:
            time.sleep(next(waits))
    return True


class RayShadowLink:
    """The trainer's side of the link, over a named `ShadowActor`."""

    def __init__(self, run_id: str, threads: int = 1):
        self.actor = ray.get_actor(shadow_name(run_id), namespace=NAMESPACE)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.threads = threads

    def borrow_image(self, fresh: bool = False, held: str | None = None,
                     timeout: float = 300.0) -> "OfferedImage | None":
        # The image's shadow may be dying, or the image replaced before it is opened: ask again.
        deadline = time.monotonic() + timeout
        while True:
            offer: RecoveryOffer | None = call_when_alive(lambda: self.actor.offer_image.remote(fresh, held))
            if offer is None:
                return None
            try:
                return OfferedImage(self.actor, offer, local=offer.image.node_id == self.node_id,
                                    threads=self.threads)
            except (ImageGoneError, RayActorError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def newer_image(self, token: str | None, timeout: float) -> int | None:
        """The step of an image other than `token` the shadow offers within `timeout` s, or None."""
        return ray.get(self.actor.newer_image.remote(token, timeout))

    def write_state(self, state: dict[str, torch.Tensor]) -> None:
        """Write `state` into the shadow's intake, which must be on this node."""
        layout = ImageLayout.of(state)
        handle = call_when_alive(lambda: self.actor.open_intake.remote(layout.names, layout.dtypes, layout.shapes))
        if handle.node_id != self.node_id:
            raise RuntimeError(f"the shadow is on node {handle.node_id}, this trainer on {self.node_id}: only a "
                               "trainer on the shadow's node hands it its state")
        fd = open_image(handle, write=True)
        if fd is None:  # the plain path: the windows through Ray, one in flight
            plan = WindowPlan(layout, state)
            for start in plan.starts:
                window = torch.zeros(plan.length(start), dtype=torch.uint8)  # the padding too: files hold it
                plan.copy(window, start, "to_image")
                call_when_alive(lambda: self.actor.write_intake.remote(start, window.numpy()))
            return
        try:
            transfer(fd, layout, state, "to_image", threads=self.threads)
        finally:
            os.close(fd)

    def initialize(self, state: dict[str, torch.Tensor], step: int, adapter: AdapterIdentity | None = None,
                   model_config: dict | None = None) -> None:
        self.write_state(state)
        call_when_alive(lambda: self.actor.initialize.remote(step, adapter, model_config))

    def push(self, data: bytes, trainer_step: int):
        return self.actor.push.remote(data, trainer_step)

    def poll(self, handles: list) -> list:
        done, _ = ray.wait(handles, num_returns=len(handles), timeout=0, fetch_local=True)
        out = []
        for ref in done:
            try:
                out.append((ref, PushReply(*ray.get(ref))))
            except Exception as exc:  # the shadow died or is restarting: the publisher asks again later
                out.append((ref, exc))
        return out


class OfferedImage:
    """A shadow's image as a trainer reads it: opened on the shadow's node, else streamed in windows."""

    def __init__(self, actor, offer: RecoveryOffer, local: bool, threads: int = 1):
        self.actor, self.handle, self.threads = actor, offer.image, threads
        self.token: str = offer.image.token
        self.step: int = offer.image.step
        self.layout = handle_layout(offer.image)
        self.records: list[StepRecord] = decode_records(offer.records)
        self.source = "durable" if offer.source == "durable" else "memory"
        self.adapter = offer.adapter
        self.fd = open_image(self.handle) if local else None
        self.through = "memfd" if self.fd is not None else "ray"
        """How the image is read: its memfd opened here, or windows through Ray."""

    def copy_into(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill `tensors` with the image."""
        if self.fd is not None:
            transfer(self.fd, self.layout, tensors, "from_image", threads=self.threads)
            return
        plan = WindowPlan(self.layout, tensors)
        for start in plan.starts:  # one window in flight: a bounded share of both object stores
            window = ray.get(self.actor.image_window.remote(self.handle.token, start, plan.length(start)))
            plan.copy(frombuffer(window), start, "from_image")
        plan.finish()

    def release(self) -> None:
        """Close the image and give it back, so the shadow may reuse its memory."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.actor.give_back.remote(self.handle.token)
        except Exception:  # a shadow that is gone needs nothing back
            pass
