"""Where a run's actors go, how they start and how they end.

A run's claim on a cluster is its shadow's name, which Ray refuses to a second creation (a check before it lets
two jobs started together both pass), so the shadow comes first.
"""

from __future__ import annotations

import uuid
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayError, RaySystemError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zocheck_ray.actors.names import NAMESPACE, actor_exists, describe_actor, is_ours, ray_reason, shadow_name, \
    trainer_name
from zocheck_ray.actors.client import ShadowClient
from zocheck_ray.actors.inputs import hold_inputs
from zocheck_ray.actors.link import ShadowActor, wait_until_dead
from zocheck_ray.actors.trainer_actor import TrainerActor
from zocheck_ray.config import JobConfig, JobConfigError
from zocheck_ray.actors.connect import token_mode_mismatch
from zocheck_ray.control.elastic_group import Vacancy, trainer_group
from zocheck_ray.control.group import TrainerGroup
from zocheck_ray.control.summary import RunFailedError
from zocheck_ray.core.kernel_cache import cache_env
from zocheck_ray.host.capabilities import PLAIN_ENV, plain as plain_host

STANDBY_GPU_SHARE = 0.01
"""The fraction of rank 0's GPU the standby reserves; it allocates no device memory until promoted."""
PLACEMENT_WAIT_SECONDS = 120
"""How long a start waits for the cluster to place the ranks it needs."""
PLACEMENT_NOTICE_SECONDS = 2.0
"""After this a start says what it waits for."""


def scales_up(job: JobConfig, pg: PlacementGroup | None = None) -> bool:
    """Whether an elastic run under `spread` starts with `min` ranks and grows to `max` as the cluster has room,
    each other rank in a placement group of its own."""
    s = job.scaling
    return pg is None and s.placement == "spread" and s.min_trainers is not None and s.min_trainers < s.trainers


def _check_resources(job: JobConfig) -> int:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    max_cpus = max((n["Resources"].get("CPU", 0) for n in nodes), default=0)
    gpus = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
    total_cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
    total_gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    shadow_cpus, pack, use_gpu = job.shadow.cpus, job.scaling.placement == "pack", job.scaling.use_gpu
    k = job.scaling.min_trainers if scales_up(job) else job.scaling.trainers  # the ranks a start needs
    named = f"scaling.trainers: min={k}" if scales_up(job) else f"scaling.trainers={k}"
    if shadow_cpus + 1 > max_cpus:
        raise JobConfigError(f"shadow.cpus={shadow_cpus} plus one trainer CPU exceed the largest node "
                             f"({max_cpus:g} CPUs); lower shadow.cpus")
    if k > 1:
        if pack and k + shadow_cpus > max_cpus:
            raise JobConfigError(f"scaling.trainers={k} with scaling.placement=pack needs one node with {k} trainer "
                                 f"CPUs plus shadow.cpus={shadow_cpus}, but the largest node has {max_cpus:g} CPUs; "
                                 "lower scaling.trainers or set scaling.placement=spread")
        if k + shadow_cpus > total_cpus:
            raise JobConfigError(f"{named} plus shadow.cpus={shadow_cpus} need {k + shadow_cpus} CPUs, "
                                 f"but the cluster has {total_cpus:g}; lower scaling.trainers")
    if use_gpu == "yes" and gpus < 1:
        raise JobConfigError("scaling.use_gpu=yes but no node of the Ray cluster has a GPU; set scaling.use_gpu=auto "
                             "or no")
    placeable = (gpus if pack else total_gpus) >= k
    if use_gpu == "yes" and not placeable:
        raise JobConfigError(f"scaling.use_gpu=yes and {named} need {k} GPUs "
                             f"({'on one node' if pack else 'in the cluster'}); lower scaling.trainers")
    return 1 if (use_gpu == "yes" or (use_gpu == "auto" and gpus >= 1 and placeable)) else 0


def group_name(run_id: str) -> str:
    """What the names of a run's placement groups start with (a tag of each job's own follows)."""
    return f"zocheck-{run_id}"


class ActorStartError(RunFailedError):
    """An actor Ray could not start; the one-line message names it and Ray's reason."""


