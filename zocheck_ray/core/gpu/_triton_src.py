"""The Triton source of the fused GPU kernels (loaded by `triton_kernels.py`, never imported directly).

`triton_kernels` executes this file twice, compiled for CUDA and interpreted (for CPU tensors and
the tests); every helper goes through `_jit`, and no `@triton.jit` function of Triton's library
(`tl.zeros`, `tl.sum`) is used, since those were made for one mode at import. `zo_kernel` repeats
`generator.py` and `update.py` operation for operation, each rounded on its own (no FMA, `div_rn`,
`sqrt_rn`). Interpreted, `constexpr - tensor` stays a constexpr: put the tensor first.
"""

import triton.language as tl
from triton.runtime.jit import JITFunction

from zocheck_ray.core import generator as G

INTERPRET = globals().get("INTERPRET", False)


def _jit(fn):
    # Interpreted, a helper is a plain function: the launch has patched `tl` for the whole grid
    # (an InterpretedFunction helper would re-patch it on every call).
    if INTERPRET:
        fn.fn = fn  # what the interpreter's tl.reduce calls a combine function through
        return fn
    # JITFunction, not `triton.jit`, which interprets wherever TRITON_INTERPRET=1 is set
    return JITFunction(fn)


def _kernel_jit(fn):
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    # the keys arrive with bit 32 set, so every launch has the same (int64) signature
    return JITFunction(fn, do_not_specialize=["key0", "key1"])


PHILOX_M0 = tl.constexpr(G.PHILOX_M0)
PHILOX_M1 = tl.constexpr(G.PHILOX_M1)
PHILOX_W0 = tl.constexpr(G.PHILOX_W0)
PHILOX_W1 = tl.constexpr(G.PHILOX_W1)
STREAM = tl.constexpr(G.STREAM)
LN2 = tl.constexpr(G.LN2)
SQRT2 = tl.constexpr(G.SQRT2)
HALF_PI = tl.constexpr(G.HALF_PI)
TWO_POW_M24 = tl.constexpr(G.TWO_POW_M24)
L0, L1, L2, L3 = (tl.constexpr(c) for c in G.LOG_SERIES)
S0, S1, S2, S3, S4 = (tl.constexpr(c) for c in G.SIN_SERIES)
C0, C1, C2, C3, C4, C5 = (tl.constexpr(c) for c in G.COS_SERIES)
RSQRT_MAGIC = tl.constexpr(G.RSQRT_MAGIC)
assert G.PHILOX_ROUNDS == 10 and G.NEWTON_STEPS == 3 and len(G.LOG_SERIES) == 4

# The launcher's codes (triton_kernels.py mirrors them).
PHASE_Z = tl.constexpr(0)
PHASE_PERTURB = tl.constexpr(1)
PHASE_UPDATE = tl.constexpr(2)
PHASE_STEP = tl.constexpr(3)
OPT_SGD = tl.constexpr(0)
OPT_ADAM = tl.constexpr(1)
OPT_SPARSE = tl.constexpr(2)
OPT_SIGN = tl.constexpr(3)
OPT_MMT = tl.constexpr(4)
OPT_CONS = tl.constexpr(5)
DT_F32 = tl.constexpr(0)
DT_BF16 = tl.constexpr(1)
DT_F16 = tl.constexpr(2)
MASK_MAKE = tl.constexpr(1)
MASK_READ = tl.constexpr(2)
MASK_REGISTERS = tl.constexpr(3)

# ---------------------------------------------------------------- bits and roundings


@_jit
def _bits(x):
    return x.to(tl.uint32, bitcast=True)


@_jit
def _f32(u):
    return u.to(tl.float32, bitcast=True)


@_jit
def _u32(x, like):
    return tl.full(like.shape, x, tl.uint32)


