"""The device conversion code of templates/common/lowbit.cuh, proven on the CPU.

The header's conversion core is plain C++ on IEEE bit patterns, so it compiles as host code.
A small harness built with g++ calls the very functions the kernels call, and is compared with
ml_dtypes: fp8 decode on all 256 codes of both formats; f32 -> fp8 encode on every float32
whose exponent lies in or near the fp8 range (both signs, every mantissa: all ties, all
subnormals, ±max and just above it) plus random bit patterns, ±inf and NaNs; f64 -> fp8 on
ties ± one double ulp (where rounding through float32 would differ) and random doubles; the
e8m0 rule and scales; int4 packing. ``SKUFORGE_EXHAUSTIVE=1`` widens f32 -> fp8 to all 2**32
bit patterns (about a minute per format). Skipped when g++ is missing.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from runtime import kinds  # noqa: E402
from runtime import reference as ref  # noqa: E402
from tests import knobs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER_DIR = os.path.join(ROOT, "templates", "common")
FORMATS = {"fp8_e4m3": 0, "fp8_e5m2": 1}
ML = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}

HARNESS = r"""
#include "lowbit.cuh"
#define EACH_FORMAT(fmt, CALL) do { if (fmt == 0) { CALL(Fp8E4M3); } else { CALL(Fp8E5M2); } } while (0)
extern "C" {
void enc_f32_bits(unsigned long long start, unsigned long long n, int fmt, unsigned char* out) {
#define ENC(F) for (unsigned long long i = 0; i < n; ++i) out[i] = fp8_encode<F>(sf_f32_from((unsigned)(start + i)))
    EACH_FORMAT(fmt, ENC);
#undef ENC
}
void enc_f32(const float* x, long n, int fmt, unsigned char* out) {
#define ENC(F) for (long i = 0; i < n; ++i) out[i] = fp8_encode<F>(x[i])
    EACH_FORMAT(fmt, ENC);
#undef ENC
}
void enc_f64(const double* x, long n, int fmt, unsigned char* out) {
#define ENC(F) for (long i = 0; i < n; ++i) out[i] = fp8_encode<F>(x[i])
    EACH_FORMAT(fmt, ENC);
#undef ENC
}
void dec(int fmt, float* f32, double* f64) {
#define DEC(F) for (unsigned c = 0; c < 256; ++c) { f32[c] = fp8_decode_f32<F>(c); f64[c] = fp8_decode_f64<F>(c); }
    EACH_FORMAT(fmt, DEC);
#undef DEC
}
void e8m0_codes_f32(const float* a, long n, int fmt, unsigned char* out) {
#define E8(F) for (long i = 0; i < n; ++i) out[i] = e8m0_from_amax<F>(a[i])
    EACH_FORMAT(fmt, E8);
#undef E8
}
void e8m0_codes_f64(const double* a, long n, int fmt, unsigned char* out) {
#define E8(F) for (long i = 0; i < n; ++i) out[i] = e8m0_from_amax<F>(a[i])
    EACH_FORMAT(fmt, E8);
#undef E8
}
void e8m0_scales(float* f32, double* f64) {
    for (unsigned c = 0; c < 256; ++c) { f32[c] = e8m0_to_f32(c); f64[c] = e8m0_to_f64(c); }
}
void pack(const int* v, long pairs, unsigned char* out) {
    for (long i = 0; i < pairs; ++i) out[i] = int4_pack(v[2 * i], v[2 * i + 1]);
}
void unpack(const unsigned char* b, long n, int is_signed, int* out) {
    for (long i = 0; i < n; ++i) {
        out[2 * i] = is_signed ? s4_lo(b[i]) : u4_lo(b[i]);
        out[2 * i + 1] = is_signed ? s4_hi(b[i]) : u4_hi(b[i]);
    }
}
}
"""

P = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    d = tmp_path_factory.mktemp("lowbit_harness")
    src, so = d / "harness.cpp", d / "harness.so"
    src.write_text(HARNESS)
    # -O2, no fast-math: IEEE semantics as on the device (the core is integer code anyway)
    subprocess.run([gxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    "-I", HEADER_DIR, str(src), "-o", str(so)], check=True, capture_output=True, text=True)
    h = ctypes.CDLL(str(so))
    for name, args in {"enc_f32_bits": [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int, P],
                       "enc_f32": [P, ctypes.c_long, ctypes.c_int, P], "enc_f64": [P, ctypes.c_long, ctypes.c_int, P],
                       "dec": [ctypes.c_int, P, P], "e8m0_codes_f32": [P, ctypes.c_long, ctypes.c_int, P],
                       "e8m0_codes_f64": [P, ctypes.c_long, ctypes.c_int, P], "e8m0_scales": [P, P],
                       "pack": [P, ctypes.c_long, P], "unpack": [P, ctypes.c_long, ctypes.c_int, P]}.items():
        getattr(h, name).argtypes = args
        getattr(h, name).restype = None
    return h


def _ptr(a):
    return a.ctypes.data_as(P)


def enc_bits(lib, start, n, kind):
    out = np.empty(n, np.uint8)
    lib.enc_f32_bits(start, n, FORMATS[kind], _ptr(out))
    return out


def enc(lib, x, kind):
    x = np.ascontiguousarray(x)
    out = np.empty(x.size, np.uint8)
    (lib.enc_f64 if x.dtype == np.float64 else lib.enc_f32)(_ptr(x), x.size, FORMATS[kind], _ptr(out))
    return out


def ml_encode_f32(x, kind):
    """ml_dtypes' own float32 cast (a single rounding), plus satfinite and the canonical NaN code."""
    mx = np.float32(kinds.kind(kind).max)
    with np.errstate(invalid="ignore"):
        codes = np.clip(x, -mx, mx).astype(ML[kind]).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), codes)


