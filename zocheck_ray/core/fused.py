"""`replay`: the fused CPU replay kernel (numba).

The parameters are cut into cache-sized chunks and every step of a batch is applied to a chunk
before the next; the steps are element-wise and z depends only on (seed, offset), so neither the
order, the chunking nor the threads change a bit. `update.py`'s operations run in the same order
and rounding, compiled without fastmath and with numpy's error model, so the bits match torch. The
kernel and all it inlines stay in this module: numba's disk cache notices only its own file's changes.
"""

from __future__ import annotations

import functools
import threading
from typing import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from zocheck_ray.core.config import ZOConfig
from zocheck_ray.core.errors import StateMismatchError
from zocheck_ray.core import generator as G
from zocheck_ray.core.generator import PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1, STREAM
from zocheck_ray.core.cpus import process_cpus
from zocheck_ray.core.layout import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MOMENTUM_PREFIX, Layout, moment_prefixes
from zocheck_ray.core.record import StepRecord
from zocheck_ray.core.seeds import MASK32, check_seed, perturbation_seeds
from zocheck_ray.core.validation import check_replay

CHUNK_ELEMENTS = 8192
"""Elements per work item: a chunk's parameters, z and words stay in L2 across a batch."""

OPT_SGD, OPT_ADAM, OPT_SPARSE, OPT_SIGN, OPT_MMT, OPT_CONS = 0, 1, 2, 3, 4, 5
_OPT_CODES = {"zo-sgd": OPT_SGD, "zo-adam": OPT_ADAM, "sparse-mezo": OPT_SPARSE, "zo-signsgd": OPT_SIGN,
              "zo-sgd-mmt": OPT_MMT, "zo-sgd-cons": OPT_CONS, "zo-sgd-sign": OPT_SGD}  # zo-sgd-sign: ZO-SGD on sign(g)
MAX_MOVES = 3
"""ZO-SGD-Cons takes up to three moves per step; every other optimizer one."""

# ---------------------------------------------------------------- bit-level helpers