def running_here(job: JobConfig, holder: str) -> JobConfigError:
    """The error for a second job of a running run on this cluster (`holder` names the first)."""
    return JobConfigError(f"run {job.run_id!r} is already running on this Ray cluster: {holder}. One job per run: "
                          f"stop that job (SIGTERM or Ctrl-C to its driver, or `ray job stop`) and run this one "
                          f"again to resume the run, or give this job another run_id")


def trainer_bundle(gpus: int) -> dict:
    return {"CPU": 1, **({"GPU": gpus} if gpus else {})}


def job_bundles(job: JobConfig, gpus: int) -> list[dict]:
    """The bundles a job reserves: rank 0, the shadow, then ranks 1..k-1."""
    return [trainer_bundle(gpus), {"CPU": job.shadow.cpus}] + [trainer_bundle(gpus)] * (job.scaling.trainers - 1)


def rank_placements(job: JobConfig, gpus: int, pg: PlacementGroup | None, first_bundle: int,
                    prefix: str) -> tuple[list[PlacementGroup], list[tuple[PlacementGroup, int]]]:
    """(the groups created here, (group, bundle) of the shadow then of each rank): `pack` one STRICT_PACK group,
    `spread` rank 0 and the shadow STRICT_PACK, the other ranks SPREAD. A given `pg` (a Tune trial's) holds them
    all from `first_bundle` on."""
    if pg is not None:
        return [], [(pg, first_bundle + 1), (pg, first_bundle)] + [(pg, first_bundle + 1 + r)
                                                                  for r in range(1, job.scaling.trainers)]
    k = job.scaling.trainers
    if job.scaling.placement == "pack" or k == 1:
        pg = placement_group(job_bundles(job, gpus), strategy="STRICT_PACK", name=prefix)
        return [pg], [(pg, 1), (pg, 0)] + [(pg, 1 + r) for r in range(1, k)]
    home = placement_group(job_bundles(job, gpus)[:2], strategy="STRICT_PACK", name=prefix)
    if scales_up(job):  # the other ranks' groups come once this one is placed (`Placement.start`)
        return [home], [(home, 1), (home, 0)]
    try:
        others = placement_group([trainer_bundle(gpus)] * (k - 1), strategy="SPREAD",
                                 name=f"{prefix}-ranks")
    except RaySystemError:
        remove_placement_group(home)
        raise
    return [home, others], [(home, 1), (home, 0)] + [(others, r - 1) for r in range(1, k)]


def _placed(refs: list) -> list:
    """The placement groups' `ready()` refs that are ready now."""
    return ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []


def _placed_within(refs: list, count: int, seconds: float = PLACEMENT_NOTICE_SECONDS) -> bool:
    """Whether `count` of the `ready()` refs are ready within `seconds` (Ray places a group in a moment)."""
    return count == 0 or len(ray.wait(refs, num_returns=count, timeout=seconds)[0]) == count


