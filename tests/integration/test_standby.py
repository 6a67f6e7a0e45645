"""The warm standby, and recovery into a model skeleton, on a real local Ray cluster.

A lost trainer is replaced by the standby at once (no wait for Ray's restart of the
process); the process Ray restarts becomes the next standby. A restarted or promoted
trainer builds its model as a skeleton (nothing initialised or loaded) and takes every
tensor from the shadow's image. Every run must equal the uninterrupted loop at every
step, whatever dies and when.
"""

import os

import pytest
import ray
import torch
import transformers

from reference_runs import SMALL_TASK, assert_exact, job_for, uninterrupted_hashes
from support import wait_until
from zocheck_ray.actors.trainer_actor import RECOVERY_THREADS
from zocheck_ray.control import RunCallback
from zocheck_ray.runtime.injection import FaultInjection
from zocheck_ray.testing import run_with_faults as run
from zocheck_ray.workload.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # conftest: the local Ray instance


def _pid(actor) -> int | None:
    """The pid of the process serving `actor`, or None while it has none (lost, or Ray restarts it)."""
    try:
        return ray.get(actor.pid.remote())
    except ray.exceptions.RayActorError:
        return None


class StandbyReady(RunCallback):
    """Holds the run after each segment until its standby process is up and built (a process Ray restarted
    builds when the controller asks it: asked here as the controller does, not a segment later): the failures
    that follow then meet a ready standby (the promotion is what is under test, not how fast a process starts)."""

    def __init__(self, kill_at: int | None = None):
        self.kill_at, self.killed = kill_at, None
        self.next_built: list[str | None] = []
        """At the end of each promotion: which call had built the next standby (the lost process Ray restarts)."""
        self.promoted_built: list[str | None] = []
        """... and the standby it promoted."""

    def on_segment(self, run, segment):
        if self.kill_at is not None and self.killed is None and segment.progress.step >= self.kill_at:
            assert wait_until(lambda: run.group.standby is not None and _pid(run.group.standby) is not None,
                              timeout=300)
            self.killed = _pid(run.group.standby)
            ray.kill(run.group.standby, no_restart=False)  # Ray restarts it: a standby again, once it is up
            assert wait_until(lambda: _pid(run.group.standby) not in (None, self.killed), timeout=300)
        assert wait_until(lambda: run.group.standby is not None and _pid(run.group.standby) is not None,
                          timeout=300)
        assert wait_until(run.group.prepare_standby, timeout=300)

    def on_recovery(self, run, recovery):
        if recovery.replaced_by == "standby":  # (a call to a restarting process waits for it to be up)
            self.next_built.append(ray.get(run.group.standby.readiness.remote()))
            self.promoted_built.append(ray.get(run.group.ranks[0].readiness.remote()))


class FollowsImages(StandbyReady):
    """A `StandbyReady` that, at the end of the first segment to begin at `at` or later, waits until the shadow
    offers an image of a later step than the segment's first and the standby holds it: the standby copies each
    new image in as the shadow makes it (`TrainerActor.follow`), not only the newest one of a segment's start."""

    def __init__(self, at: int, **kw):
        super().__init__(**kw)
        self.at, self.followed = at, None

    def on_segment(self, run, segment):
        super().on_segment(run, segment)
        if self.followed is None and segment.start >= self.at:
            newest = lambda: run.shadow.metrics().snapshot_step  # noqa: E731
            assert wait_until(lambda: (newest() or 0) > segment.start, timeout=300)
            assert wait_until(lambda: ray.get(run.group.standby.held_image.remote()) == newest(), timeout=300), \
                (segment.start, newest(), ray.get(run.group.standby.held_image.remote()))
            self.followed = (segment.start, newest())