@_jit
def _pack_bytes(sel, B4: tl.constexpr):
    """[B4, 4] bools -> [B4 // 2] bytes, slot s at bit s & 7 (by splits: the interpreter runs reductions slowly)."""
    bits = tl.reshape(sel.to(tl.int32), (B4 // 2, 8)) << tl.arange(0, 8)[None, :]
    a, b = tl.split(tl.reshape(bits, (B4 // 2, 4, 2)))
    a, b = tl.split(tl.reshape(a | b, (B4 // 2, 2, 2)))
    a, b = tl.split(a | b)
    return (a | b).to(tl.uint8)


@_jit
def _round_bf16(x):
    """float32 -> nearest-even bfloat16, as a float32 (NaN -> torch's 0x7FC0)."""
    u = _bits(x)
    r = (u + (0x7FFF + ((u >> 16) & 1))) & _u32(0xFFFF0000, u)
    return _f32(tl.where(x != x, _u32(0x7FC00000, u), r))


@_jit
def _round_f16(x):
    """float32 -> nearest-even float16, as a float32 (fused._round_f16)."""
    u = _bits(x)
    a = u & 0x7FFFFFFF
    normal = (a + (0xFFF + ((a >> 13) & 1))) & _u32(0xFFFFE000, u)
    normal = tl.where(normal >= 0x47800000, _u32(0x7F800000, u), normal)
    # subnormal halves are multiples of 2**-24: adding and removing 0.5 rounds to one, exactly
    tiny = _bits((_f32(a) + 0.5) - 0.5)
    out = tl.where(a < 0x38800000, tiny, normal)
    out = tl.where(a > 0x7F800000, _u32(0x7FC00000, u), out)
    return _f32(out | (u ^ a))


@_jit
def _round(x, DTYPE: tl.constexpr):
    if DTYPE == DT_BF16:
        return _round_bf16(x)
    elif DTYPE == DT_F16:
        return _round_f16(x)
    else:
        return x


@_jit
def _load(ptr, idx, inb, DTYPE: tl.constexpr):
    """float32 values of stored elements (bf16/fp16 from their int16 bits, exactly)."""
    if DTYPE == DT_F32:
        return tl.load(ptr + idx, mask=inb, other=0.0)
    else:
        h = (tl.load(ptr + idx, mask=inb, other=0).to(tl.int32) & 0xFFFF).to(tl.uint32)
        if DTYPE == DT_BF16:
            return _f32(h << 16)
        else:
            sign = (h & 0x8000) << 16
            exponent = h & 0x7C00
            mantissa = h & 0x3FF
            special = _u32(0x7F800000, h) | (mantissa << 13)
            tiny = _bits(mantissa.to(tl.int32).to(tl.float32) * 5.9604644775390625e-08)
            normal = ((h & 0x7FFF) << 13) + (112 << 23)
            out = tl.where(exponent == 0x7C00, special, tl.where(exponent == 0, tiny, normal))
            return _f32(out | sign)


@_jit
def _store(ptr, idx, inb, x, DTYPE: tl.constexpr):
    """Store float32 values, rounded to the dtype (to nearest even; NaN as torch writes it)."""
    if DTYPE == DT_F32:
        tl.store(ptr + idx, x, mask=inb)
    else:
        if DTYPE == DT_BF16:
            h = _bits(_round_bf16(x)) >> 16
        else:  # fused._f16_bits: the half's bits
            u = _bits(x)
            sign = u & _u32(0x80000000, u)
            u = u ^ sign
            special = tl.where(u > 0x7F800000, _u32(0x7E00, u), _u32(0x7C00, u))
            tiny = _bits(_f32(u) + 0.5) - 0x3F000000
            normal = ((u + _u32(0xC8000FFF, u)) + ((u >> 13) & 1)) >> 13
            h = tl.where(u >= 0x47800000, special, tl.where(u < 0x38800000, tiny, normal)) | (sign >> 16)
        signed = h.to(tl.int32)
        signed = tl.where(signed >= 0x8000, signed - 0x10000, signed)
        tl.store(ptr + idx, signed.to(tl.int16), mask=inb)


# ---------------------------------------------------------------- perturbation (generator.py)


@_jit
def _philox(ctr, k0, k1):
    """The four Philox4x32-10 words of counters (ctr low word, ctr high word, STREAM, 0) under (k0, k1)."""
    c0 = (ctr & 0xFFFFFFFF).to(tl.uint32)
    c1 = (ctr >> 32).to(tl.uint32)
    c2 = _u32(STREAM, c0)
    c3 = _u32(0, c0)
    m0 = _u32(PHILOX_M0, c0)
    m1 = _u32(PHILOX_M1, c0)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@_jit
def _unit_uniform(bits23):
    odd = bits23 * 2 + 1
    return odd.to(tl.int32).to(tl.float32) * TWO_POW_M24


@_jit
def _log_unit(u):
    bits = _bits(u)
    e = ((bits >> 23).to(tl.int32) - 127).to(tl.float32)
    m = _f32((bits & 0x7FFFFF) | 0x3F800000)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, e + 1.0, e)
    t = m - 1.0
    s = tl.math.div_rn(t, t + 2.0)
    s2 = s * s
    acc = s2 * L0
    acc = acc + L1
    acc = acc * s2
    acc = acc + L2
    acc = acc * s2
    acc = acc + L3
    acc = acc * s2
    acc = acc + 2.0
    le = e * LN2
    ls = s * acc
    return le + ls


@_jit
def _newton(y, h):
    hy = h * y
    hyy = hy * y
    return y * (1.5 - hyy)


@_jit
def _sqrt_positive(a):
    y = _f32(_u32(RSQRT_MAGIC, a) - (_bits(a) >> 1))
    h = a * 0.5
    y = _newton(y, h)
    y = _newton(y, h)
    y = _newton(y, h)
    return a * y


@_jit
def _horner(acc, x2, c):
    p = acc * x2
    return p + c


@_jit
def _box_muller(wa, wb):
    """generator.box_muller: two normals from the words (wa, wb)."""
    radius = _sqrt_positive(_log_unit(_unit_uniform(wa >> 9)) * -2.0)
    x = _unit_uniform((wb >> 7) & 0x7FFFFF) * HALF_PI
    x2 = x * x
    acc = _horner(tl.full(x.shape, S0, tl.float32), x2, S1)
    acc = _horner(acc, x2, S2)
    acc = _horner(acc, x2, S3)
    acc = _horner(acc, x2, S4)
    sin = x * _horner(acc, x2, 1.0)
    acc = _horner(tl.full(x.shape, C0, tl.float32), x2, C1)
    acc = _horner(acc, x2, C2)
    acc = _horner(acc, x2, C3)
    acc = _horner(acc, x2, C4)
    acc = _horner(acc, x2, C5)
    cos = _horner(acc, x2, 1.0)
    quadrant = wb >> 30
    odd = (quadrant & 1) == 1
    zx = tl.where(odd, sin, cos)
    zy = tl.where(odd, cos, sin)
    zx = tl.where((quadrant == 1) | (quadrant == 2), -zx, zx)
    zy = tl.where(quadrant >= 2, -zy, zy)
    return radius * zx, radius * zy


@_jit
def _perturbation(ctr, k0, k1, GAUSSIAN: tl.constexpr, B4: tl.constexpr):
    """z (float32, [B4, 4]) of counters `ctr` ([B4]): row k holds the four elements of counter k."""
    w0, w1, w2, w3 = _philox(ctr, k0, k1)
    if GAUSSIAN:
        # pair 0 is (w0, w1), pair 1 is (w2, w3); join(x, y) puts each pair's two normals side by side
        zx, zy = _box_muller(tl.join(w0, w2), tl.join(w1, w3))
        z = tl.reshape(tl.join(zx, zy), (B4, 4))
    else:
        w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (B4, 4))
        z = tl.where((w >> 31) == 1, -1.0, 1.0)
    return z


# ---------------------------------------------------------------- the operations (update.py)


@_jit
def _perturb(x, zd, c, DTYPE: tl.constexpr):
    t = _round(zd * c, DTYPE)
    return _round(x + t, DTYPE)


@_jit
def _sgd(x, zd, grad, lr, wd, decay, DTYPE: tl.constexpr):
    u = _round(zd * grad, DTYPE)
    decayed = _round(u + _round(x * wd, DTYPE), DTYPE)
    u = tl.where(decay, decayed, u)
    step = _round(u * lr, DTYPE)
    return _round(x - step, DTYPE)


@_jit
def _move(x, acc, c, wd, decay, SIGN: tl.constexpr, DTYPE: tl.constexpr):
    """One move of ZO-SGD (and its sign and conservative variants) from the estimate `acc`."""
    if SIGN:
        u = tl.where(acc > 0.0, 1.0, tl.where(acc < 0.0, -1.0, 0.0))
    else:
        u = _round(acc, DTYPE)
    decayed = _round(u + _round(x * wd, DTYPE), DTYPE)
    u = tl.where(decay, decayed, u)
    step = _round(u * c, DTYPE)
    return _round(x - step, DTYPE)


@_jit
def _pointers(table, t, DTYPE: tl.constexpr):
    """Per row, the base pointer of its tensor (float32, or int16 for bf16/fp16 bits)."""
    if DTYPE == DT_F32:
        return tl.load(table + t).to(tl.pointer_type(tl.float32))
    else:
        return tl.load(table + t).to(tl.pointer_type(tl.int16))


@_kernel_jit
def zo_kernel(p_ptrs, m_ptrs, v_ptrs, offsets, numels, row_starts, decays, thresholds, prog_first, tensors, rows,
              mask_ptr, z_ptr, key0, key1, c_a, c_b, grad, lr, wd, b1, omb1, b2, omb2, bc1, bc2, adam_eps,
              keys_ptr, grads_ptr, moves_ptr, mu,
              PHASE: tl.constexpr, OPT: tl.constexpr, DTYPE: tl.constexpr, GAUSSIAN: tl.constexpr,
              MASK: tl.constexpr, B4: tl.constexpr, SEARCH: tl.constexpr, MULTI: tl.constexpr, Q: tl.constexpr,
              N_MOVES: tl.constexpr):
    """One phase for B4 rows of a group of `tensors` tensors of one dtype.

    The tensors lie end to end in rows of one Philox counter (four elements) each: tensor t holds rows
    row_starts[t] .. row_starts[t+1] - 1, its row j being counter (offsets[t] >> 2) + j. Program `pid`
    takes rows pid*B4 .. + B4 - 1, each finding its tensor among the 2**SEARCH after prog_first[pid].
    Sparse-MeZO's mask holds bit (s & 7) of byte (s >> 3) for slot s = 4 * row + lane. MULTI reads the
    Q keys, their G_j and the moves from `keys_ptr`, `grads_ptr` and `moves_ptr`."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid * B4 + tl.arange(0, B4).to(tl.int64)
    t = tl.full((B4,), 0, tl.int32) + tl.load(prog_first + pid)
    for i in tl.static_range(SEARCH):
        candidate = t + (1 << (SEARCH - 1 - i))
        start = tl.load(row_starts + candidate, mask=candidate <= tensors, other=0x7FFFFFFFFFFFFFFF)
        t = tl.where(start <= row, candidate, t)
    offset = tl.load(offsets + t)
    n = tl.load(numels + t)
    local = row - tl.load(row_starts + t)
    k0 = (tl.full((B4,), 0, tl.int64) + key0).to(tl.uint32)  # drops bit 32
    k1 = (tl.full((B4,), 0, tl.int64) + key1).to(tl.uint32)
    z = _perturbation((offset >> 2) + local, k0, k1, GAUSSIAN, B4)
    lane = tl.arange(0, 4).to(tl.int64)
    idx = (4 * local - (offset & 3))[:, None] + lane[None, :]
    inb = (idx >= 0) & (idx < n[:, None]) & (row < rows)[:, None]
    if PHASE == PHASE_Z:
        tl.store(z_ptr + idx, z, mask=inb)
    else:
        p = _pointers(p_ptrs, t, DTYPE)[:, None] + idx
        x = _load(p, 0, inb, DTYPE)
        zd = _round(z, DTYPE)
        decay = (tl.load(decays + t) != 0)[:, None]
        if OPT == OPT_SPARSE:
            byte = pid * (B4 // 2) + tl.arange(0, B4 // 2).to(tl.int64)
            in_mask = byte < (rows + 1) // 2
            if MASK == MASK_READ:
                packed = tl.load(mask_ptr + byte, mask=in_mask, other=0).to(tl.int32)
                bits = (packed[:, None] >> tl.arange(0, 8)[None, :]) & 1
                sel = tl.reshape(bits, (B4, 4)) != 0
            else:
                sel = tl.abs(x) <= tl.load(thresholds + t)[:, None]
                if MASK == MASK_MAKE:
                    tl.store(mask_ptr + byte, _pack_bytes(sel & inb, B4), mask=in_mask)
        if MULTI and (PHASE == PHASE_UPDATE or PHASE == PHASE_STEP):
            ctr = (offset >> 2) + local
            out = x
            for j in tl.static_range(Q):
                kj0 = (tl.full((B4,), 0, tl.int64) + tl.load(keys_ptr + 2 * j)).to(tl.uint32)
                kj1 = (tl.full((B4,), 0, tl.int64) + tl.load(keys_ptr + 2 * j + 1)).to(tl.uint32)
                zdj = _round(_perturbation(ctr, kj0, kj1, GAUSSIAN, B4), DTYPE)
                gzj = zdj * tl.load(grads_ptr + j)
                if j == 0:
                    acc = gzj
                else:
                    acc = acc + gzj
                if PHASE == PHASE_STEP:
                    out = _perturb(out, zdj, c_a, DTYPE)
                    out = _perturb(out, zdj, c_b, DTYPE)
                    out = _perturb(out, zdj, c_a, DTYPE)
            if OPT == OPT_ADAM or OPT == OPT_MMT:
                mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))[:, None] + idx
                m = tl.load(mp, mask=inb, other=0.0)
                if OPT == OPT_ADAM:
                    vp = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))[:, None] + idx
                    v = tl.load(vp, mask=inb, other=0.0)
                    mb = m * b1
                    gb = acc * omb1
                    m = mb + gb
                    vb = v * b2
                    gg = acc * acc
                    gb2 = gg * omb2
                    v = vb + gb2
                    tl.store(vp, v, mask=inb)
                    num = m * bc1
                    root = tl.math.sqrt_rn(v * bc2)
                    u = tl.math.div_rn(num, root + adam_eps)
                else:
                    mm = m * mu
                    m = mm + acc
                    u = m
                tl.store(mp, m, mask=inb)
                xw = out * wd
                u = tl.where(decay, u + xw, u)
                step = _round(u * lr, DTYPE)
                out = _round(out - step, DTYPE)
            else:
                for r in tl.static_range(N_MOVES):
                    out = _move(out, acc, tl.load(moves_ptr + r), wd, decay, OPT == OPT_SIGN, DTYPE)
        elif PHASE == PHASE_PERTURB:
            out = _perturb(x, zd, c_a, DTYPE)
        elif PHASE == PHASE_STEP:
            out = _perturb(x, zd, c_a, DTYPE)
            out = _perturb(out, zd, c_b, DTYPE)
            out = _perturb(out, zd, c_a, DTYPE)
        else:
            out = x
        if not MULTI and (PHASE == PHASE_UPDATE or PHASE == PHASE_STEP):
            if OPT == OPT_ADAM:
                mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))[:, None] + idx
                vp = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))[:, None] + idx
                m = tl.load(mp, mask=inb, other=0.0)
                v = tl.load(vp, mask=inb, other=0.0)
                gz = zd * grad
                mb = m * b1
                gb = gz * omb1
                m = mb + gb
                vb = v * b2
                gg = gz * gz
                gb2 = gg * omb2
                v = vb + gb2
                tl.store(mp, m, mask=inb)
                tl.store(vp, v, mask=inb)
                num = m * bc1
                root = tl.math.sqrt_rn(v * bc2)
                u = tl.math.div_rn(num, root + adam_eps)
                xw = out * wd
                u = tl.where(decay, u + xw, u)
                step = _round(u * lr, DTYPE)
                out = _round(out - step, DTYPE)
            else:
                out = _sgd(out, zd, grad, lr, wd, decay, DTYPE)
        if OPT == OPT_SPARSE:
            out = tl.where(sel, out, x)
        _store(p, 0, inb, out, DTYPE)
