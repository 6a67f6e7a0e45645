"""`zocheck-ray bench trainer`: a quick run's output holds what is true whatever the timings."""

import json

from benchmarks import trainer
from zocheck_ray.cli import main


def test_bench_trainer_writes_both_steps_their_ratio_and_the_targets(tmp_path, capsys):
    out = tmp_path / "trainer.json"
    assert main(["bench", "trainer", "--model", "tiny-opt", "--dtype", "fp32", "bf16", "--steps", "1", "--rounds", "1",
                 "--batch-size", "2", "--seq-len", "8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["dtype"] for r in doc["results"]] == ["fp32", "bf16"]
    for row in doc["results"]:
        assert row["device"] == "cpu" and row["kernel_backend"] == "eager" and row["params"] > 0
        assert row["zocheck_step_seconds"] > 0 and row["mezo_step_seconds"] > 0
        assert row["ratio"] == row["zocheck_step_seconds"] / row["mezo_step_seconds"]
        assert row["zocheck_own_seconds"] == row["zocheck_step_seconds"] - row["forward_pair_seconds"]
        assert row["zocheck_launches_per_step"] is None  # counted on CUDA only
    assert {t["met"] for t in doc["targets"]} <= {True, False} and len(doc["targets"]) == 2
    assert "ZOCheck step" in capsys.readouterr().out


def test_the_mezo_baseline_steps_like_mezo():
    """The baseline is MeZO's loop: the perturbations cancel up to rounding and the update moves
    the weights along the seeded z by -lr * g."""
    import torch

    p = torch.zeros(1000)
    step = trainer.MezoStep([("w", p)], eps=1e-3, lr=0.1)
    grad = step.step(lambda: p.sum(), seed=3)
    z = torch.empty(1000).normal_(generator=torch.Generator().manual_seed(3))
    assert abs(grad - z.sum().item()) < 1e-2 * z.abs().sum().item()
    assert torch.allclose(p, -0.1 * grad * z, atol=1e-6)