def test_a_lost_trainer_is_replaced_by_the_standby_and_the_restarted_process_stands_by_next(tmp_path):
    """The standby dies first, before any promotion (Ray restarts it: a standby again); then two trainers
    are lost, each replaced by the standby of the moment: the restarted one, then the process Ray restarted
    after the first loss, which meanwhile held each new image of the shadow's."""
    job = job_for(tmp_path, failure={"standby": True})
    ready = FollowsImages(at=18, kill_at=6)
    summary = run(job, fail_at=[13, 25], progress=None, callbacks=[ready])
    assert ready.killed is not None and ready.followed is not None
    # The process Ray restarted after each loss had built nothing when the promotion was done (in its constructor
    # it would have taken the node's cores from it); the controller asked it to once it was up, before it was
    # promoted in turn (the first standby, killed and restarted by Ray, the same way).
    assert ready.next_built == [None, None]
    assert ready.promoted_built == ["prepare", "prepare"]
    first, second = summary.recoveries
    for r in (first, second):
        assert r.replaced_by == "standby" and r.image_source == "memory"
        assert "restart" not in r.phases and {"standby", "rejoin", "restore"} <= set(r.phases)
        assert r.recovered_step == (r.image_step or 0) + r.replayed_records
    assert_exact(summary, uninterrupted_hashes(job))


class StandbyLate(RunCallback):
    """The first standby builds only once `marker` exists: the loss meets it not ready. After the recovery the
    marker is made, and the run is held until the next standby has built (waited for as a state)."""

    def __init__(self, marker):
        self.marker = marker
        self.reported: list[str] = []
        """The standby's state in the shadow's metrics after each segment (what `status` shows)."""
        self.dropped: bool | None = None

    def on_recovery(self, run, recovery):
        self.dropped = run.group.standby is None  # ended, not promoted, so it leaves the cores to the restart
        self.marker.write_text("build")

    def on_segment(self, run, segment):
        self.reported.append(segment.metrics.standby)
        if self.dropped:
            assert run.group.standby is not None  # the next standby, started at this segment's start
            assert wait_until(run.group.prepare_standby, timeout=300)


def test_a_loss_before_the_standby_is_ready_ends_it_and_ray_restarts_the_rank(tmp_path):
    """A standby still building when a rank is lost is not waited for and not promoted: it is ended (its set-up
    would take the cores from Ray's restart of the lost process), the rank comes back through that restart, and
    a new standby starts once the run is steady again; the shadow's metrics (`status`) say which it was."""
    marker = tmp_path / "standby-may-build"
    job = job_for(tmp_path, failure={"standby": True})
    late = StandbyLate(marker)
    summary = run(job, fail_at=[8], progress=None, callbacks=[late],
                  faults=FaultInjection(standby_builds_after=str(marker)))
    (recovery,) = summary.recoveries
    assert recovery.replaced_by == "restart" and late.dropped is True
    assert late.reported[0] == "starting" and late.reported[-1] == "ready"
    assert_exact(summary, uninterrupted_hashes(job))


