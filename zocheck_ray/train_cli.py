"""`zocheck-ray train`, `zocheck-ray status` and `zocheck-ray config-reference`.

    zocheck-ray train                     # the embedded default job (see zocheck_ray/demo.py)
    zocheck-ray train [--config FILE] [--set key=value ...] [--steps N] [--storage URL]
                      [--fail-at 20,35,50|none] [--fail-mode software|host|shadow] [--fail-rank R] [--verify]
                      [--json FILE] [--address HOST:PORT]
    zocheck-ray status RUN_ID [--json] [--address HOST:PORT] [--timeout SECONDS]
    zocheck-ray config-reference [--check docs/configuration.md | --write docs/configuration.md]

With no --config, `train` runs the embedded default: one injected trainer failure at
60% of the steps and `--verify` (the durable log replayed and compared with every
step). With a --config, nothing is injected unless --fail-at says so.
Exit status: 0 when the shadow equals the trainer (and the verification passed),
1 when not or when the run fails, 2 for a configuration or input that cannot run (storage
whose every snapshot is damaged too), 143 (SIGTERM) or 130 (SIGINT) when
stopped by that signal at a step boundary with its state durable; the same command
resumes it.

`train` joins the cluster of `--address`, of RAY_ADDRESS or of a `ray start` on this machine,
else starts a local instance for the run, and says which on its `ray:` line. `status` also
finds a run on such a local instance while its driver runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from zocheck_ray import demo
from zocheck_ray.demo import EMBEDDED_DEFAULT, FAILURE_FRACTION, describe
from zocheck_ray.config import JobConfigError, check_job_environment, load_job_config
from zocheck_ray.policies.cli import output_file_error


def _fail_at(text: str) -> list[int]:
    if text in ("", "none"):
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail-at takes comma-separated steps or 'none', got {text!r}") from None


def _losses_text(losses) -> str:
    """The training loss at the end of the first and the last segment, with their steps."""
    if not losses:
        return "-"
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    if first_step == last_step:
        return f"{last:.4f} (step {last_step})"
    return f"{first:.4f} (step {first_step}) -> {last:.4f} (step {last_step})"


def _metrics_text(metrics: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) if metrics else "-"


def result_table(summary, verification=None) -> list[tuple[str, str]]:
    """The final table's rows (name, value) for a `RunSummary` and an optional `Verification`."""
    m = summary.metrics
    evaluations = summary.evaluations
    first = evaluations[min(evaluations)] if evaluations else None
    last = evaluations.get(summary.steps)
    lags = [lag for _, lag in summary.lag_samples]
    persisted = [(f"rank {r.rank}: " if summary.trainers > 1 else "")
                 + f"{r.seconds:.2f} s from the {r.image_source} image of step {r.image_step or 0} "
                 f"(+{r.replayed_records} records), lost at step {r.failed_at_step}" for r in summary.recoveries]
    resumed = summary.resumed_from_step
    rows = [
        ("run", summary.run_id),
        ("steps", str(summary.steps)),
        *([("resumed", f"at step {resumed}, from durable storage (its newest sound snapshot and the logged records "
                       f"after it); {summary.steps - resumed} steps trained after it")] if resumed is not None else []),
        ("task", f"{summary.task.get('kind')}: {summary.task.get('train_rows')} training rows, "
                 f"{summary.task.get('eval_rows')} held-out rows"),
        (("held-out before" if not evaluations or min(evaluations) in (0, resumed) else "held-out first")
         + (f" (step {min(evaluations)})" if evaluations else ""), _metrics_text(first)),
        (f"held-out after (step {summary.steps})", _metrics_text(last)),
        *([("best dev step", f"{summary.best_dev_step} (lowest dev_loss), snapshot "
                             f"{summary.best_dev_snapshot or '- (not durable)'}")]
          if summary.best_dev_step is not None else []),
        ("training loss", _losses_text(summary.losses)),
        ("publish overhead per step",
         f"{summary.publish_us_median:.2f} us (median), trainer step {summary.trainer_seconds_per_step * 1e3:.1f} ms"
         if summary.publish_us_median is not None else "-"),
        ("shadow replay per step", f"{m.replay_seconds_per_step * 1e3:.3f} ms" if m.replay_seconds_per_step else
         "- (nothing replayed)"),
        ("lag (steps)", f"max {max(lags)}, final {m.lag_steps}" if lags else f"final {m.lag_steps}"),
        ("snapshot interval", str(summary.snapshot_interval)),
        ("snapshots taken / persisted", f"{m.snapshots_taken} / {m.snapshots_persisted}"),
        ("resyncs", str(m.resync_count)),
        ("recoveries", "; ".join(persisted) or "none"),
        ("shadow restarts", f"{summary.shadow_restarts} ({summary.resent_records} records re-sent by the trainer)"),
        ("durable", f"snapshot {m.durable_step}, log through step {m.durable_log_step}; "
                    f"{m.persist_failures} failed writes, retried"),
        ("trainer kernels", f"{summary.kernel.device}: {summary.kernel.backend}" if summary.kernel else "-"),
        *([("data-parallel ranks", f"{summary.trainers}: step " + ", ".join(
            f"{s * 1e3:.1f}" for s in summary.rank_seconds_per_step) + " ms by rank, all-gather "
            + (f"{summary.collective_seconds_per_step * 1e3:.3f} ms per step" if summary.collective_seconds_per_step
               is not None else "-")),
           ("every rank == shadow", "yes, bit for bit" if set(summary.rank_state_hashes) == {summary.shadow_state_hash}
            else "NO")] if summary.trainers > 1 else []),
        ("warnings", "; ".join(summary.warnings) or "none"),
        ("final state_hash", summary.final_state_hash[:16] + "..."),
        ("shadow == trainer", "yes, bit for bit" if summary.final_state_hash == summary.shadow_state_hash else "NO"),
    ]
    if verification is not None:
        start = "the initial state" if verification.from_initial_state else \
            f"the snapshot at step {verification.proven_from_step}"
        rows.append(("durable log replay", (
            f"verified: {verification.log_records} records replayed from {start} match the trainer at "
            f"{verification.steps_checked} steps ({verification.audit}); snapshot + log suffix = final state at "
            f"step {verification.recovery_image_step}" if verification.verified else
            "MISMATCH: " + "; ".join(verification.mismatches))))
    return rows