class Placement:
    """A run's placement groups, and how each actor is started in them."""

    def __init__(self, job: JobConfig, startup, pg: PlacementGroup | None = None, first_bundle: int = 0,
                 say: Callable[[str], None] | None = None):
        """`startup`: the start-up check's `Startup`; `say`: the progress line naming what a start waits for."""
        self.job, self.gpus, self.say = job, startup.gpus, say or (lambda line: None)
        self.hooks = startup.faults.hooks if startup.faults is not None else None
        self._identity = startup.identity
        self._inputs = hold_inputs(job.run_id, startup.task, startup.model_init) if startup.handed_over else None
        """The rows and functions handed over (`InputsActor`'s name and handle); None: the job's files."""
        # this job's own group names: Ray prints its refusal of a taken one as an error, so they are not the claim
        self._prefix = f"{group_name(job.run_id)}-{uuid.uuid4().hex[:8]}"
        self.groups, places = rank_placements(job, self.gpus, pg, first_bundle, self._prefix)
        self._given, self._scales = pg, scales_up(job, pg)
        self._shadow_place, self._rank_places = places[0], places[1:]
        self._payload = job.model_dump(mode="json")
        env = {**cache_env(), **({PLAIN_ENV: "1"} if plain_host() else {})}
        self._options = {"runtime_env": {"env_vars": env}} if env else {}
        """Hands the user's `NUMBA_CACHE_DIR` and `ZOCHECK_HOST_PLAIN` to every actor."""
        self._ready: list = []
        """Each rank slot's placement group's `ready()`."""
        self._shadow = None
        self._group: TrainerGroup | None = None

    def _strategy(self, place: tuple[PlacementGroup, int]) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(place[0], placement_group_bundle_index=place[1])

    def start(self) -> tuple[ShadowClient, TrainerGroup]:
        """Claim the run with its shadow, then start the trainers beside it once there is room; returns the shadow's
        client and the group. Raises `running_here`, `ActorStartError` or the run's own error, leaving nothing."""
        shadow = self._claim()
        trainers, placed = [], []
        try:
            if self._identity is not None:
                self._identity.record()  # the run's now: two jobs started together both passed its check
            placed = self._wait_for_room()
            for slot in placed:
                trainers.append(self._created(trainer_name(self.job.run_id, slot), lambda: self._start_rank(slot)))
            self._wait_started(shadow, trainers, placed)
        except BaseException:
            for actor in [*trainers, shadow]:
                ray.kill(actor, no_restart=True)
            raise
        self._shadow = shadow
        job = self.job
        vacancies = [Vacancy(trainer_name(job.run_id, slot), self._ready[slot],
                             lambda slot=slot: self._start_rank(slot, waits=True))
                     for slot in range(len(self._rank_places)) if slot not in placed]
        self._group = trainer_group(job, trainers, self.start_standby if job.failure.standby else None,
                                    [trainer_name(job.run_id, slot) for slot in placed], vacancies)
        return ShadowClient(shadow, job.run_id), self._group

    def _claim(self):
        """The run's shadow, its claim (module docstring); where another job holds it, this job's groups go."""
        job, name = self.job, shadow_name(self.job.run_id)
        try:
            return self._created(name, lambda: ShadowActor.options(
                **self._options,
                name=name, namespace=NAMESPACE, num_cpus=job.shadow.cpus,
                max_restarts=job.failure.max_restarts, max_task_retries=-1,
                scheduling_strategy=self._strategy(self._shadow_place),
            ).remote(self._payload, self.hooks))
        except ValueError:  # Ray's ActorAlreadyExistsError (2.5x), a ValueError before it
            if not actor_exists(name):
                raise
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
        raise running_here(job, f"another job of the run created its shadow {name} a moment before this one "
                                f"did, which is {describe_actor(name)}")

    def _created(self, name: str, create: Callable):
        """`create()` of actor `name`; Ray's refusal raises `ActorStartError` (a name taken: Ray's `ValueError`)."""
        try:
            return create()
        except RayError as exc:
            if isinstance(exc, ValueError):
                raise
            raise self._start_error(name, exc) from None

    def _start_error(self, name: str, exc: BaseException) -> ActorStartError:
        return ActorStartError(f"run {self.job.run_id!r} could not start: Ray could not start its actor {name}: "
                               + "; ".join(filter(None, [ray_reason(exc), token_mode_mismatch()])))

    def _wait_started(self, shadow, trainers: list, slots: list[int]) -> None:
        """Wait for every constructor, raising the run's own error as it is and Ray's as `ActorStartError`."""
        run_id = self.job.run_id
        started = [(shadow_name(run_id), shadow.ready.options(max_task_retries=0).remote())] + \
            [(trainer_name(run_id, slot), trainer.readiness.remote()) for slot, trainer in zip(slots, trainers)]
        for name, ref in started:
            try:
                ray.get(ref)
            except RayError as exc:
                if is_ours(exc):
                    raise
                raise self._start_error(name, exc) from None

    def _wait_for_room(self) -> list[int]:
        """Wait until the cluster has placed every rank, or with `scales_up` rank 0 and `min` - 1 others; returns the
        rank slots placed."""
        scaling = self.job.scaling
        groups = self.groups or [self._given]
        ready = {group.id: group.ready() for group in groups}
        what = "rank 0 with the shadow" + ("" if self._scales or scaling.trainers == 1 else
                                           f" and the other {scaling.trainers - 1} ranks")
        self._wait_for(list(ready.values()), len(ready), what)
        if self._scales:  # asked for once rank 0 has its room, so that no other rank can take that room
            extra = [placement_group([trainer_bundle(self.gpus)], name=f"{self._prefix}-rank{r}")
                     for r in range(1, scaling.trainers)]
            self.groups += extra
            self._rank_places += [(group, 0) for group in extra]
            ready.update({group.id: group.ready() for group in extra})
            self._wait_for([ready[group.id] for group in extra], scaling.min_trainers - 1,
                           f"{scaling.min_trainers - 1} of the other {scaling.trainers - 1} ranks")
        self._ready = [ready[group.id] for group, _ in self._rank_places]
        placed = set(_placed(list(ready.values())))
        return [slot for slot, ref in enumerate(self._ready) if ref in placed]

    def _wait_for(self, refs: list, count: int, what: str) -> None:
        """Wait for `count` of the groups' `ready()` refs, saying what for if Ray does not place them at once."""
        if _placed_within(refs, count):
            return
        scaling = self.job.scaling
        trainers = scaling.trainers if scaling.min_trainers is None else \
            f"{{min: {scaling.min_trainers}, max: {scaling.trainers}}}"
        self.say(f"  waiting for the Ray cluster to have room for {what} (scaling.trainers={trainers}, "
                 f"scaling.placement={scaling.placement})")
        if not _placed_within(refs, count, PLACEMENT_WAIT_SECONDS):
            raise GetTimeoutError(f"the Ray cluster had no room for {what} in {PLACEMENT_WAIT_SECONDS} s")

    def _start_rank(self, slot: int, waits: bool = False):
        """Rank `slot`'s process in its bundle (`waits`: it restores only at `rejoin`, as the standby does)."""
        job = self.job
        share = STANDBY_GPU_SHARE if job.failure.standby and self.gpus and slot == 0 else 0
        return TrainerActor.options(
            **self._options,
            name=trainer_name(job.run_id, slot), namespace=NAMESPACE, num_cpus=1, num_gpus=self.gpus - share,
            max_restarts=job.failure.max_restarts, scheduling_strategy=self._strategy(self._rank_places[slot]),
        ).remote(self._payload, self.hooks, slot, waits, self._inputs[0] if self._inputs else None)

    def start_standby(self, name: str):
        """Start the warm standby in rank 0's bundle: it waits, so it takes no CPU of its own."""
        job = self.job
        return TrainerActor.options(
            **self._options,
            name=name, namespace=NAMESPACE, num_cpus=0,
            num_gpus=STANDBY_GPU_SHARE if self.gpus else 0, max_restarts=job.failure.max_restarts,
            scheduling_strategy=self._strategy(self._rank_places[0]),
        ).remote(self._payload, self.hooks, 0, True, self._inputs[0] if self._inputs else None)

    def kill_shadow(self) -> None:
        """Kill the shadow's process as a fault would (Ray restarts it, up to `failure.max_restarts`)."""
        ray.kill(self._shadow, no_restart=False)

    def kill_trainer(self, rank: int) -> None:
        """Kill rank `rank`'s process as a fault would (Ray restarts it)."""
        ray.kill(self._group.ranks[rank], no_restart=False)

    def stop(self) -> bool:
        """End every process (no restart) and remove the groups created here; returns whether all are gone."""
        actors = [*(self._group.kill() if self._group is not None else []),
                  *([self._shadow] if self._shadow is not None else [])]
        if self._shadow is not None:
            try:
                ray.kill(self._shadow, no_restart=True)
            except Exception:  # gone already
                pass
        if self._inputs is not None:
            ray.kill(self._inputs[1], no_restart=True)
        for group in self.groups:
            remove_placement_group(group)
        # no retries: Ray would log each probe of a killed actor as a task it retries
        return wait_until_dead([lambda actor=actor: actor.pid.options(max_task_retries=0).remote() for actor in actors])
