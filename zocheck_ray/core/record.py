"""`StepRecord`: everything a replay needs to know about one ZO step, in ~60 bytes.

Wire format (little-endian), CRC-32 over everything before it:

    u16 magic 0x5A52 | u8 version | u8 optimizer | u32 n_extras
    u64 step | u64 seed | u64 fingerprint | f64 projected_grad | f64 lr | f64 eps
    [version 2: u16 n_more_grads | u8 decision | u8 0 | f64 more_grads[n_more_grads]]
    f32 extras[n_extras] | u32 crc32

Version 2 only where needed: q > 1 perturbations (n-SPSA) or ZO-SGD-Cons' decision (so a
replay needs no forward pass); every other record stays version 1, readable by old readers.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

from zocheck_ray.core.errors import CorruptRecordError, NonFiniteError
from zocheck_ray.core.seeds import check_seed

MAGIC = 0x5A52
VERSION = 1
VERSION_MULTI = 2
"""Records with more than one projected gradient or a decision."""
OPTIMIZER_CODES = {"zo-sgd": 0, "zo-adam": 1, "sparse-mezo": 2, "zo-sgd-sign": 3, "zo-sgd-mmt": 4, "zo-sgd-cons": 5,
                   "zo-signsgd": 6}
RULES_VERSION = 2
"""The update rules' version, in every fingerprint and manifest: other rules replay into another state."""
# 1: zo-sgd-sign was the elementwise sign (now zo-signsgd); 1-D tensors and "norm" names were not decayed
OPTIMIZER_NAMES = {code: name for name, code in OPTIMIZER_CODES.items()}
_HEADER = struct.Struct("<HBBIQQQddd")
_MULTI = struct.Struct("<HBx")
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
MAX_EXTRAS = 1 << 24
MAX_GRADS = 1 << 16
DECISIONS = {"zo-sgd-cons": (0, 1, 2)}
"""The decisions an optimizer's records may carry (every other optimizer: 0 only)."""
CONS_START, CONS_DESCENT, CONS_ASCENT = 0, 1, 2
"""ZO-SGD-Cons' candidates: the step's start, the descent step, the ascent step."""