def _mismatch(x_bits, got, want):
    bad = np.flatnonzero(got != want)
    if not bad.size:
        return ""
    i = bad[:5]
    return f"{bad.size} mismatches, e.g. bits {[hex(int(b)) for b in x_bits[i]]}: got {got[i]} want {want[i]}"


# -- decode: all 256 codes -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", FORMATS)
def test_decode_every_code(lib, kind):
    f32, f64 = np.empty(256, np.float32), np.empty(256, np.float64)
    lib.dec(FORMATS[kind], _ptr(f32), _ptr(f64))
    want = np.arange(256, dtype=np.uint8).view(ML[kind])
    for got, w in ((f32, want.astype(np.float32)), (f64, want.astype(np.float64))):
        nan = np.isnan(w)
        assert (np.isnan(got) == nan).all()
        # bit for bit, -0 included
        assert (got[~nan].view(f"u{got.itemsize}") == w[~nan].view(f"u{w.itemsize}")).all()
    assert nan.sum() == (2 if kind == "fp8_e4m3" else 6)
    if kind == "fp8_e5m2":
        assert np.isinf(f32).sum() == 2


# -- encode from float32 ------------------------------------------------------------------------
CHUNK = 1 << 24


def _binade_ranges(kind):
    """Bit ranges (start, count) of every float32 with an exponent from a quarter of the smallest
    fp8 subnormal to twice the largest fp8 value, both signs."""
    lo_exp = kinds.kind(kind).emin - kinds.kind(kind).mbits - 2
    hi_exp = kinds.kind(kind).emax + 1
    start = (lo_exp + 127) << 23
    end = (hi_exp + 128) << 23
    return [(sign | start, end - start) for sign in (0, 1 << 31)]


@pytest.mark.parametrize("kind", FORMATS)
def test_encode_f32_every_float_of_the_fp8_range(lib, kind):
    total = 0
    for start, count in _binade_ranges(kind):
        for s in range(start, start + count, CHUNK):
            n = min(CHUNK, start + count - s)
            bits = np.arange(s, s + n, dtype=np.uint64).astype(np.uint32)
            msg = _mismatch(bits, enc_bits(lib, s, n, kind), ml_encode_f32(bits.view(np.float32), kind))
            assert not msg, f"{kind}: {msg}"
            total += n
    assert total >= 2 * 20 * (1 << 23)


