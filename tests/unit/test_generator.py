"""The device-invariant perturbation generator: known answers, invariances, statistics."""

import numpy as np
import pytest
import torch

from zocheck_ray import perturbation
from zocheck_ray.core import generator as G
from zocheck_ray.core.fused import perturbation_cpu

import normality

# Random123's known-answer vectors for Philox4x32-10: counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    out = G.philox4x32(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_any_slice_of_offsets_gives_the_same_values(kind):
    whole = perturbation(99, 1000, 5000, kind)
    for start, length in [(0, 1), (1, 3), (3, 4), (4, 4097), (2048, 2952), (4999, 1)]:
        assert torch.equal(perturbation(99, 1000 + start, length, kind), whole[start : start + length])


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
@pytest.mark.parametrize("seed,offset,numel", [(0, 0, 1), (1, 3, 10), (2**64 - 1, 5, 100_003), (12345, 2**33 + 1, 9000)])
def test_fused_generator_equals_the_torch_oracle(kind, seed, offset, numel):
    assert torch.equal(perturbation_cpu(seed, offset, numel, kind), perturbation(seed, offset, numel, kind))


def test_seed_and_offset_both_matter():
    a = perturbation(1, 0, 1000)
    assert not torch.equal(a, perturbation(2, 0, 1000))
    assert not torch.equal(a, perturbation(1, 1000, 1000))
    assert torch.equal(a, perturbation(1, 0, 1000))


def test_bad_kind_and_seed_are_rejected():
    with pytest.raises(ValueError, match="perturbation kind 'normal'"):
        perturbation(1, 0, 10, "normal")
    with pytest.raises(ValueError, match="seed"):
        perturbation(-1, 0, 10)
    with pytest.raises(ValueError, match="seed"):
        perturbation(2**64, 0, 10)


@pytest.fixture(scope="module")
def million_gaussians():
    return perturbation_cpu(20261129, 0, 1_000_000, "gaussian").double().numpy()


def test_gaussian_mean_and_variance(million_gaussians):
    z = million_gaussians
    n = z.size
    assert abs(z.mean()) < 4.0 / np.sqrt(n)  # 4 standard errors
    assert abs(z.var() - 1.0) < 4.0 * np.sqrt(2.0 / n)
    assert abs(normality.skew(z)) < 4.0 * np.sqrt(6.0 / n)
    assert abs(normality.kurtosis(z)) < 4.0 * np.sqrt(24.0 / n)


def test_gaussian_is_normal_by_dagostino_and_kolmogorov_smirnov(million_gaussians):
    assert normality.dagostino_pearson_pvalue(million_gaussians) > 1e-3
    assert normality.kolmogorov_smirnov_normal_pvalue(million_gaussians) > 1e-3


def test_gaussian_tail_frequencies(million_gaussians):
    z = np.abs(million_gaussians)
    for k in (1.0, 2.0, 3.0, 4.0):
        p = 2 * normality.normal_sf(k)
        observed = (z > k).mean()
        assert abs(observed - p) < 5 * np.sqrt(p * (1 - p) / z.size) + 1e-6, k
    assert z.max() < 5.78  # documented bound: uniforms are odd multiples of 2**-24


def test_neighbouring_elements_are_uncorrelated(million_gaussians):
    z = million_gaussians
    for lag in (1, 2, 3, 4, 5):
        r = np.corrcoef(z[:-lag], z[lag:])[0, 1]
        assert abs(r) < 5.0 / np.sqrt(z.size), lag
    # the two values of a Box-Muller pair are independent too
    assert abs(np.corrcoef(z[0::4], z[1::4])[0, 1]) < 5.0 / np.sqrt(z.size / 4)
    assert abs(np.corrcoef(z[0::4] ** 2, z[1::4] ** 2)[0, 1]) < 5.0 / np.sqrt(z.size / 4)


def test_consecutive_seeds_are_uncorrelated():
    a = perturbation_cpu(1000, 0, 200_000).double().numpy()
    b = perturbation_cpu(1001, 0, 200_000).double().numpy()
    assert abs(np.corrcoef(a, b)[0, 1]) < 5.0 / np.sqrt(a.size)


def test_rademacher_is_balanced_and_pm_one():
    z = perturbation_cpu(7, 0, 1_000_000, "rademacher")
    values, counts = torch.unique(z, return_counts=True)
    assert values.tolist() == [-1.0, 1.0]
    assert normality.binomial_half_pvalue(int(counts[1]), int(z.numel())) > 1e-3


def test_elementary_functions_are_accurate():
    u = torch.linspace(2**-24, 1 - 2**-24, 100_001, dtype=torch.float32)
    assert (G.log_unit(u).double() - u.double().log()).abs().max() < 2e-6
    a = torch.linspace(1e-6, 40.0, 100_001, dtype=torch.float32)
    rel = (G.sqrt_positive(a).double() - a.double().sqrt()).abs() / a.double().sqrt()
    assert rel.max() < 5e-7
    f = torch.linspace(0, 1, 100_001, dtype=torch.float32)[1:-1]
    sin, cos = G.quarter_sincos(f)
    angle = f.double() * np.pi / 2
    assert (sin.double() - angle.sin()).abs().max() < 5e-7
    assert (cos.double() - angle.cos()).abs().max() < 5e-7


def test_a_trainer_process_has_more_numba_threads_than_cores_and_its_generator_one_per_core():
    """A trainer process's numba pool is `RECOVERY_THREADS` or one thread per core, the more (its recovery's
    replay claims chunks: more threads keep its share of busy cores), its steps' generator splits blocks evenly
    over at most one thread per core; a pool the environment sets is kept. Each in a fresh process: numba reads
    the pool's size when it is imported."""
    import os
    import subprocess
    import sys

    from zocheck_ray.actors.trainer_actor import RECOVERY_THREADS

    code = ("from zocheck_ray.actors.trainer_actor import size_numba_pool; size_numba_pool()\n"
            "import numba\nfrom zocheck_ray.core.fused import compute_threads\n"
            "from zocheck_ray.core.cpus import process_cpus\n"
            "steps = compute_threads(); numba.set_num_threads(1)\n"
            "print(numba.config.NUMBA_NUM_THREADS, process_cpus(), steps, compute_threads())")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(max(RECOVERY_THREADS, cores)), str(cores), str(cores), "1"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "NUMBA_NUM_THREADS": "1"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["1", str(cores), "1", "1"]