class IncompleteRecordError(CorruptRecordError):
    """The buffer ends inside a record (a torn tail, when it is the last one)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One ZO step: the seed of z, the projected gradient g and the scalars of the update."""

    step: int
    """0-based global step index; a ZO-Adam step uses t = step + 1."""
    seed: int
    """Perturbation seed (unsigned 64-bit)."""
    projected_grad: float
    """g = (loss+ - loss-) / (2 eps), computed on the trainer in float64."""
    lr: float
    eps: float
    fingerprint: int
    """Layout and config id (`Layout.fingerprint`) of the state this step applies to."""
    optimizer: str = "zo-sgd"
    extras: tuple[float, ...] = ()
    """Sparse-MeZO: one magnitude threshold per parameter tensor (float32 values)."""
    more_grads: tuple[float, ...] = ()
    """n-SPSA (q > 1 perturbations): the projected gradients of perturbations 1 .. q-1, float64."""
    decision: int = 0
    """ZO-SGD-Cons: the candidate the trainer kept (0 the start, 1 the descent step, 2 the ascent step)."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step < 2**64:
            raise ValueError(f"StepRecord.step must be an integer in [0, 2**64), got {self.step!r}")
        check_seed(self.seed)
        if not isinstance(self.fingerprint, int) or not 0 <= self.fingerprint < 2**64:
            raise ValueError(f"StepRecord.fingerprint must be an unsigned 64-bit integer, got {self.fingerprint!r}")
        if self.optimizer not in OPTIMIZER_CODES:
            raise ValueError(f"StepRecord.optimizer {self.optimizer!r} is not one of {sorted(OPTIMIZER_CODES)}")
        for field in ("projected_grad", "lr", "eps"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise NonFiniteError(f"step {self.step}: {field} must be finite, got {value!r}")
        if self.lr < 0:
            raise ValueError(f"step {self.step}: lr must be >= 0, got {self.lr!r}")
        if self.eps <= 0:
            raise ValueError(f"step {self.step}: eps must be > 0, got {self.eps!r}")
        if len(self.extras) > MAX_EXTRAS:
            raise ValueError(f"step {self.step}: {len(self.extras)} extras exceed {MAX_EXTRAS}")
        for value in self.extras:
            if not math.isfinite(value):
                raise NonFiniteError(f"step {self.step}: extras must be finite, got {value!r}")
        if len(self.more_grads) >= MAX_GRADS:
            raise ValueError(f"step {self.step}: {len(self.more_grads) + 1} projected gradients exceed {MAX_GRADS - 1}")
        for value in self.more_grads:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise NonFiniteError(f"step {self.step}: projected gradients must be finite, got {value!r}")
        if self.decision not in DECISIONS.get(self.optimizer, (0,)) or isinstance(self.decision, bool):
            raise ValueError(f"step {self.step}: decision {self.decision!r} is not one of "
                             f"{DECISIONS.get(self.optimizer, (0,))} for {self.optimizer}")

    @property
    def grads(self) -> tuple[float, ...]:
        """The step's projected gradients, one per perturbation, in the trainer's order."""
        return (self.projected_grad, *self.more_grads)

    @property
    def _multi(self) -> bool:
        return bool(self.more_grads) or self.optimizer in DECISIONS

    @property
    def size(self) -> int:
        multi = _MULTI.size + 8 * len(self.more_grads) if self._multi else 0
        return HEADER_SIZE + multi + 4 * len(self.extras) + _CRC.size

    def to_bytes(self) -> bytes:
        body = _HEADER.pack(
            MAGIC, VERSION_MULTI if self._multi else VERSION, OPTIMIZER_CODES[self.optimizer], len(self.extras),
            self.step, self.seed, self.fingerprint,
            float(self.projected_grad), float(self.lr), float(self.eps),
        )
        if self._multi:
            body += _MULTI.pack(len(self.more_grads), self.decision)
            body += struct.pack(f"<{len(self.more_grads)}d", *map(float, self.more_grads))
        body += struct.pack(f"<{len(self.extras)}f", *self.extras)
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepRecord":
        """Decode exactly one record; raises `CorruptRecordError` on any damage."""
        record, end = cls.read_from(data, 0)
        if end != len(data):
            raise CorruptRecordError(f"{len(data) - end} trailing bytes after the record")
        return record

    @classmethod
    def read_from(cls, buffer, offset: int = 0) -> tuple["StepRecord", int]:
        """Decode the record at `offset`; returns it and the offset after it.

        Raises `IncompleteRecordError` if the buffer ends inside it, `CorruptRecordError` if it is damaged."""
        view = memoryview(buffer)
        if len(view) - offset < HEADER_SIZE:
            raise IncompleteRecordError(f"{len(view) - offset} bytes at offset {offset}, a record header needs {HEADER_SIZE}")
        magic, version, opt, n_extras, step, seed, fp, g, lr, eps = _HEADER.unpack_from(view, offset)
        if magic != MAGIC:
            raise CorruptRecordError(f"bad record magic 0x{magic:04x} at offset {offset}")
        if version not in (VERSION, VERSION_MULTI):
            raise CorruptRecordError(f"unsupported record version {version} at offset {offset}")
        if n_extras > MAX_EXTRAS:
            raise CorruptRecordError(f"record at offset {offset} claims {n_extras} extras")
        position = offset + HEADER_SIZE
        n_more, decision = 0, 0
        if version == VERSION_MULTI:
            if len(view) < position + _MULTI.size:
                raise IncompleteRecordError(f"record at offset {offset} ends inside its gradient count")
            n_more, decision = _MULTI.unpack_from(view, position)
            position += _MULTI.size
        end = position + 8 * n_more + 4 * n_extras + _CRC.size
        if len(view) < end:
            raise IncompleteRecordError(f"record at offset {offset} needs {end - offset} bytes, {len(view) - offset} present")
        (crc,) = _CRC.unpack_from(view, end - _CRC.size)
        if zlib.crc32(view[offset : end - _CRC.size]) != crc:
            raise CorruptRecordError(f"CRC mismatch in the record at offset {offset}")
        if opt not in OPTIMIZER_NAMES:
            raise CorruptRecordError(f"unknown optimizer code {opt} in the record at offset {offset}")
        more = struct.unpack_from(f"<{n_more}d", view, position)
        extras = struct.unpack_from(f"<{n_extras}f", view, position + 8 * n_more)
        try:
            record = cls(step, seed, g, lr, eps, fp, OPTIMIZER_NAMES[opt], tuple(extras), tuple(more), decision)
        except ValueError as exc:
            raise CorruptRecordError(f"record at offset {offset} is invalid: {exc}") from exc
        return record, end


def decode_records(buffer) -> list[StepRecord]:
    """The whole records at the start of `buffer`, in order; an incomplete tail is left out, damage raises."""
    records, offset = [], 0
    view = memoryview(buffer)
    while offset < len(view):
        try:
            record, offset = StepRecord.read_from(view, offset)
        except IncompleteRecordError:
            break
        records.append(record)
    return records