@intrinsic
def _as_voidptr(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@intrinsic
def _claim(typingctx, address):
    """Atomically add one to the int64 at `address`; returns the value before."""
    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", pointer, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(types.int64), codegen


@intrinsic
def _f32_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


_U32 = np.uint32
_F32 = np.float32


@njit(inline="always")
def _bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (torch's c10 rule)."""
    u = _f32_bits(x)
    if x != x:
        return _U32(0x7FC0)
    return _U32((u + (_U32(0x7FFF) + ((u >> _U32(16)) & _U32(1)))) >> _U32(16))


@njit(inline="always")
def _bf16_value(bits):
    return _bits_f32(_U32(bits) << _U32(16))


# Left to LLVM to inline: numba's IR inlining of their selects into every kernel multiplied
# the compile time, for no gain in speed.
@njit(inline="never")
def _f16_bits(x):
    """float32 -> float16 bits, round to nearest even, branch-free (Giesen's float_to_half_rtne)."""
    u = _f32_bits(x)
    sign = u & _U32(0x80000000)
    u = u ^ sign
    special = _U32(0x7E00) if u > _U32(0x7F800000) else _U32(0x7C00)  # NaN, or inf and overflow
    # below 2**-14 the half is subnormal or zero: adding 0.5 aligns the mantissa, rounding to nearest even
    tiny = _U32(_f32_bits(_bits_f32(u) + _bits_f32(_U32(0x3F000000))) - _U32(0x3F000000))
    odd = (u >> _U32(13)) & _U32(1)
    normal = (_U32(u + _U32(0xC8000FFF)) + odd) >> _U32(13)  # rebias exponent (-112 << 23) and round
    out = special if u >= _U32(0x47800000) else (tiny if u < _U32(0x38800000) else normal)
    return _U32(out | (sign >> _U32(16)))


@njit(inline="never")
def _f16_value(bits):
    h = _U32(bits)
    sign = (h & _U32(0x8000)) << _U32(16)
    exponent = h & _U32(0x7C00)
    mantissa = h & _U32(0x3FF)
    special = _U32(0x7F800000) | (mantissa << _U32(13))
    tiny = _f32_bits(_F32(np.int32(mantissa)) * _F32(5.9604644775390625e-08))
    normal = ((h & _U32(0x7FFF)) << _U32(13)) + _U32(112 << 23)
    out = special if exponent == _U32(0x7C00) else (tiny if exponent == _U32(0) else normal)
    return _bits_f32(out | sign)


@njit(inline="always")
def _round_f32(x):
    return x


@njit(inline="always")
def _round_bf16(x):
    """_bf16_value(_bf16_bits(x)) without the shifts."""
    u = _f32_bits(x)
    r = _U32(_U32(u + _U32(_U32(0x7FFF) + _U32((u >> _U32(16)) & _U32(1)))) & _U32(0xFFFF0000))
    return _bits_f32(_U32(0x7FC00000) if x != x else r)


@njit(inline="never")
def _round_f16(x):
    """_f16_value(_f16_bits(x)) in the float32 domain: the nearest-even half, as a float32."""
    u = _f32_bits(x)
    a = _U32(u & _U32(0x7FFFFFFF))
    normal = _U32(_U32(a + _U32(_U32(0xFFF) + _U32((a >> _U32(13)) & _U32(1)))) & _U32(0xFFFFE000))
    normal = _U32(0x7F800000) if normal >= _U32(0x47800000) else normal  # rounds to 2**16 and up: inf
    # subnormal halves are multiples of 2**-24: adding and removing 0.5 rounds to one, exactly
    tiny = _f32_bits((_bits_f32(a) + _HALF) - _HALF)
    out = tiny if a < _U32(0x38800000) else normal
    out = _U32(0x7FC00000) if a > _U32(0x7F800000) else out
    return _bits_f32(_U32(out | _U32(u ^ a)))


# The intermediate roundings skip the NaN case: their operands are stored bf16/fp16 values, finite
# scalars or results of these roundings, so a NaN among them stays a NaN. The final store, and the
# rounding of a value made from float32 state (ZO-Adam's u * lr), use the complete conversions, so a
# NaN lands where torch's would, with its canonical bits.


@njit(inline="always")
def _round_bf16_inner(x):
    u = _f32_bits(x)
    return _bits_f32(_U32(_U32(u + _U32(_U32(0x7FFF) + _U32((u >> _U32(16)) & _U32(1)))) & _U32(0xFFFF0000)))


@njit(inline="never")
def _round_f16_inner(x):
    u = _f32_bits(x)
    a = _U32(u & _U32(0x7FFFFFFF))
    normal = _U32(_U32(a + _U32(_U32(0xFFF) + _U32((a >> _U32(13)) & _U32(1)))) & _U32(0xFFFFE000))
    # overflow to inf; inf and NaN stay as they are
    normal = max(normal, _U32(0x7F800000)) if normal >= _U32(0x47800000) else normal
    tiny = _f32_bits((_bits_f32(a) + _HALF) - _HALF)
    out = tiny if a < _U32(0x38800000) else normal
    return _bits_f32(_U32(out | _U32(u ^ a)))


@njit(inline="always")
def _load_f32(a, i):
    return a[i]


@njit(inline="always")
def _store_f32(a, i, x):
    a[i] = x


@njit(inline="always")
def _load_bf16(a, i):
    return _bf16_value(a[i])


@njit(inline="always")
def _store_bf16(a, i, x):
    a[i] = np.uint16(_bf16_bits(x))


@njit(inline="always")
def _load_f16(a, i):
    return _f16_value(a[i])


@njit(inline="always")
def _store_f16(a, i, x):
    a[i] = np.uint16(_f16_bits(x))


# ---------------------------------------------------------------- perturbation


_LN2 = _F32(G.LN2)
_SQRT2 = _F32(G.SQRT2)
_HALF_PI = _F32(G.HALF_PI)
_TWO_POW_M24 = _F32(G.TWO_POW_M24)
_L0, _L1, _L2, _L3 = (_F32(c) for c in G.LOG_SERIES)
_S0, _S1, _S2, _S3, _S4 = (_F32(c) for c in G.SIN_SERIES)
_C0, _C1, _C2, _C3, _C4, _C5 = (_F32(c) for c in G.COS_SERIES)
_RSQRT_MAGIC = _U32(G.RSQRT_MAGIC)
_ONE = _F32(1.0)
_TWO = _F32(2.0)
_HALF = _F32(0.5)
_THREE_HALVES = _F32(1.5)


@njit(inline="always")
def _unit_uniform(bits23):
    return _F32(np.int32(bits23 * _U32(2) + _U32(1))) * _TWO_POW_M24


@njit(inline="always")
def _log_unit(u):
    bits = _f32_bits(u)
    e = _F32(np.int32(bits >> _U32(23)) - np.int32(127))
    m = _bits_f32(_U32((bits & _U32(0x7FFFFF)) | _U32(0x3F800000)))
    if m > _SQRT2:
        m = m * _HALF
        e = e + _ONE
    t = m - _ONE
    s = t / (t + _TWO)
    s2 = s * s
    acc = _L0 * s2 + _L1
    acc = acc * s2 + _L2
    acc = acc * s2 + _L3
    acc = acc * s2 + _TWO
    return e * _LN2 + s * acc


@njit(inline="always")
def _sqrt_positive(a):
    y = _bits_f32(_U32(_RSQRT_MAGIC - (_f32_bits(a) >> _U32(1))))
    h = a * _HALF
    y = y * (_THREE_HALVES - (h * y) * y)
    y = y * (_THREE_HALVES - (h * y) * y)
    y = y * (_THREE_HALVES - (h * y) * y)
    return a * y


@njit(inline="always")
def _philox(ctr, key0, key1):
    """The four Philox4x32-10 words of counter (ctr, STREAM) under key (key0, key1); low words stay unmasked."""
    m0 = np.uint64(PHILOX_M0)
    m1 = np.uint64(PHILOX_M1)
    mask = np.uint64(MASK32)
    c0 = ctr & mask
    c1 = ctr >> np.uint64(32)
    c2 = np.uint64(STREAM)
    c3 = np.uint64(0)
    k0 = key0
    k1 = key1
    for _ in range(PHILOX_ROUNDS):
        p0 = m0 * (c0 & mask)
        p1 = m1 * (c2 & mask)
        c0 = (p1 >> np.uint64(32)) ^ c1 ^ k0
        c2 = (p0 >> np.uint64(32)) ^ c3 ^ k1
        c1 = p1
        c3 = p0
        k0 = (k0 + np.uint64(PHILOX_W0)) & mask
        k1 = (k1 + np.uint64(PHILOX_W1)) & mask
    return _U32(c0 & mask), _U32(c1 & mask), _U32(c2 & mask), _U32(c3 & mask)


@njit(inline="always")
def _angle(wb, radius):
    """radius * (cos, sin) of the angle in word `wb` (see generator.box_muller)."""
    x = _unit_uniform((wb >> _U32(7)) & _U32(0x7FFFFF)) * _HALF_PI
    x2 = x * x
    acc = _S0 * x2 + _S1
    acc = acc * x2 + _S2
    acc = acc * x2 + _S3
    acc = acc * x2 + _S4
    sin = x * (acc * x2 + _ONE)
    acc = _C0 * x2 + _C1
    acc = acc * x2 + _C2
    acc = acc * x2 + _C3
    acc = acc * x2 + _C4
    acc = acc * x2 + _C5
    cos = acc * x2 + _ONE
    quadrant = wb >> _U32(30)
    odd = (quadrant & _U32(1)) == _U32(1)
    zx = sin if odd else cos
    zy = cos if odd else sin
    if quadrant == _U32(1) or quadrant == _U32(2):
        zx = -zx
    if quadrant >= _U32(2):
        zy = -zy
    return radius * zx, radius * zy


@njit(inline="always")
def _box_muller(wa, wb):
    return _angle(wb, _sqrt_positive(_log_unit(_unit_uniform(wa >> _U32(9))) * _F32(-2.0)))


# Not inlined: numba's IR inlining copies the generator into every call site, which doubled the
# compile time; a call per chunk costs nothing measurable.
@njit(inline="never")
def perturbation_block(key0, key1, first, count, gaussian, out, wa, wb, radius):
    """z for counters first .. first+count-1 into out[0 : 4*count]. Gaussians are made in short passes over
    cache-resident scratch, so the vectorized loops keep many elements in flight."""
    if not gaussian:
        for j in range(count):
            w0, w1, w2, w3 = _philox(np.uint64(first + j), key0, key1)
            out[4 * j] = _F32(-1.0) if (w0 >> _U32(31)) != _U32(0) else _ONE
            out[4 * j + 1] = _F32(-1.0) if (w1 >> _U32(31)) != _U32(0) else _ONE
            out[4 * j + 2] = _F32(-1.0) if (w2 >> _U32(31)) != _U32(0) else _ONE
            out[4 * j + 3] = _F32(-1.0) if (w3 >> _U32(31)) != _U32(0) else _ONE
        return
    # pair q < count is (w0, w1) of counter q; pair count + q is (w2, w3)
    for j in range(count):
        w0, w1, w2, w3 = _philox(np.uint64(first + j), key0, key1)
        wa[j] = w0
        wb[j] = w1
        wa[count + j] = w2
        wb[count + j] = w3
    for q in range(2 * count):
        radius[q] = _log_unit(_unit_uniform(wa[q] >> _U32(9))) * _F32(-2.0)
    for q in range(2 * count):
        radius[q] = _sqrt_positive(radius[q])
    for j in range(count):
        z0, z1 = _angle(wb[j], radius[j])
        z2, z3 = _angle(wb[count + j], radius[count + j])
        out[4 * j] = z0
        out[4 * j + 1] = z1
        out[4 * j + 2] = z2
        out[4 * j + 3] = z3


# ---------------------------------------------------------------- the kernel


@njit(inline="always")
def _move(x, u, c, use_wd, wd, rnd):
    """One ZO-SGD move: [u = r(u + r(x * wd))];  x = r(x - r(u * c))."""
    if use_wd:
        u = rnd(u + rnd(x * wd))
    return rnd(x - rnd(u * c))


@njit(inline="always")
def _apply_step(src, dst, m, v, n, z, lane, opt, use_wd, cp, cm, g, lr, bc1, bc2, thr, consts, moves, n_moves, ld,
                st, rnd, rnd_full, fin):
    """One step's update of n elements in one pass; `fin` rounds the last operation (the identity where `st`
    converts: rounding to nearest even twice gives the same bits)."""
    wd, b1, omb1, b2, omb2, adam_eps = consts[0], consts[1], consts[2], consts[3], consts[4], consts[5]
    if opt == OPT_MMT:
        mu = consts[6]
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            mi = m[i] * mu + zd * g
            m[i] = mi
            u = mi
            if use_wd:
                u = u + x * wd
            st(dst, i, fin(x - rnd_full(u * lr)))
    elif opt == OPT_SIGN:
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            a = zd * g
            st(dst, i, _move(x, _F32(a > _F32(0.0)) - _F32(a < _F32(0.0)), lr, use_wd, wd, rnd))
    elif opt == OPT_CONS and n_moves == 3:  # back to the start, or on to the descent step
        c0, c1, c2 = moves[0], moves[1], moves[2]
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            u = rnd(zd * g)
            st(dst, i, _move(_move(_move(x, u, c0, use_wd, wd, rnd), u, c1, use_wd, wd, rnd), u, c2, use_wd, wd, rnd))
    elif opt == OPT_CONS:  # two moves: staying at the ascent step
        c0, c1 = moves[0], moves[1]
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            u = rnd(zd * g)
            st(dst, i, _move(_move(x, u, c0, use_wd, wd, rnd), u, c1, use_wd, wd, rnd))
    elif opt == OPT_ADAM:
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            gz = zd * g
            mi = m[i] * b1 + gz * omb1
            vi = v[i] * b2 + (gz * gz) * omb2
            m[i] = mi
            v[i] = vi
            u = (mi * bc1) / (np.sqrt(vi * bc2) + adam_eps)
            if use_wd:
                u = u + x * wd
            st(dst, i, fin(x - rnd_full(u * lr)))
    elif opt == OPT_SPARSE:
        for i in range(n):
            x = ld(src, i)
            if abs(x) <= thr:
                zd = rnd(z[lane + i])
                x = rnd(x + rnd(zd * cp))
                x = rnd(x + rnd(zd * cm))
                x = rnd(x + rnd(zd * cp))
                u = rnd(zd * g)
                if use_wd:
                    u = rnd(u + rnd(x * wd))
                x = fin(x - rnd(u * lr))
            st(dst, i, x)
    elif use_wd:
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            u = rnd(rnd(zd * g) + rnd(x * wd))
            st(dst, i, fin(x - rnd(u * lr)))
    else:
        for i in range(n):
            zd = rnd(z[lane + i])
            x = ld(src, i)
            x = rnd(x + rnd(zd * cp))
            x = rnd(x + rnd(zd * cm))
            x = rnd(x + rnd(zd * cp))
            st(dst, i, fin(x - rnd(rnd(zd * g) * lr)))


@njit(inline="always")
def _steps_general(p, m, v, n, offset, tensor, decay, opt, gaussian, multi, keys0, keys1, c_plus, c_minus, grads, lrs,
                   bc1s, bc2s, thresholds, consts, z, wa, wb, radius, ld, st, rnd, rnd_full, fin):
    """Every step of the batch on one chunk, for several perturbations and any optimizer. `multi` is a tuple
    because numba cannot inline a call of over 30 arguments."""
    q, moves, n_moves, acc, active = multi
    use_wd = decay and consts[0] > _F32(0.0)
    wd, b1, omb1, b2, omb2, adam_eps, mu = consts[0], consts[1], consts[2], consts[3], consts[4], consts[5], consts[6]
    first = offset >> 2
    count = ((offset + n - 1) >> 2) - first + 1
    lane = offset & 3
    for k in range(c_plus.shape[0]):
        cp = c_plus[k]
        cm = c_minus[k]
        sparse = opt == OPT_SPARSE
        if sparse:
            thr = thresholds[k, tensor]
            for i in range(n):
                active[i] = abs(ld(p, i)) <= thr
        for j in range(q):
            perturbation_block(keys0[k * q + j], keys1[k * q + j], first, count, gaussian, z, wa, wb, radius)
            gj = grads[k, j]
            if j == 0:
                for i in range(n):
                    acc[i] = rnd(z[lane + i]) * gj
            else:
                for i in range(n):
                    acc[i] = acc[i] + rnd(z[lane + i]) * gj
            for i in range(n):  # every element; Sparse-MeZO keeps the unmasked ones as they were
                zd = rnd(z[lane + i])
                x0 = ld(p, i)
                x = rnd(x0 + rnd(zd * cp))
                x = rnd(x + rnd(zd * cm))
                x = rnd(x + rnd(zd * cp))
                st(p, i, x if (not sparse or active[i]) else x0)
        lr = lrs[k]
        if opt == OPT_ADAM:
            bc1 = bc1s[k]
            bc2 = bc2s[k]
            for i in range(n):
                x = ld(p, i)
                a = acc[i]
                mi = m[i] * b1 + a * omb1
                vi = v[i] * b2 + (a * a) * omb2
                m[i] = mi
                v[i] = vi
                u = (mi * bc1) / (np.sqrt(vi * bc2) + adam_eps)
                if use_wd:
                    u = u + x * wd
                st(p, i, fin(x - rnd_full(u * lr)))
        elif opt == OPT_MMT:
            for i in range(n):
                x = ld(p, i)
                mi = m[i] * mu + acc[i]
                m[i] = mi
                u = mi
                if use_wd:
                    u = u + x * wd
                st(p, i, fin(x - rnd_full(u * lr)))
        else:
            # one pass per move (ZO-SGD-Cons makes up to three), each a branch-free loop over the chunk
            sign = opt == OPT_SIGN
            for r in range(n_moves[k]):
                c = moves[k, r]
                for i in range(n):
                    x0 = ld(p, i)
                    a = acc[i]
                    if sign:
                        u = _F32(a > _F32(0.0)) - _F32(a < _F32(0.0))
                    else:
                        u = rnd(a)
                    if use_wd:
                        u = rnd(u + rnd(x0 * wd))
                    x = rnd(x0 - rnd(u * c))
                    st(p, i, x if (not sparse or active[i]) else x0)


@njit(inline="always")
def _chunk_in_place(param, m, v, n, offset, tensor, decay, opt, gaussian, multi, keys0, keys1, c_plus, c_minus, grads,
                    lrs, bc1s, bc2s, thresholds, consts, p, z, wa, wb, radius, load, store, rnd, rnd_full, fin):
    """Every step of the batch on one chunk where it is stored."""
    if multi[0] > 1:
        _steps_general(param, m, v, n, offset, tensor, decay, opt, gaussian, multi, keys0, keys1, c_plus, c_minus,
                       grads, lrs, bc1s, bc2s, thresholds, consts, z, wa, wb, radius, load, store, rnd, rnd_full, fin)
        return
    use_wd = decay and consts[0] > _F32(0.0)
    first = offset >> 2
    count = ((offset + n - 1) >> 2) - first + 1
    lane = offset & 3
    for k in range(keys0.shape[0]):
        perturbation_block(keys0[k], keys1[k], first, count, gaussian, z, wa, wb, radius)
        _apply_step(param, param, m, v, n, z, lane, opt, use_wd, c_plus[k], c_minus[k], grads[k, 0], lrs[k],
                    bc1s[k], bc2s[k], thresholds[k, tensor], consts, multi[1][k], multi[2][k], load, store, rnd,
                    rnd_full, fin)


@njit(inline="always")
def _chunk_staged(param, m, v, n, offset, tensor, decay, opt, gaussian, multi, keys0, keys1, c_plus, c_minus, grads, lrs,
                  bc1s, bc2s, thresholds, consts, p, z, wa, wb, radius, load, store, rnd, rnd_full, fin):
    """Every step of the batch on a float32 copy `p` of a bf16/fp16 chunk, converted once each way."""
    for i in range(n):
        p[i] = load(param, i)
    _chunk_in_place(p, m, v, n, offset, tensor, decay, opt, gaussian, multi, keys0, keys1, c_plus, c_minus, grads, lrs,
                    bc1s, bc2s, thresholds, consts, p, z, wa, wb, radius, _load_f32, _store_f32, rnd, rnd_full, rnd)
    for i in range(n):
        store(param, i, p[i])


@njit(inline="always")
def _work(param_ptrs, m_ptrs, v_ptrs, offsets, decays, plan, opt, gaussian, steps, keys0, keys1, c_plus, c_minus,
          grads, lrs, bc1s, bc2s, thresholds, consts, longest, storage_dtype, itemsize, load, store, rnd, rnd_full,
          chunk_fn, scratch):
    """One worker: it claims chunks one at a time from a shared counter, so a worker on a busy core takes
    fewer chunks instead of holding the rest up."""
    chunk_tensor, chunk_start, chunk_len, claims = plan
    q, moves, n_moves = steps
    chunks = chunk_tensor.shape[0]
    p_scratch = np.empty(scratch, np.float32)
    z = np.empty(longest + 8, np.float32)
    pairs = 2 * (longest // 4 + 2)
    wa = np.empty(pairs, np.uint32)
    wb = np.empty(pairs, np.uint32)
    radius = np.empty(pairs, np.float32)
    general = q > 1
    multi = (q, moves, n_moves, np.empty(longest if general else 0, np.float32),
             np.empty(longest if general else 0, np.bool_))
    c = _claim(claims)
    while c < chunks:
        t = chunk_tensor[c]
        s = chunk_start[c]
        n = chunk_len[c]
        param = numba.carray(_as_voidptr(param_ptrs[t] + s * itemsize), n, storage_dtype)
        if opt == OPT_ADAM:
            m = numba.carray(_as_voidptr(m_ptrs[t] + s * 4), n, np.float32)
            v = numba.carray(_as_voidptr(v_ptrs[t] + s * 4), n, np.float32)
        elif opt == OPT_MMT:
            m = numba.carray(_as_voidptr(m_ptrs[t] + s * 4), n, np.float32)
            v = m
        else:
            m = numba.carray(_as_voidptr(param_ptrs[t]), 0, np.float32)
            v = m
        chunk_fn(param, m, v, n, offsets[t] + s, t, decays[t], opt, gaussian, multi, keys0, keys1, c_plus, c_minus,
                 grads, lrs, bc1s, bc2s, thresholds, consts, p_scratch, z, wa, wb, radius, load, store,
                 rnd, rnd_full, _round_f32)
        c = _claim(claims)


# One worker and one kernel per storage dtype and chunk path. The worker is a function of its own so
# that numba's parallel passes see a loop of one call, not the inlined body (half the compile time);
# it takes arrays and numbers only, as a function passed through the loop would make the kernel
# uncacheable. Kernels are module-level functions so that numba caches them on disk.
_KERNEL_OPTIONS = dict(parallel=True, cache=True, error_model="numpy", nogil=True)


@njit(inline="never")
def _work_f32(pp, mp, vp, off, dec, ct, cs, cl, cc,
              opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg):
    _work(pp, mp, vp, off, dec, (ct, cs, cl, cc), opt, gau, (q, mv, nm), k0, k1, cpl, cmi, gr, lr, b1, b2, thr, con,
          lg, np.float32, np.int64(4), _load_f32, _store_f32, _round_f32, _round_f32, _chunk_in_place, 0)


@njit(inline="never")
def _work_bf16(pp, mp, vp, off, dec, ct, cs, cl, cc,
               opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg):
    _work(pp, mp, vp, off, dec, (ct, cs, cl, cc), opt, gau, (q, mv, nm), k0, k1, cpl, cmi, gr, lr, b1, b2, thr, con,
          lg, np.uint16, np.int64(2), _load_bf16, _store_bf16, _round_bf16_inner, _round_bf16, _chunk_staged, lg)


@njit(inline="never")
def _work_bf16_step(pp, mp, vp, off, dec, ct, cs, cl, cc, opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm,
                    con, lg):
    _work(pp, mp, vp, off, dec, (ct, cs, cl, cc), opt, gau, (q, mv, nm), k0, k1, cpl, cmi, gr, lr, b1, b2, thr, con,
          lg, np.uint16, np.int64(2), _load_bf16, _store_bf16, _round_bf16_inner, _round_bf16, _chunk_in_place, 0)


@njit(inline="never")
def _work_f16(pp, mp, vp, off, dec, ct, cs, cl, cc,
              opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg):
    _work(pp, mp, vp, off, dec, (ct, cs, cl, cc), opt, gau, (q, mv, nm), k0, k1, cpl, cmi, gr, lr, b1, b2, thr, con,
          lg, np.uint16, np.int64(2), _load_f16, _store_f16, _round_f16_inner, _round_f16, _chunk_staged, lg)


@njit(inline="never")
def _work_f16_step(pp, mp, vp, off, dec, ct, cs, cl, cc,
                   opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg):
    _work(pp, mp, vp, off, dec, (ct, cs, cl, cc), opt, gau, (q, mv, nm), k0, k1, cpl, cmi, gr, lr, b1, b2, thr, con,
          lg, np.uint16, np.int64(2), _load_f16, _store_f16, _round_f16_inner, _round_f16, _chunk_in_place, 0)


@njit(**_KERNEL_OPTIONS)
def _kernel_f32(pp, mp, vp, off, dec, ct, cs, cl, cc,
                opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, wk, lg):
    for _ in prange(wk):
        _work_f32(pp, mp, vp, off, dec, ct, cs, cl, cc,
                  opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg)


@njit(**_KERNEL_OPTIONS)
def _kernel_bf16(pp, mp, vp, off, dec, ct, cs, cl, cc,
                 opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, wk, lg):
    for _ in prange(wk):
        _work_bf16(pp, mp, vp, off, dec, ct, cs, cl, cc,
                   opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg)


@njit(**_KERNEL_OPTIONS)
def _kernel_bf16_step(pp, mp, vp, off, dec, ct, cs, cl, cc,
                      opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, wk, lg):
    for _ in prange(wk):
        _work_bf16_step(pp, mp, vp, off, dec, ct, cs, cl, cc,
                        opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg)


@njit(**_KERNEL_OPTIONS)
def _kernel_f16(pp, mp, vp, off, dec, ct, cs, cl, cc,
                opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, wk, lg):
    for _ in prange(wk):
        _work_f16(pp, mp, vp, off, dec, ct, cs, cl, cc,
                  opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, lg)


@njit(**_KERNEL_OPTIONS)
def _kernel_f16_step(pp, mp, vp, off, dec, ct, cs, cl, cc,
                     opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2, thr, mv, nm, con, wk, lg):
    for _ in prange(wk):
        _work_f16_step(pp, mp, vp, off, dec, ct, cs, cl, cc, opt, gau, q, k0, k1, cpl, cmi, gr, lr, b1, b2,
                       thr, mv, nm, con, lg)


_KERNELS = {torch.float32: _kernel_f32, torch.bfloat16: _kernel_bf16, torch.float16: _kernel_f16}
"""The kernel per storage dtype; bf16/fp16 batches go through float32 scratch."""
_STEP_KERNELS = {torch.float32: _kernel_f32, torch.bfloat16: _kernel_bf16_step, torch.float16: _kernel_f16_step}
"""... and a single step converts in the update (no scratch pass)."""
_THREADS_LOCK = threading.Lock()


@njit(parallel=True, cache=True, error_model="numpy", nogil=True)
def _perturbation_kernel(key0, key1, offset, gaussian, out):
    n = out.shape[0]
    blocks = (n + CHUNK_ELEMENTS - 1) // CHUNK_ELEMENTS
    for b in prange(blocks):
        start = b * CHUNK_ELEMENTS
        count = min(CHUNK_ELEMENTS, n - start)
        first = (offset + start) >> 2
        counters = ((offset + start + count - 1) >> 2) - first + 1
        lane = (offset + start) & 3
        z = np.empty(4 * counters, np.float32)
        wa = np.empty(2 * counters, np.uint32)
        wb = np.empty(2 * counters, np.uint32)
        radius = np.empty(2 * counters, np.float32)
        perturbation_block(key0, key1, first, counters, gaussian, z, wa, wb, radius)
        for i in range(count):
            out[start + i] = z[lane + i]


def perturbation_cpu(seed: int, offset: int, numel: int, kind: str = "gaussian") -> torch.Tensor:
    """Same values as `generator.perturbation` on the CPU, from the fused generator (fast)."""
    if kind not in ("gaussian", "rademacher"):
        raise ValueError(f"unknown perturbation kind {kind!r}; expected 'gaussian' or 'rademacher'")
    check_seed(seed)
    out = np.empty(numel, dtype=np.float32)
    if numel:
        _perturbation_kernel(np.uint64(seed & MASK32), np.uint64(seed >> 32), offset, kind == "gaussian", out)
    return torch.from_numpy(out)


SERIAL_BELOW = 4 * CHUNK_ELEMENTS
"""Fewer elements than this get z on the calling thread: waking numba's pool costs more."""


def perturbation_into(out: np.ndarray, seed: int, offset: int, kind: str) -> None:
    """`perturbation_cpu` into the caller's float32 buffer, on `compute_threads()` threads."""
    args = (np.uint64(seed & MASK32), np.uint64(seed >> 32), offset, kind == "gaussian", out)
    threads = compute_threads() if out.size >= SERIAL_BELOW else 1
    previous = numba.get_num_threads()  # thread-local
    if threads == previous:
        _perturbation_kernel(*args)
        return
    numba.set_num_threads(threads)
    try:
        _perturbation_kernel(*args)
    finally:
        numba.set_num_threads(previous)


@functools.lru_cache(maxsize=64)
def _chunk_plan(tensors: tuple[tuple[int, int], ...], chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(tensor index, start, length) of every `chunk`-element piece of the tensors, and the longest."""
    per = [(numel + chunk - 1) // chunk for _, numel in tensors]
    tensor_ids = np.repeat(np.array([i for i, _ in tensors], dtype=np.int64), per)
    first = np.repeat(np.cumsum([0] + per[:-1]), per)
    starts = (np.arange(len(tensor_ids), dtype=np.int64) - first) * chunk
    numels = np.repeat(np.array([n for _, n in tensors], dtype=np.int64), per)
    lens = np.minimum(chunk, numels - starts)
    for a in (tensor_ids, starts, lens):
        a.flags.writeable = False
    return tensor_ids, starts, lens, int(lens.max()) if len(lens) else 0


def warm_up(dtype: torch.dtype, config: ZOConfig, steps: int = 1) -> None:
    """Load (or compile) the kernels a trainer and a replay use for `dtype` and `config`, the replay's first."""
    name = "warm_up.weight"
    state = {name: torch.zeros(4, dtype=dtype)}
    for prefix in moment_prefixes(config.optimizer):
        state[prefix + name] = torch.zeros(4)
    extras = (0.0,) if config.optimizer == "sparse-mezo" else ()
    fingerprint = Layout.from_state(state, config).fingerprint(config)
    more = (0.0,) * (config.num_perturbations - 1)
    records = [StepRecord(t, t, 0.0, config.lr, config.eps, fingerprint, config.optimizer, extras, more)
               for t in range(steps)]
    replay(state, records, config, threads=1, start_step=0)
    perturbation_into(np.empty(4, dtype=np.float32), 0, 0, config.perturbation)


KERNELS = {"perturbation": None, "float32": (torch.float32, 1), "bfloat16 step": (torch.bfloat16, 1),
           "bfloat16 batch": (torch.bfloat16, 2), "float16 step": (torch.float16, 1),
           "float16 batch": (torch.float16, 2)}
"""Every kernel numba compiles (dtype, steps that take it)."""
COMPILE_CPU_SECONDS = {"perturbation": 7, "float32": 18, "bfloat16 step": 25, "bfloat16 batch": 27,
                       "float16 step": 20, "float16 batch": 24}
"""Each kernel's relative compile cost: `compile_kernels` balances its processes by it."""


def load_kernels(names) -> None:
    """Load the kernels `names` of `KERNELS` in this process, compiling those not cached."""
    for name in names:
        if KERNELS[name] is None:
            perturbation_cpu(0, 0, 4)
        else:
            dtype, steps = KERNELS[name]
            warm_up(dtype, ZOConfig(), steps=steps)


def compile_kernels(processes: int | None = None) -> None:
    """Compile every kernel into numba's cache in up to `processes` children, so later processes only load them:

        python -c "from zocheck_ray.core.fused import compile_kernels; compile_kernels()"
    """
    import os
    import subprocess
    import sys

    workers = max(1, min(processes or os.cpu_count() or 1, len(KERNELS)))
    children = [subprocess.Popen([sys.executable, "-c", "import sys; from zocheck_ray.core.fused import load_kernels; "
                                  "load_kernels(sys.argv[1:])", *names],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for names in split_kernels(workers)]
    failed = [err for child in children if (err := child.communicate()[1]) and child.returncode]
    if failed:
        raise RuntimeError("compiling the numba kernels failed:\n" + "\n".join(failed))


def split_kernels(workers: int) -> list[list[str]]:
    """`KERNELS` in `workers` lists of about equal compile time, the generator first in its list."""
    shares: list[list[str]] = [[] for _ in range(workers)]
    for name in sorted(KERNELS, key=lambda n: -COMPILE_CPU_SECONDS[n]):
        min(shares, key=lambda share: sum(COMPILE_CPU_SECONDS[n] for n in share)).append(name)
    return [sorted(share, key=lambda n: KERNELS[n] is not None) for share in shares if share]


def default_threads() -> int:
    """numba's pool size, `replay`'s default (spare threads cost nothing: workers claim chunks)."""
    return numba.config.NUMBA_NUM_THREADS


def compute_threads() -> int:
    """Threads for a kernel that splits its work evenly: the thread's numba count, at most the CPUs."""
    return min(numba.get_num_threads(), process_cpus())


def replay(state: dict[str, torch.Tensor], records: Sequence[StepRecord], config: ZOConfig,
           threads: int | None = None, *, start_step: int) -> dict[str, torch.Tensor]:
    """Apply `records` to a CPU `state` at step `start_step` in place; the step is required, so that a record
    skipped or repeated always raises."""
    layout, scalars = check_replay(state, records, config, start_step)
    for name, tensor in state.items():
        if tensor.device.type != "cpu":
            raise StateMismatchError(
                f"state[{name!r}] is on {tensor.device}; the fused replay runs on the CPU "
                "(use replay_reference on other devices)"
            )
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= numba.config.NUMBA_NUM_THREADS):
        raise ValueError(f"threads must be an integer in [1, {numba.config.NUMBA_NUM_THREADS}], got {threads!r}")
    if not records:
        return state
    k = len(records)
    q = config.num_perturbations
    seeds = [seed for r in records for seed in perturbation_seeds(r.seed, q)]  # step k's j-th at k * q + j
    keys0 = np.array([s & MASK32 for s in seeds], dtype=np.uint64)
    keys1 = np.array([s >> 32 for s in seeds], dtype=np.uint64)
    c_plus = np.array([s.plus for s in scalars], dtype=np.float32)
    c_minus = np.array([s.minus for s in scalars], dtype=np.float32)
    grads = np.array([s.grads for s in scalars], dtype=np.float32).reshape(k, q)
    lrs = np.array([s.lr for s in scalars], dtype=np.float32)
    bc1s = np.array([s.bias_correction1 for s in scalars], dtype=np.float32)
    bc2s = np.array([s.bias_correction2 for s in scalars], dtype=np.float32)
    moves = np.zeros((k, MAX_MOVES), dtype=np.float32)
    n_moves = np.array([len(s.moves) for s in scalars], dtype=np.int64)
    for i, s in enumerate(scalars):
        moves[i, : len(s.moves)] = s.moves
    s0 = scalars[0]
    consts = np.array([s0.weight_decay, s0.beta1, s0.one_minus_beta1, s0.beta2, s0.one_minus_beta2, s0.adam_eps,
                       s0.momentum], dtype=np.float32)
    ntensors = len(layout.params)
    if config.optimizer == "sparse-mezo":
        thresholds = np.array([r.extras for r in records], dtype=np.float32).reshape(k, ntensors)
    else:
        thresholds = np.zeros((k, ntensors), dtype=np.float32)
    opt = _OPT_CODES[config.optimizer]
    gaussian = config.perturbation == "gaussian"

    param_ptrs = np.array([state[s.name].data_ptr() for s in layout.params], dtype=np.int64)
    if opt == OPT_ADAM:
        m_ptrs = np.array([state[EXP_AVG_PREFIX + s.name].data_ptr() for s in layout.params], dtype=np.int64)
        v_ptrs = np.array([state[EXP_AVG_SQ_PREFIX + s.name].data_ptr() for s in layout.params], dtype=np.int64)
    elif opt == OPT_MMT:
        m_ptrs = v_ptrs = np.array([state[MOMENTUM_PREFIX + s.name].data_ptr() for s in layout.params],
                                   dtype=np.int64)
    else:
        m_ptrs = v_ptrs = np.zeros(ntensors, dtype=np.int64)
    offsets = np.array([s.offset for s in layout.params], dtype=np.int64)
    decays = np.array([s.decay for s in layout.params], dtype=np.bool_)

    with _THREADS_LOCK:
        previous = numba.get_num_threads()
        numba.set_num_threads(threads or default_threads())
        try:
            for dtype, kernel in (_STEP_KERNELS if k == 1 else _KERNELS).items():
                members = [i for i, s in enumerate(layout.params) if state[s.name].dtype == dtype]
                if not members:
                    continue
                tensor_ids, starts, lens, longest = _chunk_plan(
                    tuple((i, layout.params[i].numel) for i in members), CHUNK_ELEMENTS)
                if not len(lens):
                    continue
                workers = min(threads or default_threads(), len(lens))
                claims = np.zeros(1, dtype=np.int64)  # the next chunk to claim (`_work`)
                kernel(param_ptrs, m_ptrs, v_ptrs, offsets, decays, tensor_ids, starts, lens, claims.ctypes.data,
                       opt, gaussian, q,
                       keys0, keys1, c_plus, c_minus, grads, lrs, bc1s, bc2s, thresholds, moves, n_moves, consts,
                       workers, longest)
        finally:
            numba.set_num_threads(previous)
    return state