STATUS_SECONDS = 30.0
"""Default seconds `zocheck-ray status` waits for the shadow's metrics."""


def train(args: argparse.Namespace) -> int:
    embedded = args.config is None
    try:  # checked before the heavy libraries load, so a bad job fails at once
        job = load_job_config(args.config, args.set, base=EMBEDDED_DEFAULT if embedded else None,
                              steps=args.steps, storage=args.storage)
        check_job_environment(job)  # a relative path in a submitted job: refused before Ray starts
        faults = _fault_plan(args, embedded)
        faults.check(job)  # before anything is said
    except JobConfigError as exc:
        print(f"zocheck-ray train: {exc}", file=sys.stderr)
        return 2
    if args.json and (problem := output_file_error("--json", args.json)) is not None:
        print(f"zocheck-ray train: {problem}", file=sys.stderr)
        return 2

    from zocheck_ray.actors.connect import use_token_at_hand

    use_token_at_hand(args.address)  # before Ray is imported: it reads RAY_AUTH_MODE then
    from zocheck_ray.control import RunFailedError, run
    from zocheck_ray.actors.connect import RayConnectionError
    from zocheck_ray.control.stop import RunStopped
    from zocheck_ray.verify import verify_run

    verify = embedded if args.verify is None else args.verify
    if embedded:
        print(f"{describe(job)}\n  verification against the durable log: {'on' if verify else 'off'}", flush=True)
    try:
        summary = run(job, faults=faults, address=args.address)
    except (JobConfigError, RayConnectionError) as exc:
        print(f"zocheck-ray train: {exc}", file=sys.stderr)
        return 2
    except RunFailedError as exc:
        print(f"zocheck-ray train: {exc}", file=sys.stderr)
        return 1
    except RunStopped as stopped:  # SIGTERM or SIGINT: its one line is printed; 128 + the signal's number
        sys.stdout.flush()
        return stopped.code
    verification = verify_run(job, summary) if verify else None
    _report(summary, verification, args.json)
    exact = summary.final_state_hash == summary.shadow_state_hash
    return 0 if exact and (verification is None or verification.verified) else 1


def _fault_plan(args: argparse.Namespace, embedded: bool):
    """`--fail-at`'s plan, or the embedded default's (once, at `FAILURE_FRACTION` of the run)."""
    from zocheck_ray.control.faults import FaultPlan

    if args.fail_at is None and embedded:
        return FaultPlan(fraction=FAILURE_FRACTION, mode=args.fail_mode, rank=args.fail_rank)
    return FaultPlan(steps=tuple(args.fail_at or ()), mode=args.fail_mode, rank=args.fail_rank)


def _report(summary, verification, json_path: str | None) -> None:
    """The result table, the verification, and `--json`."""
    print()
    rows = result_table(summary, verification)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    if verification is not None:
        print("verified" if verification.verified else "NOT verified: the durable log does not reproduce the run")
    if json_path:
        doc = summary.model_dump(mode="json")
        doc["verification"] = verification.model_dump(mode="json") if verification is not None else None
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {json_path}")