@pytest.mark.parametrize("kind", FORMATS)
def test_encode_f32_edges_and_random(lib, kind, rng):
    mx = kinds.kind(kind).max
    edges = np.array([0.0, -0.0, mx, -mx, np.nextafter(np.float32(mx), np.float32(np.inf)), -np.nextafter(np.float32(mx), np.float32(np.inf)),
                      1e30, -1e30, np.inf, -np.inf, np.float32(3.4e38), 1e-45, -1e-45, 1.1754942e-38], np.float32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    rand = rng.integers(0, 1 << 32, size=1 << 22, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([edges, nans, rand])
    got = enc(lib, x, kind)
    assert not _mismatch(x.view(np.uint32), got, ml_encode_f32(x, kind))
    assert (got[len(edges):len(edges) + len(nans)] == 0x7F).all()          # NaN -> 0x7F, sign dropped
    max_code = 0x7E if kind == "fp8_e4m3" else 0x7B
    np.testing.assert_array_equal(got[2:10], [max_code, 0x80 | max_code] * 4)   # ±max, just above, huge, ±inf
    assert got[10] == max_code and got[11] == 0x00 and got[12] == 0x80         # 3.4e38; ±1e-45 round to ±0
    assert got[0] == 0x00 and got[1] == 0x80


@pytest.mark.skipif(not knobs.exhaustive(), reason="set SKUFORGE_EXHAUSTIVE=1: all 2**32 floats")
@pytest.mark.slow
@pytest.mark.parametrize("kind", FORMATS)
def test_encode_f32_exhaustive(lib, kind):
    for s in range(0, 1 << 32, CHUNK):
        bits = np.arange(s, s + CHUNK, dtype=np.uint64).astype(np.uint32)
        msg = _mismatch(bits, enc_bits(lib, s, CHUNK, kind), ml_encode_f32(bits.view(np.float32), kind))
        assert not msg, f"{kind}: {msg}"


# -- encode from float64: one rounding, not two ------------------------------------------------------
def _exact_f64_encode(x, kind):
    """A third, independent definition: round |x| with Python integers/fractions."""
    from fractions import Fraction
    out = []
    mb, emin, mx = kinds.kind(kind).mbits, kinds.kind(kind).emin, kinds.kind(kind).max
    grid = np.arange(256, dtype=np.uint8).view(ML[kind]).astype(np.float64)
    for v in x:
        if np.isnan(v):
            out.append(0x7F)
            continue
        sign = 0x80 if np.signbit(v) else 0
        a = min(abs(Fraction(float(v))) if np.isfinite(v) else Fraction(mx), Fraction(mx))
        e = max(emin, (a.numerator.bit_length() - a.denominator.bit_length()) if a else emin)
        while a and Fraction(2) ** e > a:
            e -= 1
        e = max(e, emin)
        quantum = Fraction(2) ** (e - mb)
        k, r = divmod(a, quantum)
        k = int(k) + (1 if r > quantum / 2 or (r == quantum / 2 and int(k) % 2) else 0)
        val = k * quantum
        code = int(np.flatnonzero(grid == float(val))[0]) if val else 0
        out.append(sign | code)
    return np.array(out, np.uint8)


@pytest.mark.parametrize("kind", FORMATS)
def test_encode_f64_single_rounding(lib, kind, rng):
    grid = np.arange(256, dtype=np.uint8).view(ML[kind]).astype(np.float64)
    g = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = (g[:-1] + g[1:]) / 2                                    # every tie, exact in float64
    near = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), g,
                           np.nextafter(g, np.inf), np.nextafter(g, -np.inf)])
    x = np.concatenate([near, -near, [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e300, -1e-300, 5e-324],
                        rng.standard_normal(200_000) * 10.0 ** rng.uniform(-6, 6, 200_000)])
    got = enc(lib, x, kind)
    np.testing.assert_array_equal(got, ref.fp8_encode(x, kind))
    sample = np.concatenate([x[:4 * len(mids)], rng.choice(x, 2000)])
    np.testing.assert_array_equal(enc(lib, sample, kind), _exact_f64_encode(sample, kind))
    # rounding through float32 first would differ just above/below ties: the point of the f64 path
    above = np.nextafter(mids, np.inf)
    assert (enc(lib, above, kind) != enc(lib, above.astype(np.float32), kind)).any()


