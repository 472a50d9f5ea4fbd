"""The cvt-free rounding of templates/common/prelude.cuh, checked as IEEE arithmetic in NumPy.

The kernels round t = x * inv to an integer code without a float -> int conversion instruction:
``quant_code_bits`` clamps t to [qmin - zp, qmax - zp], adds MAGIC = 1.5 * 2^23 (2^52 for
double) and keeps the low bits of the sum's bit pattern; ``rne_bounded`` adds and subtracts
MAGIC. These tests replay exactly those IEEE operations with NumPy (single rounding per
operation, round half to even, like the GPU with --fmad=false) and compare them with the
reference's ``clamp(rint(t) + zp)``, NaN -> zp, on ties, saturation, non-finite values and random
data. The kernels themselves are compared with the reference on the GPU (`codegen verify`).
"""
import numpy as np
import pytest

RANGES = [(-128, 127, 0), (-127, 127, 0), (0, 255, 128), (0, 255, 0), (0, 255, 255), (-8, 7, 0),
          (0, 15, 8), (0, 15, 3), (-8, 7, -8), (-100, 27, 13)]
MAGIC = {np.float32: (np.float32(12582912.0), np.int32), np.float64: (np.float64(6755399441055744.0), np.int64)}


def probe_values(dtype, rng):
    k = np.arange(-300, 301, dtype=dtype)
    eps = np.finfo(dtype).eps
    ties = np.concatenate([k + dtype(0.5), k - dtype(0.5)])
    near = np.concatenate([np.nextafter(ties, dtype(np.inf)), np.nextafter(ties, dtype(-np.inf))])
    big = np.array([2.0 ** 22, -2.0 ** 22, 2.0 ** 22 + 1, 2.0 ** 23 - 1, 2.0 ** 23, -2.0 ** 23, 2.0 ** 24 + 2,
                    1e30, -1e30, np.finfo(dtype).max, -np.finfo(dtype).max, np.inf, -np.inf, np.nan, -np.nan,
                    0.0, -0.0, np.finfo(dtype).tiny, -np.finfo(dtype).tiny, eps, 0.5 - eps / 4, -0.5 + eps / 4],
                   dtype=dtype)
    rand = np.concatenate([rng.uniform(-400, 400, 200_000), rng.standard_normal(100_000) * 1e6]).astype(dtype)
    return np.concatenate([k, ties, near, big, rand])


def reference_code(t, qmin, qmax, zp):
    with np.errstate(invalid="ignore"):
        v = np.clip(np.rint(t) + t.dtype.type(zp), qmin, qmax)
    return np.where(np.isnan(t), zp, v).astype(np.int64)


def quant_code_bits(t, qmin, qmax, zp):
    """prelude.cuh quant_code_bits: fmin(fmax(t, lo), hi) + MAGIC, low bits + zp, NaN -> zp."""
    magic, itype = MAGIC[t.dtype.type]
    lo, hi = t.dtype.type(qmin - zp), t.dtype.type(qmax - zp)
    c = np.fmin(np.fmax(t, lo), hi)                     # IEEE minNum / maxNum: NaN -> lo
    bits = (c + magic).view(itype).astype(np.int64) + zp
    return np.where(np.isnan(t), zp, bits)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("qmin,qmax,zp", RANGES)
def test_quant_code_bits_low_bits_are_the_code(dtype, qmin, qmax, zp, rng):
    t = probe_values(dtype, rng)
    ref = reference_code(t, qmin, qmax, zp)
    got = quant_code_bits(t, qmin, qmax, zp)
    assert np.array_equal(got & 0xFF, ref & 0xFF)       # the byte an 8-bit kernel stores
    assert np.array_equal(got & 0xF, ref & 0xF)         # the nibble an int4 kernel packs
    assert ref.min() >= qmin and ref.max() <= qmax      # the reference itself saturates


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rne_bounded(dtype, rng):
    magic, _ = MAGIC[dtype]
    bound = dtype(2.0 ** 22 if dtype is np.float32 else 2.0 ** 51)
    t = probe_values(dtype, rng)
    with np.errstate(invalid="ignore", over="ignore"):
        got = (t + magic) - magic
    small = np.abs(t) <= bound
    assert np.array_equal(got[small], np.rint(t[small]))                   # exact where it claims
    large = ~small & ~np.isnan(t)
    assert np.all(np.sign(got[large]) == np.sign(t[large]))                # same side ...
    assert np.all(np.abs(got[large]) >= bound)                             # ... and out of any range
    assert np.all(np.isnan(got[np.isnan(t)]))


def test_an_odd_magic_would_break_ties():
    """Why MAGIC's low bits must be zero: folding an odd zero point into it moves ties."""
    t = np.array([0.5, 1.5, 2.5, -0.5], dtype=np.float32)
    good = (t + np.float32(12582912.0)).view(np.int32) - 0x4B400000
    bad = (t + np.float32(12582913.0)).view(np.int32) - 0x4B400001
    assert list(good) == [0, 2, 2, 0]
    assert list(bad) != list(good)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # 1 / a subnormal scale overflows, as intended
@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("eps", [1e-8, 1e-45])
def test_unchecked_path_of_the_dynamic_team_kernels(mode, eps, rng):
    """dynamic.cuh ``team_row_groups``: a row group without NaN for which ``clamp_free`` holds is quantized
    without the clamp (t + MAGIC, low bits + zp). Replayed per token row in float32: wherever the
    predicate holds, those codes equal the reference's; rows with NaN never take the path, and tiny
    eps (inv = inf) or infinite values make the predicate false."""
    from runtime.reference import dynamic_quantize_ref, dynamic_range
    x = (rng.standard_normal((64, 256)) * rng.uniform(1e-3, 1e3, (64, 1))).astype(np.float32)
    x[1, 3], x[2, :], x[3, 9], x[4, :], x[5, 7] = np.nan, 0.0, np.inf, 1e-40, -np.inf
    x[6, :] = 0.5                      # ties after scaling
    q, scale, zp = dynamic_quantize_ref(x, scope="token", mode=mode, out_dtype="s8", eps=eps)
    qmin, qmax, zsym = dynamic_range("s8", mode)
    magic = np.float32(12582912.0)
    taken = 0
    for r in range(x.shape[0]):
        row = x[r]
        if np.isnan(row).any():
            continue                   # the NaN-propagating reduction sends it to the checked path
        z = int(zp[r]) if zp is not None else zsym
        lo_b, hi_b = np.float32(qmin - z), np.float32(qmax - z)
        inv = np.float32(1) / np.float32(scale[r])
        if mode == "symmetric":
            hi = np.abs(row).max()
            lo = -hi
        else:
            lo, hi = min(row.min(), np.float32(0)), max(row.max(), np.float32(0))
        free = ((lo * inv + magic) - magic) >= lo_b and ((hi * inv + magic) - magic) <= hi_b
        if not free:
            continue
        codes = ((row * inv) + magic).view(np.int32).astype(np.int64) + z
        taken += 1
        assert np.array_equal((codes & 0xFF).astype(np.uint8), q[r].view(np.uint8)), r
    assert taken >= 55                 # the path is the common case