def status(args: argparse.Namespace) -> int:
    from zocheck_ray.actors.connect import RayConnectionError, connect_ray, recorded_address, use_token_at_hand

    address = args.address or (None if os.environ.get("RAY_ADDRESS") else recorded_address(args.run_id))
    use_token_at_hand(address or "auto")  # before Ray is imported: it reads RAY_AUTH_MODE then
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from zocheck_ray.actors.names import NAMESPACE, actor_status, describe_actor, shadow_name

    if not args.timeout > 0:
        print(f"zocheck-ray status: --timeout must be a positive number of seconds, got {args.timeout:g}",
              file=sys.stderr)
        return 2
    if not ray.is_initialized():
        try:
            connect_ray(address or "auto")
        except RayConnectionError as exc:
            print(f"zocheck-ray status: {exc}" + ("" if address else "; a run's `zocheck-ray train` prints its "
                                                                    "cluster's address on its `ray:` line")
                  + "; a finished run's figures are in its `train --json` summary and `zocheck-ray verify "
                    "STORAGE/RUN_ID`", file=sys.stderr)
            return 2
    name = shadow_name(args.run_id)
    try:
        shadow = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        print(f"zocheck-ray status: no running shadow for run {args.run_id!r} on the Ray cluster at "
              f"{ray.get_runtime_context().gcs_address}; a finished run's figures are in its `train --json` summary "
              "and `zocheck-ray verify STORAGE/RUN_ID`", file=sys.stderr)
        return 2
    if (group := waiting_group(args.run_id)) is not None:  # its shadow cannot answer before it is placed
        return _starting(args, f"its placement group {group} waits for room in the Ray cluster (the trainer's and "
                               "the shadow's resources on one node)")
    try:
        metrics = ray.get(shadow.metrics.remote(), timeout=args.timeout)
    except GetTimeoutError:
        found = actor_status(name)
        if found is not None and found.state in STARTING_STATES:
            return _starting(args, f"its shadow's process is being created (Ray reports it {found.describe()})")
        print(f"zocheck-ray status: the shadow of run {args.run_id!r} (actor {name}) did not answer within "
              f"{args.timeout:g} s; Ray reports it {describe_actor(name)}", file=sys.stderr)
        return 1
    except RayActorError as exc:
        print(f"zocheck-ray status: the shadow of run {args.run_id!r} (actor {name}) is gone: "
              f"{str(exc).strip().splitlines()[0]}; Ray reports it {describe_actor(name)}", file=sys.stderr)
        return 1
    if metrics.source == "none":  # no trainer has handed it a state yet
        return _starting(args, "its shadow waits for the trainer's first state (the trainer builds its model, or "
                               "restores it)")
    doc = {"state": "running", **metrics.model_dump(mode="json"),
           "hyperparameter_changes": _recorded_changes(shadow, args.timeout)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for key, value in doc.items():
            print(f"{key:28s} {describe_changes(value) if key == 'hyperparameter_changes' else value}")
    return 0


STARTING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
"""Ray's states of an actor whose first process is not up yet."""


def _starting(args: argparse.Namespace, why: str) -> int:
    """A run that has not trained yet: one line (`--json`: its state and why), exit 0."""
    if args.json:
        print(json.dumps({"run_id": args.run_id, "state": "starting", "starting": why}, indent=2))
    else:
        print(f"run {args.run_id!r} is starting: {why}")
    return 0


def own_group(run_id: str) -> re.Pattern:
    """The name of a run's first placement group (its shadow's and rank 0's): `control.placement.group_name` and the
    job's tag, written out here so that `status` does not import torch with the controller."""
    return re.compile(re.escape(f"zocheck-{run_id}-") + "[0-9a-f]{8}")


def waiting_group(run_id: str) -> str | None:
    """The run's first placement group while Ray has not placed it (the GCS's table: no dashboard needed)."""
    from ray.util import placement_group_table

    pattern = own_group(run_id)
    for entry in placement_group_table().values():
        if pattern.fullmatch(entry.get("name") or "") and entry.get("state") == "PENDING":
            return entry["name"]
    return None


def _recorded_changes(shadow, timeout: float) -> list[dict] | str:
    """The hyperparameter changes in the run's identity.json, read by the shadow (which holds the run's storage and
    its credentials); what went wrong, in words, where it could not."""
    import ray

    try:
        return ray.get(shadow.__ray_call__.remote(identity_changes), timeout=timeout)
    except Exception as exc:  # a store that does not answer: said in the output, the metrics still shown
        lines = str(exc).strip().splitlines()
        return f"unknown: {lines[-1] if lines else type(exc).__name__}"


def identity_changes(shadow_actor) -> list[dict]:
    """Run in the shadow's process: the `changes` of `control.identity`'s record of the shadow's run, in order."""
    from zocheck_ray.control.identity import IDENTITY_FILE, RunIdentity
    from zocheck_ray.storage.fs import open_storage

    job = shadow_actor.job
    storage = open_storage(job.run_url, job.storage_options, create=False)
    if not storage.exists(IDENTITY_FILE):
        return []
    identity = RunIdentity.model_validate_json(storage.read_bytes(IDENTITY_FILE))
    return [change.model_dump(mode="json") for change in identity.changes]


def describe_changes(changes: list[dict] | str) -> str:
    """`hyperparameter_changes` in one line: `zo.lr 0.005 -> 0.001 from step 40; ...`, or `none`."""
    if isinstance(changes, str):
        return changes
    return "; ".join(f"{c['field']} {c['old']:g} -> {c['new']:g} from step {c['step']}" for c in changes) or "none"


def add_train_arguments(p: argparse.ArgumentParser, with_config: bool = True) -> None:
    if with_config:
        p.add_argument("--config", help="job YAML (see the configuration reference); none: the embedded default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set zo.lr=1e-3 --set task.batch_size=8")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (sets the job's `steps`); a run resumed "
                                                        "from its storage trains up to step N")
    p.add_argument("--storage", help="durable storage root URL (path, file://, s3://)")
    p.add_argument("--fail-at", type=_fail_at, default=None,
                   help="kill the trainer at these steps (default: once at 60%% of the steps for the embedded "
                        "default, never with --config)")
    p.add_argument("--fail-mode", choices=["software", "host", "shadow"], default="software",
                   help="software: kill the trainer process; host: lose both processes and their in-memory "
                        "images, so the pair comes back from durable storage; shadow: kill the shadow process "
                        "(it comes back from durable storage, the trainer re-sends what it lacks)")
    p.add_argument("--fail-rank", type=int, default=0, metavar="R",
                   help="with trainers > 1: the data-parallel rank whose process --fail-at kills (default 0)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="after the run, replay the durable log from the oldest retained snapshot whose log is "
                        "complete (and from the initial state when the whole log is kept) and compare every later "
                        "snapshot, every hashed step and the final state (default: on for the embedded default, "
                        "off with --config)")
    p.add_argument("--address", help="Ray cluster address HOST:PORT (default: RAY_ADDRESS, else the cluster `ray "
                                     "start` runs on this machine, else a local instance for the run; `local`: a "
                                     "local instance in any case)")
    p.add_argument("--json", metavar="FILE", help="write the run summary (and the verification) as JSON")


def config_reference(args: argparse.Namespace) -> int:
    from zocheck_ray.reference_docs import check_reference, render_reference, write_reference

    if args.check:
        if not os.path.isfile(args.check):
            print(f"zocheck-ray config-reference: {args.check} does not exist; --check takes the configuration "
                  "reference (docs/configuration.md in the repository), --write creates it", file=sys.stderr)
            return 2
        stale = check_reference(args.check)
        if stale:
            print(f"zocheck-ray config-reference: {stale}", file=sys.stderr)
            return 1
        print(f"{args.check}: the configuration and metrics reference is up to date")
        return 0
    if args.write:
        changed = write_reference(args.write)
        print(f"{args.write}: {'updated' if changed else 'already up to date'}")
        return 0
    print(render_reference())
    return 0


def register(commands) -> None:
    p = commands.add_parser("train", help="run a ZO fine-tuning job with a shadow on Ray (no --config: the "
                                          "embedded default job)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.set_defaults(func=train)
    d = commands.add_parser("demo", help="the embedded default job (same as `train` with no --config)",
                            description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(d, with_config=False)
    d.set_defaults(func=train, config=None)
    r = commands.add_parser("config-reference", help="the configuration and metrics reference, from the schema")
    where = r.add_mutually_exclusive_group()
    where.add_argument("--check", metavar="FILE", help="exit 1 when FILE's generated section is out of date "
                                                      "(the repository's: docs/configuration.md)")
    where.add_argument("--write", metavar="FILE", help="rewrite FILE's generated section")
    r.set_defaults(func=config_reference)
    s = commands.add_parser("status", help="metrics of a running job's shadow")
    s.add_argument("run_id")
    s.add_argument("--address", help="Ray cluster address HOST:PORT (default: RAY_ADDRESS, else the local instance "
                                     "a running `zocheck-ray train` started for the run, else the cluster on this "
                                     "machine)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--timeout", type=float, default=STATUS_SECONDS, metavar="SECONDS",
                   help=f"how long to wait for the shadow's answer (default {STATUS_SECONDS:g})")
    s.set_defaults(func=status)