def test_reference_f32_path_equals_ml_dtypes(rng):
    # runtime.reference.fp8_encode (grid rounding in float64) == ml_dtypes' own float32 cast
    x = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for kind in FORMATS:
        np.testing.assert_array_equal(ref.fp8_encode(x, kind), ml_encode_f32(x, kind))


# -- e8m0 and int4 --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FORMATS)
def test_e8m0_rule(lib, kind, rng):
    powers = np.ldexp(1.0, np.arange(-149, 128))
    a32 = np.concatenate([powers, np.nextafter(powers, 0), np.nextafter(powers, np.inf), [0.0, np.inf, 1e-45, 3.4e38],
                          np.abs(rng.standard_normal(100_000)) * 10.0 ** rng.uniform(-40, 37, 100_000)]).astype(np.float32)
    got = np.empty(a32.size, np.uint8)
    lib.e8m0_codes_f32(_ptr(a32), a32.size, FORMATS[kind], _ptr(got))
    np.testing.assert_array_equal(got, ref.e8m0_from_amax(a32, kind))
    a64 = np.concatenate([np.ldexp(1.0, np.arange(-1074, 1024)), [0.0, np.inf, 1e-310],
                          np.abs(rng.standard_normal(10_000)) * 10.0 ** rng.uniform(-300, 300, 10_000)])
    got = np.empty(a64.size, np.uint8)
    lib.e8m0_codes_f64(_ptr(a64), a64.size, FORMATS[kind], _ptr(got))
    np.testing.assert_array_equal(got, ref.e8m0_from_amax(a64, kind))
    # by hand: amax = 448 (e4m3 max) -> 2^0; 1.0 -> 2^-8; 0 -> 2^-127 (code 0); inf -> 2^127
    if kind == "fp8_e4m3":
        np.testing.assert_array_equal(ref.e8m0_from_amax(np.float32([448, 1.0, 0, np.inf, 511.9]), kind),
                                      [127, 119, 0, 254, 127])


def test_e8m0_scales(lib):
    f32, f64 = np.empty(256, np.float32), np.empty(256, np.float64)
    lib.e8m0_scales(_ptr(f32), _ptr(f64))
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    assert np.isnan(f32[255]) and np.isnan(f64[255])
    np.testing.assert_array_equal(f32[:255], want[:255].astype(np.float32))
    np.testing.assert_array_equal(f64[:255], want[:255].astype(np.float64))
    np.testing.assert_array_equal(f32[:255], ref.e8m0_scale(np.arange(255, dtype=np.uint8)))
    assert f32[0] == np.float32(2.0 ** -127) and f32[0] > 0           # a float32 subnormal, exact


def test_int4_pack_unpack(lib, rng):
    for kind, lo, hi in (("s4", -8, 7), ("u4", 0, 15)):
        v = rng.integers(lo, hi + 1, size=(64, 2 * 333)).astype(np.int32)
        got = np.empty(v.size // 2, np.uint8)
        lib.pack(_ptr(v), v.size // 2, _ptr(got))
        np.testing.assert_array_equal(got.reshape(64, 333), ref.pack_int4(v))
        back = np.empty(v.size, np.int32)
        lib.unpack(_ptr(got), got.size, int(kind == "s4"), _ptr(back))
        np.testing.assert_array_equal(back.reshape(v.shape), v)
        np.testing.assert_array_equal(ref.unpack_int4(ref.pack_int4(v), kind), v)
        # ml_dtypes' int4 / uint4 agree on the value range
        dt = ml_dtypes.int4 if kind == "s4" else ml_dtypes.uint4
        assert int(ml_dtypes.iinfo(dt).min) == lo and int(ml_dtypes.iinfo(dt).max) == hi
    # element 2i in the low nibble, 2i + 1 in the high nibble
    assert ref.pack_int4(np.array([1, 2]))[0] == 0x21
    assert ref.pack_int4(np.array([-1, -8]))[0] == 0x8F