class ImageHeld(StandbyReady):
    """A `StandbyReady` that, once the run passed `at`, has the standby copy the shadow's image in and waits
    for it (as the controller asks after every segment, without waiting)."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.held = at, None

    def on_segment(self, run, segment):
        super().on_segment(run, segment)
        if self.held is None and segment.progress.step >= self.at:
            self.held = ray.get(run.group.standby.preinstall.remote())


def test_a_standby_that_holds_the_offered_image_replays_only_the_records_and_ends_exact(tmp_path):
    # One image in the run before the failure (the initial state's, step 0): the one the standby copied in
    # while it waited is the one the promotion is offered, whichever step the shadow has reached (no snapshot
    # taken for the recovery: `shadow.recovery_snapshot=False`).
    job = job_for(tmp_path, failure={"standby": True}, optimizer="zo-adam",
                  shadow={"snapshot_interval": 36, "recovery_snapshot": False})
    held = ImageHeld(at=4)
    summary = run(job, fail_at=[13], progress=None, callbacks=[held])
    assert held.held == 0
    (recovery,) = summary.recoveries
    assert recovery.replaced_by == "standby" and recovery.preinstalled and recovery.image_step == 0
    assert 0 < recovery.recovered_step == recovery.replayed_records <= 13
    # replayed on numba's whole pool, which a trainer process sizes beyond its cores on a small node: a neighbour
    # there (the process Ray restarts, the shadow replaying the same records) takes less of the cores from it
    pool = os.environ.get("NUMBA_NUM_THREADS") or max(RECOVERY_THREADS, len(os.sched_getaffinity(0)))
    assert recovery.replay_threads == int(pool)
    assert_exact(summary, uninterrupted_hashes(job))


def test_a_standby_lost_during_its_promotion_ends_exact(tmp_path):
    # offered the newest image and the records after it (no snapshot taken for the recovery: the replica's is
    # test_ray_recovery's test_a_failure_before_the_first_snapshot_and_during_recovery_itself)
    job = job_for(tmp_path, failure={"standby": True}, optimizer="zo-adam", shadow={"recovery_snapshot": False})
    marker = tmp_path / "crashed"
    summary = run(job, fail_at=[13], progress=None, callbacks=[StandbyReady()],
                  faults=FaultInjection(crash_in_recovery_marker=str(marker)))
    assert marker.exists()  # the promoted standby died with the image copied, its records not replayed
    assert summary.recoveries and summary.recoveries[-1].recovered_step <= 13
    assert_exact(summary, uninterrupted_hashes(job))


def test_the_actors_modules_and_the_trainers_arguments_load_neither_torch_nor_the_model_libraries(tmp_path):
    # What a process Ray restarts imports before its constructor runs (see `trainer_actor.py` and
    # `shadow_actor.py`): the actor's module, then its constructor's arguments, unpickled as Ray hands
    # them over (the faults injected into a run travel with them).
    import subprocess
    import sys

    import ray.cloudpickle

    arguments = tmp_path / "arguments.pkl"
    arguments.write_bytes(ray.cloudpickle.dumps(
        (job_for(tmp_path, failure={"standby": True}).model_dump(mode="json"),
         FaultInjection(die_at={0: [13]}, marker_dir=str(tmp_path)))))
    code = ("import pickle, sys, zocheck_ray.actors.trainer_actor, zocheck_ray.actors.shadow_actor; "
            f"job, hooks = pickle.loads(open({str(arguments)!r}, 'rb').read()); assert hooks.die_at == {{0: [13]}}; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'numba', 'zocheck_ray.config', "
            "'zocheck_ray.control') or m.startswith('zocheck_ray.core')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # of the core, only its package, the mechanism that loads its names on first use (core/lazy.py) and the
    # setting of numba's cache directory (core/kernel_cache.py): the standard library only
    assert done.stdout.split() == ["['zocheck_ray.core',", "'zocheck_ray.core.kernel_cache',", "'zocheck_ray.core.lazy']"]


@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory):
    """A Llama saved by `save_pretrained` (rotary buffers: a skeleton must rebuild them as loading does)."""
    directory = tmp_path_factory.mktemp("tiny-llama-saved")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def test_a_restarted_trainer_of_a_saved_model_rebuilds_a_skeleton_and_ends_exact(tmp_path, llama_directory):
    # bf16: the dtype where a skeleton's buffers can go wrong (rotary frequencies stay fp32); the
    # skeleton of every dtype is compared with the loaded model below, without Ray
    job = job_for(tmp_path, model=llama_directory, dtype="bf16", task={**SMALL_TASK, "tokenizer": "byte"})
    summary = run(job, fail_at=[13], progress=None)
    (recovery,) = summary.recoveries
    assert recovery.replaced_by == "restart" and recovery.image_source == "memory"
    assert_exact(summary, uninterrupted_hashes(job))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_skeleton_is_the_loaded_model_without_its_weights(llama_directory, dtype):
    loaded = build_model(llama_directory, dtype)
    bones = build_model(llama_directory, dtype, weights="none")
    assert [(n, p.shape, p.dtype) for n, p in loaded.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in bones.named_parameters()]
    for (name, buffer), (_, rebuilt) in zip(loaded.named_buffers(), bones.named_buffers()):
        assert buffer.dtype == rebuilt.dtype and torch.equal(buffer, rebuilt), name
    tied = loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert (bones.lm_head.weight is bones.model.embed_tokens.weight) == tied  # ties kept, memory once
    # a loaded model's parameters each own their memory: `save_pretrained` takes it as any model
    owned = [p.untyped_storage().data_ptr() for p in loaded.parameters()]
    assert len(set(owned)) == len(owned)
