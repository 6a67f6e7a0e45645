"""`zocheck-ray recover` and `zocheck-ray verify`.

    zocheck-ray recover --storage s3://bucket/run --to recovered/
    zocheck-ray verify s3://bucket/run --endpoint-url http://127.0.0.1:9000

`recover` rebuilds the exact state from the newest valid durable snapshot and the step
log, prints the step and `state_hash`, and with `--to` writes a `from_pretrained` directory.
`verify` audits the run's durable storage (`zocheck_ray.storage.audit`) and prints the step
range proven. S3 credentials come from the standard AWS chain.
"""

from __future__ import annotations

import argparse
import json
import sys

from zocheck_ray.core.errors import ZOCheckError
from zocheck_ray.storage.errors import ObjectNotFoundError, SnapshotNotFoundError

RECOVERY_FILE = "recovery.json"


def register(sub) -> None:
    p = sub.add_parser("recover", help="rebuild the exact state from durable storage (snapshot + step log)",
                       description="Rebuild the newest exact state from a run's durable storage.")
    p.add_argument("--storage", required=True, metavar="URL",
                   help="the run's storage root (holding snapshots/ and log/): a path, file://, s3://")
    p.add_argument("--to", metavar="DIR", help="write the recovered state here as a loadable model directory")
    p.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint (credentials: AWS chain)")
    p.add_argument("--threads", type=int, metavar="N", help="replay threads (default: all cores)")
    p.set_defaults(func=run_recover)

    v = sub.add_parser("verify", help="prove a run's durable storage: the oldest complete snapshot + log replayed "
                                      "through every later snapshot",
                       description="Replay a run's durable log from the oldest retained snapshot whose log suffix is "
                                   "complete, compare every later snapshot, and state the step range proven. "
                                   "Exit 0: proven; 1: a mismatch or damage (named); 2: storage unusable.")
    v.add_argument("run_url", metavar="RUN_URL",
                   help="the run's storage root, <storage>/<run_id> (a path, file://, s3://BUCKET/PREFIX)")
    v.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint (credentials: AWS chain)")
    v.add_argument("--threads", type=int, metavar="N", help="replay threads (default: all cores)")
    v.add_argument("--json", action="store_true", help="print the audit as JSON")
    v.set_defaults(func=run_verify)


def _options(args) -> dict | None:
    return {"endpoint_url": args.endpoint_url} if args.endpoint_url else None


def run_recover(args: argparse.Namespace) -> int:
    from zocheck_ray.core.hashing import state_hash  # torch: loaded by the commands that use it
    from zocheck_ray.storage.recovery import recover

    if args.threads is not None and args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    try:
        result = recover(args.storage, storage_options=_options(args), threads=args.threads)
        digest = state_hash(result.state)
        for problem in result.problems:
            print(f"warning: skipped: {problem}", file=sys.stderr)
        if args.to:
            write_model_dir(args.to, result, digest, args.storage)
    except (ZOCheckError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (ObjectNotFoundError, SnapshotNotFoundError, ValueError)) else 1  # as verify
    print(f"recovered from snapshot step {result.snapshot.step} + {result.records_replayed} log records")
    print(f"step: {result.step}")
    print(f"state_hash: {digest}")
    if args.to:
        print(f"wrote: {args.to}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from zocheck_ray.storage.audit import audit_run
    from zocheck_ray.storage.snapshot import SnapshotStore

    if args.threads is not None and args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    try:
        store = SnapshotStore(args.run_url, _options(args), create=False)
        found, damaged = store.scan()
        if not found and not damaged:  # nothing there is not a mismatch
            print(f"error: nothing to verify: no committed snapshot under {store.url} (a run commits one as it "
                  "starts); check the URL", file=sys.stderr)
            return 2
        audit = audit_run(store, threads=args.threads)
    except (ZOCheckError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(audit.model_dump_json(indent=2))
    else:
        for note in audit.notes:
            print(f"note: {note}")
        for mismatch in audit.mismatches:
            print(f"MISMATCH: {mismatch}")
        print(audit.describe())
    return 0 if audit.verified else 1


def write_model_dir(url: str, result, digest: str, source: str) -> None:
    """`model.safetensors` (or its shards and index; + `config.json`, `optimizer.safetensors`) and
    `recovery.json` at `url`."""
    from concurrent.futures import ThreadPoolExecutor

    from zocheck_ray.storage.fs import open_storage
    from zocheck_ray.storage.hf_layout import (
        ADAPTER_CONFIG_FILE, ADAPTER_KIND, HF_CONFIG_FILE, MODEL_INDEX_FILE, file_layout, model_index,
    )
    from zocheck_ray.storage.tensorfile import write_tensors

    storage = open_storage(url, create=True)
    adapter = result.meta.adapter_config
    layout = file_layout(result.state, ADAPTER_KIND if adapter is not None else "model")
    with ThreadPoolExecutor(2) as pool:
        futures = []
        for name, shard in layout.items():
            with storage.open_write(name) as f:
                futures.append(write_tensors(f, shard, pool))
        for future in futures:
            future.result()
    if (index := model_index(layout)) is not None:
        storage.write_atomic(MODEL_INDEX_FILE, index)
    if result.meta.hf_config is not None:
        storage.write_atomic(HF_CONFIG_FILE, json.dumps(result.meta.hf_config, indent=2, sort_keys=True).encode())
    if adapter is not None:  # a peft adapter directory: PeftModel.from_pretrained(base, url) loads it
        storage.write_atomic(ADAPTER_CONFIG_FILE, json.dumps(adapter, indent=2, sort_keys=True).encode())
    for name, text in result.meta.text_files.items():  # a byte-level run's tokenizer
        storage.write_atomic(name, text.encode())
    summary = {
        "step": result.step, "state_hash": digest, "storage": source,
        "snapshot_step": result.snapshot.step, "records_replayed": result.records_replayed,
        "run_id": result.meta.run_id, "zo_config": result.config.model_dump(mode="json"),
        "tensors": list(result.state), "problems": result.problems,
    }
    storage.write_atomic(RECOVERY_FILE, json.dumps(summary, indent=2).encode())
