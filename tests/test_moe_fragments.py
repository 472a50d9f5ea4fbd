"""CPU: the mma kernel's index maps, emulated in NumPy with the PTX semantics of cp.async
(producer chunk map), ldmatrix (.x4, .trans), mma.m16n8k16 and the accumulator layout.

The formulas below are transcribed from templates/moe/_mma.cu.j2; a wrong swizzle, fragment
or epilogue index makes one 128 x 128 x BK tile disagree with ``A @ B.T``. Both BK the
template supports are emulated; the matrix's BK is among them.
"""
import numpy as np
import pytest

from codegen.matrix import MOE_TILES

BM = BN = 128
THREADS = 128
BK = MOE_TILES["mma"]["BK"]
assert BK in (32, 64), "the template's fragment maps support BK 32 and 64"


def kmaj_off(r, c):
    return r * BK + ((c ^ ((r & 7) if BK == 64 else ((r >> 1) & 3))) << 3)


def mnmaj_off(r, c):
    return r * 128 + ((c ^ (r & 7)) << 3)


def store_operand(op, kmaj: bool, a_or_b: str) -> np.ndarray:
    """Producer: op is the logical [128 (rows of the output tile), BK] operand; returns smem."""
    smem = np.full(128 * BK, np.nan)
    written = np.zeros(128 * BK, int)
    kch = BK // 8
    for tid in range(THREADS):
        for i in range(BM * kch // THREADS if kmaj else BK // 8):
            if kmaj:   # rows (tid >> 2) + 32 i', chunks (tid & 3) + 4 j
                r, c = (tid >> 2) + 32 * (i % 4), (tid & 3) + 4 * (i // 4)
                src = op[r, c * 8: c * 8 + 8]                # row r (output axis), reduction chunk c
                off = kmaj_off(r, c)
            else:
                r, c = (tid >> 4) + 8 * i, tid & 15
                src = op[c * 8: c * 8 + 8, r]                # reduction row r, output chunk c
                off = mnmaj_off(r, c)
            smem[off: off + 8] = src
            written[off: off + 8] += 1
    assert np.all(written == 1), f"{a_or_b}: the producer does not cover the tile exactly once"
    return smem


def ldmatrix_x4(smem, addrs, trans):
    """addrs[lane] = element offset of row (lane % 8) of matrix lane // 8. Returns regs[lane][j] =
    (lo, hi) element pair, per the PTX ldmatrix fragment layout."""
    mats = [np.stack([smem[addrs[8 * j + i]: addrs[8 * j + i] + 8] for i in range(8)]) for j in range(4)]
    regs = []
    for t in range(32):
        row = []
        for j in range(4):
            m = mats[j]
            if trans:
                row.append((m[2 * (t % 4), t // 4], m[2 * (t % 4) + 1, t // 4]))
            else:
                row.append((m[t // 4, 2 * (t % 4)], m[t // 4, 2 * (t % 4) + 1]))
        regs.append(row)
    return regs


def mma(acc, a, b0, b1):
    """acc[lane][4] += A(16x16) @ B(16x8) with the m16n8k16 register layouts."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, c = t // 4, t % 4
        A[g, 2 * c: 2 * c + 2] = a[t][0]
        A[g + 8, 2 * c: 2 * c + 2] = a[t][1]
        A[g, 2 * c + 8: 2 * c + 10] = a[t][2]
        A[g + 8, 2 * c + 8: 2 * c + 10] = a[t][3]
        B[2 * c: 2 * c + 2, g] = b0[t]
        B[2 * c + 8: 2 * c + 10, g] = b1[t]
    C = A @ B
    for t in range(32):
        g, c = t // 4, t % 4
        acc[t][0] += C[g, 2 * c]
        acc[t][1] += C[g, 2 * c + 1]
        acc[t][2] += C[g + 8, 2 * c]
        acc[t][3] += C[g + 8, 2 * c + 1]


def run_tile(opA, opB, a_kmaj, b_kmaj):
    sA = store_operand(opA, a_kmaj, "A")
    sB = store_operand(opB, b_kmaj, "B")
    out = np.full((BM, BN), np.nan)
    for warp in range(4):
        m_w, n_w = (warp >> 1) * 64, (warp & 1) * 64
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(32)]   # [mi*8+nj][lane][4]
        for kk in range(0, BK, 16):
            a_frag, b_frag = [], []
            for mi in range(4):
                addrs = []
                for lane in range(32):
                    li, lj = lane & 7, lane >> 3
                    if a_kmaj:
                        r = m_w + 16 * mi + (lane & 15)
                        addrs.append(kmaj_off(r, (kk >> 3) + (lane >> 4)))
                    else:
                        r = kk + li + ((lj >> 1) << 3)
                        addrs.append(mnmaj_off(r, ((m_w + 16 * mi) >> 3) + (lj & 1)))
                # ldmatrix takes the address of row (lane % 8) of matrix (lane // 8) from each lane
                a_frag.append(ldmatrix_x4(sA, addrs, not a_kmaj))
            for np_ in range(4):
                addrs = []
                for lane in range(32):
                    li, lj = lane & 7, lane >> 3
                    if b_kmaj:
                        r = n_w + 16 * np_ + li + ((lj >> 1) << 3)
                        addrs.append(kmaj_off(r, (kk >> 3) + (lj & 1)))
                    else:
                        r = kk + li + ((lj & 1) << 3)
                        addrs.append(mnmaj_off(r, ((n_w + 16 * np_) >> 3) + (lj >> 1)))
                b_frag.append(ldmatrix_x4(sB, addrs, not b_kmaj))
            for mi in range(4):
                for nj in range(8):
                    b = b_frag[nj >> 1]
                    mma(acc[mi * 8 + nj], a_frag[mi],
                        [b[t][(nj & 1) * 2] for t in range(32)], [b[t][(nj & 1) * 2 + 1] for t in range(32)])
        for mi in range(4):
            for h in range(2):
                for lane in range(32):
                    lr = m_w + 16 * mi + (lane >> 2) + 8 * h
                    for nj in range(8):
                        c = n_w + 8 * nj + 2 * (lane & 3)
                        out[lr, c] = acc[mi * 8 + nj][lane][2 * h]
                        out[lr, c + 1] = acc[mi * 8 + nj][lane][2 * h + 1]
    return out


@pytest.fixture(params=[32, 64], autouse=True)
def bk(request, monkeypatch):
    monkeypatch.setitem(globals(), "BK", request.param)
    return request.param


@pytest.mark.parametrize("a_kmaj,b_kmaj,name", [(True, True, "forward: x, w both K-major"),
                                                (True, False, "backward-input: dy K-major, w MN-major"),
                                                (False, False, "backward-weight: dy, x both MN-major")])
def test_mma_tile_maps(a_kmaj, b_kmaj, name):
    rng = np.random.default_rng(0)
    A = rng.integers(-4, 5, (BM, BK)).astype(np.float64)
    B = rng.integers(-4, 5, (BN, BK)).astype(np.float64)
    got = run_tile(A, B, a_kmaj, b_kmaj)
    np.testing.assert_array_equal(got, A @ B.T, err_msg=name)


def test_ldmatrix_reads_are_bank_conflict_free():
    """Each 8-lane phase of an ldmatrix reads 8 rows of 16 bytes: distinct 16-byte bank groups."""
    for r0 in range(0, 128, 8):
        for c in range(BK // 8):
            groups = {((kmaj_off(r0 + i, c) * 2) // 16) % 8 for i in range(8)}
            assert len(groups) == 8, ("K-major", r0, c)
    for r0 in range(0, BK, 8):
        for c in range(16):
            groups = {((mnmaj_off(r0 + i, c) * 2) // 16) % 8 for i in range(8)}
            assert len(groups) == 8, ("MN-major", r0, c)
