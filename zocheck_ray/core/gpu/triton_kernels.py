"""Fused GPU kernels (Triton) for the trainer's perturbations and update and for replay.

    stepper = KernelStepper(segments, params, exp_avg, exp_avg_sq, config)
    stepper.perturb(seed, scalars.plus, first=True, thresholds=extras)   # p = r(p + r(r(z) * c))
    ...
    stepper.update(seed, scalars)
    replay_triton(state, records, config)                                # a whole step per launch

`_triton_src.zo_kernel` gives the eager oracle's bits on any device, one launch per dtype per
phase; on CPU tensors it runs interpreted, so the tests check it without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from zocheck_ray.core.dtypes import TRAINED
from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core.seeds import MASK32, check_seed, perturbation_seeds
from zocheck_ray.core.layout import moment_prefixes
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.reference import replay_reference
from zocheck_ray.core.scalars import StepScalars
from zocheck_ray.core.validation import check_replay

# Codes shared with _triton_src.py.
PHASE_Z, PHASE_PERTURB, PHASE_UPDATE, PHASE_STEP = 0, 1, 2, 3
OPT_CODES = {"zo-sgd": 0, "zo-adam": 1, "sparse-mezo": 2, "zo-signsgd": 3, "zo-sgd-mmt": 4, "zo-sgd-cons": 5,
             "zo-sgd-sign": 0}  # zo-sgd-sign: ZO-SGD on sign(g)
DTYPE_CODES = {d.torch: code for code, d in enumerate(TRAINED)}
MASK_NONE, MASK_MAKE, MASK_READ, MASK_REGISTERS = 0, 1, 2, 3

COUNTERS_PER_PROGRAM_CUDA = 256
"""Philox counters per program on CUDA: 1024 elements, 8 per thread with 4 warps."""
COUNTERS_PER_PROGRAM_INTERPRETED = 4096
"""... in the interpreter (at most), where each program costs numpy calls."""
NUM_WARPS = 4
SEARCH_STEPS_CUDA = 3
"""At least this many on CUDA, so that the guard's sample and most models compile one variant."""
ENABLE_FP_FUSION = False
"""Never True: a fused multiply-add rounds once where the oracle rounds twice."""
_KEY_TAG = 1 << 32
"""Added to each 32-bit key word so that Triton always sees an int64 (one compiled signature)."""

_SOURCE = Path(__file__).with_name("_triton_src.py")


def available() -> bool:
    """Whether Triton can be imported."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=2)
def _source(interpret: bool):
    """`_triton_src` as its own module object, compiled (`interpret=False`) or interpreted."""
    name = f"zocheck_ray.core._triton_src_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, _SOURCE)
    module = importlib.util.module_from_spec(spec)
    module.INTERPRET = interpret
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def check_device(device: torch.device) -> None:
    if device.type not in ("cuda", "cpu"):
        raise StateMismatchError(f"the Triton kernels run on CUDA (or the CPU, interpreted), not on {device}")


# A test hook, called after every launch with the phase and the tensors it wrote
# (`kernel_guard.inject_fault_for_tests` sets it).
_fault_hook: Callable[[int, list[torch.Tensor]], None] | None = None


def set_launch_hook(hook: Callable[[int, list[torch.Tensor]], None] | None):
    """Make `hook(phase, written_tensors)` run after each launch (None: none); returns the previous hook."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


@dataclass(frozen=True)
class Segment:
    """One tensor as the kernel sees it: its first element's global offset, its size and decay."""

    offset: int
    numel: int
    decay: bool = False


