"""Recovery from durable storage (DESIGN.md sections 4, 8): snapshot + replayed log = the trainer's bits.

A real `ZOOptimizer` trains; its records go to a `StepLog` and its state to a
`SnapshotStore` every few steps. `recover_state` must reproduce the trainer's
`state_hash` at every step, also when the newest snapshot or a log segment is damaged.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from zocheck_ray.core import ZOConfig, ZOOptimizer, state_hash
from zocheck_ray.storage import (
    CorruptSnapshotError,
    SnapshotNotFoundError,
    SnapshotStore,
    StepLog,
    StorageError,
    recover,
    recover_state,
)
from zocheck_ray.storage import cli as storage_cli
from zocheck_ray.storage.snapshot import snapshot_dir
from zocheck_ray.storage.steplog import SEGMENT_MAGIC


def make_params(dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [
        ("encoder.weight", (torch.randn(24, 16, generator=gen) * 0.1).to(dtype)),
        ("encoder.bias", torch.zeros(24).to(dtype)),
        ("head.weight", (torch.randn(4, 24, generator=gen) * 0.1).to(dtype)),
    ]


class Trainer:
    """A ZO training loop that logs every step and snapshots every `every` steps, like the actors."""

    def __init__(self, url: str, options: dict | None, config: ZOConfig, every: int = 5, keep: int = 2,
                 dtype=torch.float32, named_params=None):
        self.config = config
        self.params = named_params or make_params(dtype)
        self.opt = ZOOptimizer(self.params, config)
        self.store = SnapshotStore(url, options, keep=keep)
        self.log = StepLog(url, options, seal_records=4)
        self.every = every
        self.hashes = {0: state_hash(self.opt.state_tensors())}
        self.meta = {"run_id": "test-run", "zo_config": config}
        self._snapshot()

    def loss(self) -> float:
        x = torch.linspace(-1, 1, 16)
        h = torch.tanh(self.params[0][1].float() @ x + self.params[1][1].float())
        return float(((self.params[2][1].float() @ h) ** 2).sum())

    def _snapshot(self) -> None:
        frozen = {k: v.clone() for k, v in self.opt.state_tensors().items()}
        self.store.save(self.opt.step_index, frozen, self.meta)
        self.log.collect_garbage(keep_from_step=self.store.committed()[-1].step)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            record = self.opt.step(self.loss, seed=7919 * self.opt.step_index + 1)
            self.log.append(record)
            self.log.flush()
            self.hashes[self.opt.step_index] = state_hash(self.opt.state_tensors())
            if self.opt.step_index % self.every == 0:
                self._snapshot()


@pytest.mark.parametrize("optimizer", ["zo-sgd", "zo-adam", "sparse-mezo"])
def test_recovery_reproduces_the_trainer_after_every_step(tmp_path, optimizer):
    url = str(tmp_path / "run")
    trainer = Trainer(url, None, ZOConfig(optimizer=optimizer, lr=1e-2, eps=1e-3, weight_decay=0.01))
    for _ in range(17):
        trainer.step()
        state, step = recover_state(url)
        assert step == trainer.opt.step_index
        assert state_hash(state) == trainer.hashes[step]
    for name, tensor in trainer.opt.state_tensors().items():
        assert torch.equal(state[name], tensor), name


def test_recovery_on_s3_is_exact(s3_bucket):
    url, options = s3_bucket
    trainer = Trainer(url, options, ZOConfig(optimizer="zo-adam", lr=1e-2), every=4)
    trainer.step(10)
    trainer.log.seal()  # on an object store a record is durable once its segment is sealed
    result = recover(url, storage_options=options)
    assert (result.snapshot.step, result.records_replayed, result.step) == (8, 2, 10)
    assert state_hash(result.state) == trainer.hashes[10]


def test_a_corrupt_newest_snapshot_falls_back_to_the_older_one_and_a_longer_replay(tmp_path):
    url = str(tmp_path / "run")
    trainer = Trainer(url, None, ZOConfig(lr=1e-2), every=5)
    trainer.step(13)  # snapshots at 5 and 10 are kept; the log still reaches back to 5
    model = os.path.join(url, snapshot_dir(10), "model.safetensors")
    with open(model, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    result = recover(url)
    assert (result.snapshot.step, result.records_replayed, result.step) == (5, 8, 13)
    assert state_hash(result.state) == trainer.hashes[13]
    assert any("model.safetensors" in p for p in result.problems)


def test_a_damaged_log_recovers_to_the_last_intact_record(tmp_path):
    url = str(tmp_path / "run")
    trainer = Trainer(url, None, ZOConfig(lr=1e-2), every=10)
    trainer.step(19)  # snapshot at 10; records in segments of 4: seg-12 holds steps 12..15
    size = trainer.log.read(-1)[0].size
    with open(os.path.join(url, "log", "seg-000000000012.zlog"), "r+b") as f:
        f.seek(len(SEGMENT_MAGIC) + 3 * size + size // 2)  # inside step 15
        f.write(b"\x00\x00")
    result = recover(url)
    assert (result.snapshot.step, result.step) == (10, 15)
    assert state_hash(result.state) == trainer.hashes[15]
    assert any("seg-000000000012.zlog" in p for p in result.problems)


def test_nothing_to_recover_from_is_an_error_naming_the_store(tmp_path):
    url = str(tmp_path / "run")
    SnapshotStore(url)
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot under .*run"):
        recover_state(url)
    store = SnapshotStore(url)
    store.save(0, dict(make_params()))
    with pytest.raises(StorageError, match="carries no zo_config; pass config="):
        recover_state(url)
    state, step = recover_state(url, config=ZOConfig())
    assert step == 0 and state_hash(state) == state_hash(dict(make_params()))


def test_every_snapshot_corrupt_is_an_error(tmp_path):
    url = str(tmp_path / "run")
    trainer = Trainer(url, None, ZOConfig(lr=1e-2), every=2)
    trainer.step(4)
    for step in (2, 4):
        os.remove(os.path.join(url, snapshot_dir(step), "model.safetensors"))
    with pytest.raises(CorruptSnapshotError, match="every committed snapshot .* is corrupt"):
        recover(url)


# ---------------------------------------------------------------------- the recover command


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zocheck-ray")
    storage_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_storage_commands_are_registered_with_the_cli():
    from zocheck_ray import cli

    assert "zocheck_ray.storage.cli" in cli.COMMAND_MODULES


@pytest.mark.parametrize("optimizer,shard_bytes", [("zo-sgd", None), ("zo-adam", None), ("zo-adam", 16 << 10)])
def test_recover_command_writes_a_model_directory_hugging_face_loads(tmp_path, capsys, monkeypatch, optimizer,
                                                                     shard_bytes):
    from transformers import AutoModelForCausalLM

    from zocheck_ray.core import hashing
    from zocheck_ray.workload import build_model, trainable_parameters

    if shard_bytes:
        monkeypatch.setattr(hashing, "SHARD_BYTES", shard_bytes)  # snapshots and the model directory sharded

    model = build_model("tiny-opt", seed=5)
    batch = torch.arange(12).reshape(2, 6) % 128
    url = str(tmp_path / "run")
    trainer = Trainer(url, None, ZOConfig(optimizer=optimizer, lr=1e-3), every=3,
                      named_params=trainable_parameters(model))
    trainer.meta["hf_config"] = model.config
    trainer._snapshot()
    trainer.loss = lambda: model(input_ids=batch, labels=batch).loss
    trainer.step(5)
    out = tmp_path / "recovered"

    assert run_cli(["recover", "--storage", url, "--to", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step: 5\n" in printed and f"state_hash: {trainer.hashes[5]}\n" in printed
    summary = json.loads((out / "recovery.json").read_text())
    assert (summary["step"], summary["state_hash"], summary["snapshot_step"]) == (5, trainer.hashes[5], 3)
    if shard_bytes:
        assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and list(out.glob("optimizer-*.safetensors"))
    else:
        assert (out / "optimizer.safetensors").exists() == (optimizer == "zo-adam")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, p in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], p.detach()), name


def test_recover_command_reports_bad_storage_by_url(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert run_cli(["recover", "--storage", missing]) == 2  # input that cannot be used: 2, as verify says it
    assert f"error: {missing} does not exist" in capsys.readouterr().err
    assert run_cli(["recover", "--storage", "gs://bucket/run"]) == 2
    assert "unsupported storage URL scheme 'gs'" in capsys.readouterr().err