class Plan:
    """The row layout of a group of same-dtype tensors on one device (see `zo_kernel`)."""

    def __init__(self, segments: Sequence[Segment], device: torch.device, weight_decay: float = 0.0):
        self.device = device
        self.interpret = device.type != "cuda"
        row_starts, rows = [], 0
        for s in segments:
            row_starts.append(rows)
            if s.numel:
                rows += ((s.offset + s.numel - 1) >> 2) - (s.offset >> 2) + 1
        row_starts.append(rows)
        self.rows = rows
        self.tensors = len(segments)
        if self.interpret:  # each program costs numpy calls, so few and large ones
            self.b4 = max(16, min(COUNTERS_PER_PROGRAM_INTERPRETED, 1 << max(0, rows - 1).bit_length()))
        else:
            self.b4 = COUNTERS_PER_PROGRAM_CUDA
        self.programs = -(-rows // self.b4)
        starts = np.array(row_starts, dtype=np.int64)
        first_rows = np.arange(self.programs, dtype=np.int64) * self.b4
        prog_first = np.searchsorted(starts, first_rows, side="right") - 1
        prog_last = np.searchsorted(starts, np.minimum(first_rows + self.b4, rows) - 1, side="right") - 1
        span = int((prog_last - prog_first).max()) + 1 if self.programs else 1
        self.search = (span - 1).bit_length()
        if not self.interpret:  # more steps find the same tensor; a common value means the guard compiled it
            self.search = max(SEARCH_STEPS_CUDA, self.search)
        """Binary-search steps a row takes to find its tensor."""
        self.mask_bytes = (rows + 1) // 2
        """Bytes of a packed Sparse-MeZO mask of the group (one bit per element)."""

        def table(values, dtype):
            return torch.as_tensor(np.asarray(values), dtype=dtype).to(device)

        self.offsets = table([s.offset for s in segments], torch.int64)
        self.numels = table([s.numel for s in segments], torch.int64)
        self.row_starts = table(row_starts, torch.int64)
        self.decays = table([int(s.decay and weight_decay > 0) for s in segments], torch.int32)
        self.prog_first = table(prog_first, torch.int32)
        self._pointer_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._dummy_u8 = torch.zeros(8, dtype=torch.uint8, device=device)
        self._dummy_f32 = torch.zeros(8, dtype=torch.float32, device=device)
        self._no_thresholds = torch.zeros(max(1, len(segments)), dtype=torch.float32, device=device)

    def pointers(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors' data pointers as a device table (cached: parameters are updated in place)."""
        key = tuple(t.data_ptr() for t in tensors)
        table = self._pointer_cache.get(key)
        if table is None:
            if len(self._pointer_cache) > 8:
                self._pointer_cache.clear()
            table = self._pointer_cache[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return table

    def launch(self, phase: int, *, seed: int, optimizer: str, dtype: torch.dtype, gaussian: bool,
               params: Sequence[torch.Tensor] = (), exp_avg: Sequence[torch.Tensor] = (),
               exp_avg_sq: Sequence[torch.Tensor] = (), mask_mode: int = MASK_NONE, mask: torch.Tensor | None = None,
               thresholds: torch.Tensor | None = None, z: torch.Tensor | None = None, c_a: float = 0.0,
               c_b: float = 0.0, s: StepScalars | None = None, multi: "MultiTables | None" = None) -> None:
        if self.programs == 0:
            return
        check_seed(seed)
        p_ptrs = self.pointers(params) if params else self.offsets
        m_ptrs = self.pointers(exp_avg) if exp_avg else p_ptrs
        v_ptrs = self.pointers(exp_avg_sq) if exp_avg_sq else p_ptrs
        scal = (s.grad, s.lr, s.weight_decay, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                s.bias_correction1, s.bias_correction2, s.adam_eps) if s is not None else (0.0,) * 10
        kernel = _source(self.interpret).zo_kernel
        kernel[(self.programs,)](
            p_ptrs, m_ptrs, v_ptrs, self.offsets, self.numels, self.row_starts, self.decays,
            self._no_thresholds if thresholds is None else thresholds, self.prog_first, self.tensors, self.rows,
            self._dummy_u8 if mask is None else mask, self._dummy_f32 if z is None else z,
            (seed & MASK32) | _KEY_TAG, (seed >> 32) | _KEY_TAG, c_a, c_b, *scal,
            *(multi.arguments() if multi is not None else (self.offsets, self._dummy_f32, self._dummy_f32, 0.0)),
            PHASE=phase, OPT=OPT_CODES[optimizer], DTYPE=DTYPE_CODES[dtype], GAUSSIAN=gaussian, MASK=mask_mode,
            B4=self.b4, SEARCH=self.search, MULTI=multi is not None, Q=multi.q if multi is not None else 1,
            N_MOVES=multi.n_moves if multi is not None else 0, num_warps=NUM_WARPS, enable_fp_fusion=ENABLE_FP_FUSION,
        )
        if _fault_hook is not None:
            _fault_hook(phase, [z] if phase == PHASE_Z else [*params, *exp_avg, *exp_avg_sq])


def multi_step(config: ZOConfig) -> bool:
    """Whether `config`'s update takes the kernel's MULTI path."""
    return config.num_perturbations > 1 or config.optimizer not in ("zo-sgd", "zo-adam", "sparse-mezo")


@dataclass(frozen=True)
class MultiTables:
    """The MULTI path's tables on the device: each perturbation's key words and G_j, the moves."""

    keys: torch.Tensor
    grads: torch.Tensor
    moves: torch.Tensor
    q: int
    n_moves: int
    momentum: float

    @classmethod
    def of(cls, seed: int, s: StepScalars, device: torch.device) -> "MultiTables":
        seeds = perturbation_seeds(seed, len(s.grads))
        keys = torch.tensor([w for sj in seeds for w in (sj & MASK32, sj >> 32)], dtype=torch.int64, device=device)
        grads = torch.tensor(s.grads, dtype=torch.float32, device=device)
        moves = torch.tensor(list(s.moves) or [0.0], dtype=torch.float32, device=device)
        return cls(keys, grads, moves, len(seeds), len(s.moves), s.momentum)

    def arguments(self) -> tuple:
        return self.keys, self.grads, self.moves, self.momentum


def perturbation_triton(seed: int, offset: int, numel: int, kind: str = "gaussian", device="cuda") -> torch.Tensor:
    """`generator.perturbation` from the kernel: z (float32, 1-D) on `device`, one launch."""
    if kind not in ("gaussian", "rademacher"):
        raise ValueError(f"unknown perturbation kind {kind!r}; expected 'gaussian' or 'rademacher'")
    check_seed(seed)
    device = torch.device(device)
    check_device(device)
    z = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        Plan([Segment(offset, numel)], device).launch(PHASE_Z, seed=seed, optimizer="zo-sgd", dtype=torch.float32,
                                                      gaussian=kind == "gaussian", z=z)
    return z


class KernelStepper:
    """The trainer's phases on its parameters, one launch per dtype per phase; Sparse-MeZO's mask is decided by
    the first perturbation and kept packed."""

    def __init__(self, segments: Sequence[Segment], params: Sequence[torch.Tensor], exp_avg: Sequence[torch.Tensor],
                 exp_avg_sq: Sequence[torch.Tensor], config: ZOConfig):
        self.config = config
        self.device = params[0].device
        check_device(self.device)
        self.gaussian = config.perturbation == "gaussian"
        self.groups = []
        for dtype in DTYPE_CODES:
            members = [i for i, p in enumerate(params) if p.dtype == dtype]
            if not members:
                continue
            plan = Plan([segments[i] for i in members], self.device, config.weight_decay)
            mask = (torch.zeros(max(1, plan.mask_bytes), dtype=torch.uint8, device=self.device)
                    if config.optimizer == "sparse-mezo" else None)
            self.groups.append((dtype, members, plan, [params[i] for i in members],
                                [exp_avg[i] for i in members] if exp_avg else [],
                                [exp_avg_sq[i] for i in members] if exp_avg_sq else [], mask))
        self.multi = multi_step(config)

    def _thresholds(self, members, thresholds):
        if self.config.optimizer != "sparse-mezo":
            return None
        return torch.tensor([thresholds[i] for i in members], dtype=torch.float32, device=self.device)

    def perturb(self, seed: int, c: float, first: bool, thresholds: Sequence[float] = ()) -> None:
        """p = r(p + r(r(z) * c)) on every parameter; `first` decides Sparse-MeZO's mask."""
        sparse = self.config.optimizer == "sparse-mezo"
        for dtype, members, plan, params, _, _, mask in self.groups:
            plan.launch(PHASE_PERTURB, seed=seed, optimizer=self.config.optimizer, dtype=dtype,
                        gaussian=self.gaussian, params=params,
                        mask_mode=(MASK_MAKE if first else MASK_READ) if sparse else MASK_NONE, mask=mask,
                        thresholds=self._thresholds(members, thresholds) if first else None, c_a=c)

    def update(self, seed: int, s: StepScalars) -> None:
        """The optimizer's update after the perturbations (`s.moves`: the moves to make)."""
        sparse = self.config.optimizer == "sparse-mezo"
        multi = MultiTables.of(seed, s, self.device) if self.multi else None
        for dtype, _, plan, params, exp_avg, exp_avg_sq, mask in self.groups:
            plan.launch(PHASE_UPDATE, seed=seed, optimizer=self.config.optimizer, dtype=dtype,
                        gaussian=self.gaussian, params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                        mask_mode=MASK_READ if sparse else MASK_NONE, mask=mask, s=s, multi=multi)

    def replay_step(self, record: StepRecord, s: StepScalars) -> None:
        """A whole step in one pass over each tensor."""
        sparse = self.config.optimizer == "sparse-mezo"
        multi = MultiTables.of(record.seed, s, self.device) if self.multi else None
        for dtype, members, plan, params, exp_avg, exp_avg_sq, _ in self.groups:
            plan.launch(PHASE_STEP, seed=record.seed, optimizer=self.config.optimizer, dtype=dtype,
                        gaussian=self.gaussian, params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                        mask_mode=MASK_REGISTERS if sparse else MASK_NONE,
                        thresholds=self._thresholds(members, record.extras), c_a=s.plus, c_b=s.minus, s=s,
                        multi=multi)


def replay_triton(state: dict[str, torch.Tensor], records: Sequence[StepRecord], config: ZOConfig,
                  *, start_step: int) -> dict[str, torch.Tensor]:
    """Apply `records` to `state` in place with the kernels: same bits as `replay`."""
    layout, all_scalars = check_replay(state, records, config, start_step)
    if not records:
        return state
    params = [state[s.name] for s in layout.params]
    for spec, p in zip(layout.params, params):
        if not p.is_contiguous():
            raise StateMismatchError(f"state[{spec.name!r}] is not contiguous")
    blocks = [[state[prefix + s.name] for s in layout.params] for prefix in moment_prefixes(config.optimizer)]
    stepper = KernelStepper(
        [Segment(s.offset, s.numel, s.decay) for s in layout.params], params,
        blocks[0] if blocks else [], blocks[1] if len(blocks) > 1 else [], config)
    for record, s in zip(records, all_scalars):
        stepper.replay_step(record, s)
    return state


def replay_on_device(state: dict[str, torch.Tensor], records: Sequence[StepRecord], config: ZOConfig,
                     *, start_step: int, backend: str = "triton") -> dict[str, torch.Tensor]:
    """Replay on the state's own device: `replay_triton` for backend "triton", else `replay_reference`."""
    if backend == "triton":
        return replay_triton(state, records, config, start_step=start_step)
    return replay_reference(state, records, config, start_step=start_step)
