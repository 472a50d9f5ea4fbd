"""CPU: the mma kernel's index maps and pipeline, emulated in NumPy with the PTX semantics of
cp.async (zero fill), ldmatrix (.x4, .trans), mma.m16n8k16 and the accumulator layout.

The formulas below are transcribed from templates/moe/mma.cuh (run<S, C>, the producers, Frag,
mainloop); a wrong swizzle, producer map, running pointer, tail predicate, fragment or epilogue
index makes an emulated output tile disagree with the float64 product. Every tile configuration
of the manifest (launch["variants"]) is emulated for the three operand layouts, on tiles with
reduction tails, partial rows / columns, row gathers and several slices; the cp.async / barrier
schedule of each pipelining mode is checked for read-after-write and write-after-read hazards.
"""
import numpy as np
import pytest

import runtime as sf

REG = sf.default_registry()
MMA = [s for s in REG.skus() if s.category == "moe" and s.backend == "mma"]
VARIANTS = {}
for _s in MMA:
    for _name, _meta in REG.lookup(_s).launch["variants"].items():
        VARIANTS[_name] = _meta["tile"]
assert "128x128x32s5" in VARIANTS, "the first measured configuration stays selectable"
SHAPES = sorted({(t["BM"], t["BN"], t["BK"], t["THREADS"]) for t in VARIANTS.values()})
SCHEDULES = sorted({(t["STAGES"], t["BK"] // 16, t["PIPE"]) for t in VARIANTS.values()})


# -- the template's index functions -------------------------------------------------------------
def kmaj_swz(bk, r):
    return (r & 7) if bk == 64 else ((r >> 1) & 3)


def kmaj_off(bk, r, c):
    return r * bk + ((c ^ kmaj_swz(bk, r)) << 3)


def mnmaj_off(w, r, c):
    return r * w + ((c ^ (r & 7)) << 3)


def in_piece(nc, q, piece):
    return (q * 4) // nc == piece


# -- PTX semantics --------------------------------------------------------------------------------
LANES = np.arange(32)
G, C4 = LANES // 4, LANES % 4


def ldmatrix_x4(smem, addrs, trans):
    """addrs[lane] = element offset of row (lane % 8) of matrix lane // 8; returns regs[lane, j, 2]."""
    addrs = np.asarray(addrs)
    rows = smem[addrs[:, None] + np.arange(8)[None, :]]          # [32, 8]: row lane % 8 of matrix lane // 8
    mats = rows.reshape(4, 8, 8)                                   # [matrix, row, col]
    out = np.empty((32, 4, 2))
    for j in range(4):
        m = mats[j]
        if trans:
            out[:, j, 0], out[:, j, 1] = m[2 * C4, G], m[2 * C4 + 1, G]
        else:
            out[:, j, 0], out[:, j, 1] = m[G, 2 * C4], m[G, 2 * C4 + 1]
    return out


def mma(acc, a, b0, b1):
    """acc[lane, 4] += A(16x16) @ B(16x8) with the m16n8k16 register layouts (a [32, 4, 2], b [32, 2])."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for j, (ro, co) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        A[G + ro, 2 * C4 + co] = a[:, j, 0]
        A[G + ro, 2 * C4 + co + 1] = a[:, j, 1]
    B[2 * C4, G], B[2 * C4 + 1, G] = b0[:, 0], b0[:, 1]
    B[2 * C4 + 8, G], B[2 * C4 + 9, G] = b1[:, 0], b1[:, 1]
    Cm = A @ B
    acc[:, 0] += Cm[G, 2 * C4]
    acc[:, 1] += Cm[G, 2 * C4 + 1]
    acc[:, 2] += Cm[G + 8, 2 * C4]
    acc[:, 3] += Cm[G + 8, 2 * C4 + 1]


# -- Frag (per-lane ldmatrix offsets, in elements) ------------------------------------------------
def frag_offsets(BM, BN, BK, m_w, n_w, a_kmaj, b_kmaj):
    li, lj = LANES & 7, LANES >> 3
    if a_kmaj:
        lr = LANES & 15
        a_off = [(m_w + lr) * BK + (((2 * ks + (LANES >> 4)) ^ kmaj_swz(BK, lr)) << 3) for ks in range(BK // 16)]
    else:
        a_off = [mnmaj_off(BM, li + ((lj >> 1) << 3), ((m_w + 16 * mi) >> 3) + (lj & 1)) for mi in range(4)]
    if b_kmaj:
        lr = li + ((lj >> 1) << 3)
        b_off = [(n_w + lr) * BK + (((2 * ks + (lj & 1)) ^ kmaj_swz(BK, lr)) << 3) for ks in range(BK // 16)]
    else:
        b_off = [mnmaj_off(BN, li + ((lj & 1) << 3), ((n_w + 16 * np_) >> 3) + (lj >> 1)) for np_ in range(4)]
    return a_off, b_off


def frag_load(sA, sB, offs, ks, BM, BN, BK, a_kmaj, b_kmaj):
    a_off, b_off = offs
    a = [ldmatrix_x4(sA, a_off[ks] + mi * 16 * BK if a_kmaj else a_off[mi] + ks * 16 * BM, not a_kmaj)
         for mi in range(4)]
    b = [ldmatrix_x4(sB, b_off[ks] + np_ * 16 * BK if b_kmaj else b_off[np_] + ks * 16 * BN, not b_kmaj)
         for np_ in range(4)]
    return a, b


# -- producers (one slice into one stage), transcribed per op ------------------------------------
class Stage:
    def __init__(self, a_elems, b_elems):
        self.a = np.full(a_elems, np.nan)
        self.b = np.full(b_elems, np.nan)
        self.wa = np.zeros(a_elems, int)
        self.wb = np.zeros(b_elems, int)

    def copy(self, which, dst, src_flat, src, ok):
        """cp.async 16 bytes (8 elements), src-size 16 or 0 (zero fill)."""
        buf, cnt = (self.a, self.wa) if which == "A" else (self.b, self.wb)
        if ok:
            assert 0 <= src_flat and src_flat + 8 <= src.size, "cp.async reads outside the operand"
            buf[dst: dst + 8] = src.ravel()[src_flat: src_flat + 8]
        else:
            buf[dst: dst + 8] = 0.0
        cnt[dst: dst + 8] += 1


def emulate_tile(op, tile, rng, R, rows_valid, cols_valid, perm=False):
    """One output tile of op through every slice: returns (got, want) on the valid region."""
    BM, BN, BK, THREADS = tile["BM"], tile["BN"], tile["BK"], tile["THREADS"]
    a_kmaj, b_kmaj = op in ("fwd", "dgrad"), op == "fwd"
    KT = -(-R // BK)
    stage = None
    if op == "fwd":     # A = x rows (gathered) [*, K], B = w[e] [N, K]; R = K
        lda, w_sn = R + 8, R + 16
        X = rng.integers(-3, 4, (BM + 9, lda)).astype(float)
        W = rng.integers(-3, 4, (cols_valid + 3, w_sn)).astype(float)
        col0 = 3                                       # COLS = col0 + cols_valid
        COLS = col0 + cols_valid
        W = np.concatenate([rng.integers(-3, 4, (col0, w_sn)).astype(float), W[:cols_valid]], 0)
        rows = list(rng.permutation(BM + 9)[:rows_valid]) + [-1] * (BM - rows_valid)
        want = X[rows[:rows_valid], :R] @ W[col0:COLS, :R].T
    elif op == "dgrad":  # A = dy rows (gathered) [*, N], B = w[e] [N rows, K cols]; R = N
        lda, w_sn = R + 8, 3 + cols_valid + 5
        X = rng.integers(-3, 4, (BM + 9, lda)).astype(float)     # dy
        W = rng.integers(-3, 4, (R, w_sn)).astype(float)
        col0, COLS = 3, 3 + cols_valid
        rows = list(rng.permutation(BM + 9)[:rows_valid]) + [-1] * (BM - rows_valid)
        want = X[rows[:rows_valid], :R] @ W[:R, col0:COLS]
    else:                # dw tile: A = dy [rows of e, n], B = x [rows of e, k]; R = rows of expert e
        p0 = 5
        lddy, ldx = 3 + rows_valid + 5, 3 + cols_valid + 11
        DY = rng.integers(-3, 4, (p0 + R + 7, lddy)).astype(float)
        XX = rng.integers(-3, 4, (p0 + R + 7, ldx)).astype(float)
        row0, col0 = 3, 3                               # n range [row0, N), k range [col0, K)
        N, K = row0 + rows_valid, col0 + cols_valid
        order = rng.permutation(p0 + R + 7) if perm else np.arange(p0 + R + 7)
        sel = order[p0: p0 + R]
        want = DY[sel, row0:N].T @ XX[sel, col0:K]
    A_ELEMS, B_ELEMS = BM * BK, BN * BK
    out = np.full((BM, BN), np.nan)
    accs = {}
    warps = THREADS // 32
    WN = BN // 64
    offs = {w: frag_offsets(BM, BN, BK, (w // WN) * 64, (w % WN) * 64, a_kmaj, b_kmaj) for w in range(warps)}
    for w in range(warps):
        accs[w] = np.zeros((4, 8, 32, 4))
    # per-thread producer state (mirrors the registers of run<S, C>)
    st = []
    for tid in range(THREADS):
        s = {}
        if op in ("fwd", "dgrad"):
            RPP = THREADS // 4
            s["kc"], s["kr0"] = tid & 3, tid >> 2
            s["k_dst"] = [kmaj_off(BK, s["kr0"], s["kc"] + 4 * j) for j in range(BK // 32)]
            s["a_row"] = [max(rows[s["kr0"] + RPP * i], 0) for i in range(BM // RPP)]
            if op == "fwd":
                s["b_row"] = [(col0 + s["kr0"] + RPP * i) if col0 + s["kr0"] + RPP * i < COLS else 0
                              for i in range(BN // RPP)]
            else:
                WCH = BN // 8
                s["bcc"], s["br0"] = tid % WCH, tid // WCH
                s["b_dst"] = mnmaj_off(BN, s["br0"], s["bcc"])
                s["b_col_ok"] = col0 + s["bcc"] * 8 < COLS
                s["b_next"] = s["br0"] * w_sn + col0 + s["bcc"] * 8
                s["b_step"] = (THREADS // WCH) * w_sn
                s["left"] = R
        else:
            WA, WB = BM // 8, BN // 8
            s["acc_"], s["ar0"] = tid % WA, tid // WA
            s["bcc"], s["br0"] = tid % WB, tid // WB
            s["a_dst"] = mnmaj_off(BM, s["ar0"], s["acc_"])
            s["b_dst"] = A_ELEMS + mnmaj_off(BN, s["br0"], s["bcc"])
            s["a_col_ok"] = row0 + s["acc_"] * 8 < N
            s["b_col_ok"] = col0 + s["bcc"] * 8 < K
            s["a_next"] = (p0 + s["ar0"]) * lddy + row0 + s["acc_"] * 8
            s["b_next"] = (p0 + s["br0"]) * ldx + col0 + s["bcc"] * 8
            s["a_step"], s["b_step"] = (THREADS // WA) * lddy, (THREADS // WB) * ldx
            s["left"] = R
        st.append(s)

    def load_slice(kt):
        stage = Stage(A_ELEMS, B_ELEMS)
        for tid in range(THREADS):
            s = st[tid]
            if op in ("fwd", "dgrad"):
                RPP, KC = THREADS // 4, BK // 32
                PA = BM // RPP
                NA = PA * KC
                if op == "fwd":
                    NB = (BN // RPP) * KC
                else:
                    RPPB = THREADS // (BN // 8)
                    NB = BK // RPPB
                NC = NA + NB
                # piece -1
                kk0 = kt * BK + s["kc"] * 8
                k_ok = [kk0 + 32 * j < R for j in range(KC)]
                if op == "dgrad":
                    b_left = max(min(s["left"], 2**31 - 1), 0) if s["b_col_ok"] else 0
                seen = []
                for piece in range(4):
                    for q in range(NC):
                        if not in_piece(NC, q, piece):
                            continue
                        seen.append(q)
                        if q < NA:
                            i, j = q // KC, q % KC
                            stage.copy("A", s["k_dst"][j] + i * RPP * BK, s["a_row"][i] * lda + kk0 + 32 * j, X,
                                       k_ok[j])
                        elif op == "fwd":
                            i, j = (q - NA) // KC, (q - NA) % KC
                            stage.copy("B", s["k_dst"][j] + i * RPP * BK, s["b_row"][i] * w_sn + kk0 + 32 * j, W,
                                       k_ok[j])
                        else:
                            i = q - NA
                            stage.copy("B", s["b_dst"] + i * RPPB * BN, s["b_next"] + i * s["b_step"], W,
                                       s["br0"] + RPPB * i < b_left)
                    if piece == 3 and op == "dgrad":
                        s["b_next"] += BK * w_sn
                        s["left"] -= BK
                assert sorted(seen) == list(range(NC)), "every copy in exactly one piece"
            else:
                RA, RB = THREADS // (BM // 8), THREADS // (BN // 8)
                PA, PB = BK // RA, BK // RB
                NC = PA + PB
                lft = max(min(s["left"], 2**31 - 1), 0)
                a_left = lft if s["a_col_ok"] else 0
                b_left = lft if s["b_col_ok"] else 0
                pos0 = p0 + kt * BK
                for piece in range(4):
                    for q in range(NC):
                        if not in_piece(NC, q, piece):
                            continue
                        if q < PA:
                            i = q
                            r = s["ar0"] + RA * i
                            if perm:
                                ok = r < a_left
                                src = order[pos0 + r] * lddy + row0 + s["acc_"] * 8 if ok else 0
                            else:
                                ok, src = r < a_left, s["a_next"] + i * s["a_step"]
                            stage.copy("A", s["a_dst"] + i * RA * BM, src, DY, ok)
                        else:
                            i = q - PA
                            r = s["br0"] + RB * i
                            if perm:
                                ok = r < b_left
                                src = order[pos0 + r] * ldx + col0 + s["bcc"] * 8 if ok else 0
                            else:
                                ok, src = r < b_left, s["b_next"] + i * s["b_step"]
                            stage.copy("B", s["b_dst"] - A_ELEMS + i * RB * BN, src, XX, ok)
                    if piece == 3:
                        if not perm:
                            s["a_next"] += BK * lddy
                            s["b_next"] += BK * ldx
                        s["left"] -= BK
        assert np.all(stage.wa == 1) and np.all(stage.wb == 1), "the producer covers the stage exactly once"
        return stage

    for kt in range(KT):
        stage = load_slice(kt)
        for w in range(warps):
            for ks in range(BK // 16):
                a, b = frag_load(stage.a, stage.b, offs[w], ks, BM, BN, BK, a_kmaj, b_kmaj)
                for mi in range(4):
                    for nj in range(8):
                        bb = b[nj >> 1]
                        mma(accs[w][mi, nj], a[mi], bb[:, (nj & 1) * 2], bb[:, (nj & 1) * 2 + 1])
    # epilogue: accumulator (row lane / 4 (+8), columns 2 (lane % 4) + {0, 1}) -> tile coordinates
    for w in range(warps):
        m_w, n_w = (w // WN) * 64, (w % WN) * 64
        for mi in range(4):
            for h in range(2):
                lr = m_w + 16 * mi + (LANES >> 2) + 8 * h
                for nj in range(8):
                    c = n_w + 8 * nj + 2 * (LANES & 3)
                    out[lr, c] = accs[w][mi, nj][:, 2 * h]
                    out[lr, c + 1] = accs[w][mi, nj][:, 2 * h + 1]
    return out[:rows_valid, :cols_valid], want


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "%dx%dx%d_t%d" % s)
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad", "wgrad_perm"])
def test_tile_emulation(op, shape):
    BM, BN, BK, THREADS = shape
    tile = {"BM": BM, "BN": BN, "BK": BK, "THREADS": THREADS}
    rng = np.random.default_rng(BM + BN + BK + len(op))
    base = op.split("_")[0]
    # two slices and a reduction tail (a multiple of 8, as the host checks); partial rows and columns
    R = 2 * BK + 24 if base != "wgrad" else 2 * BK + 5          # wgrad: any number of rows of the expert
    got, want = emulate_tile(base, tile, rng, R, rows_valid=BM - 24, cols_valid=BN - 16, perm=op.endswith("perm"))
    np.testing.assert_array_equal(got, want, err_msg=f"{op} {shape}")


def test_full_tiles_and_short_reduction():
    rng = np.random.default_rng(7)
    for shape in SHAPES:
        BM, BN, BK, THREADS = shape
        tile = {"BM": BM, "BN": BN, "BK": BK, "THREADS": THREADS}
        for op, R in (("fwd", 8), ("dgrad", BK), ("wgrad", 1)):
            got, want = emulate_tile(op, tile, rng, R, rows_valid=BM, cols_valid=BN)
            np.testing.assert_array_equal(got, want, err_msg=f"{op} {shape} R={R}")


def test_ldmatrix_reads_are_bank_conflict_free():
    """Each 8-lane phase of an ldmatrix reads 8 rows of 16 bytes: distinct 16-byte bank groups."""
    for BM, BN, BK, THREADS in SHAPES:
        for rows in (BM, BN):
            for r0 in range(0, rows, 8):
                for c in range(BK // 8):
                    groups = {((kmaj_off(BK, r0 + i, c) * 2) // 16) % 8 for i in range(8)}
                    assert len(groups) == 8, ("K-major", BK, r0, c)
        for W in (BM, BN):
            for r0 in range(0, BK, 8):
                for c in range(W // 8):
                    groups = {((mnmaj_off(W, r0 + i, c) * 2) // 16) % 8 for i in range(8)}
                    assert len(groups) == 8, ("MN-major", W, r0, c)


# -- the cp.async / barrier schedule of mainloop ---------------------------------------------------
def mainloop_trace(STAGES, KSTEPS, PIPE, KT):
    """The events of one thread (every thread runs the same, uniform control flow):
    ("copy", slice, slot), ("commit",), ("wait", n), ("bar",), ("read", slice, slot)."""
    ev = []
    slot_of = {}

    def load(stage, kt):
        ev.append(("copy", kt, stage))
        slot_of[kt] = stage

    for s in range(STAGES - 1):
        if s < KT:
            load(s, s)
        ev.append(("commit",))
    rd, wr = 0, STAGES - 1
    if PIPE == 2:
        ev += [("wait", STAGES - 2), ("bar",)]
        if KT > 0:
            ev.append(("read", 0, rd))
        for kt in range(KT):
            nk = kt + STAGES - 1
            for ks in range(KSTEPS):
                if ks == KSTEPS - 1:
                    ev += [("wait", STAGES - 2), ("bar",)]
                    rd = (rd + 1) % STAGES
                    if kt + 1 < KT:
                        ev.append(("read", kt + 1, rd))
                else:
                    ev.append(("read", kt, rd))
                if ks == 0:
                    if nk < KT:
                        load(wr, nk)
                    ev.append(("commit",))
                    wr = (wr + 1) % STAGES
    else:
        for kt in range(KT):
            ev += [("wait", STAGES - 2), ("bar",)]
            nk = kt + STAGES - 1
            if PIPE == 0 and nk < KT:
                load(wr, nk)
            for ks in range(KSTEPS):
                ev.append(("read", kt, rd))
                if PIPE == 1 and ks == 0 and nk < KT:
                    load(wr, nk)
            ev.append(("commit",))
            wr = (wr + 1) % STAGES
            rd = (rd + 1) % STAGES
    ev += [("wait", 0)]
    return ev, slot_of


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: "stages%d_ksteps%d_pipe%d" % s)
def test_mainloop_schedule_has_no_hazards(sched):
    STAGES, KSTEPS, PIPE = sched
    for KT in range(0, 3 * STAGES + 2):
        ev, slot_of = mainloop_trace(STAGES, KSTEPS, PIPE, KT)
        assert sorted(slot_of) == list(range(KT)), "every slice loaded exactly once, in order"
        group_of, committed, pending = {}, 0, []
        for i, e in enumerate(ev):
            if e[0] == "copy":
                pending.append(i)
            elif e[0] == "commit":
                committed += 1
                for j in pending:
                    group_of[j] = committed
                pending = []
        reads = [(i, e) for i, e in enumerate(ev) if e[0] == "read"]
        assert sorted({e[1] for _, e in reads}) == list(range(KT)), "every slice is read"
        for i, (_, k, slot) in reads:
            copies = [j for j, e in enumerate(ev[:i]) if e[0] == "copy" and e[2] == slot]
            assert copies and ev[copies[-1]][1] == k, f"KT={KT}: read of slice {k} finds another slice in slot {slot}"
            c = copies[-1]
            # complete: a wait after the copy's commit that leaves at most n newer groups, then a barrier
            ok = False
            for w in range(c + 1, i):
                if ev[w][0] != "wait":
                    continue
                done = sum(1 for e in ev[:w] if e[0] == "commit") - ev[w][1]
                if group_of[c] <= done and any(ev[b][0] == "bar" for b in range(w + 1, i)):
                    ok = True
                    break
            assert ok, f"KT={KT}: slice {k} read before its copy is complete and visible"
        for i, e in enumerate(ev):
            if e[0] != "copy":
                continue
            prev = [j for j, r in reads if j < i and r[2] == e[2] and r[1] != e[1]]
            if prev:
                assert any(ev[b][0] == "bar" for b in range(prev[-1] + 1, i)), \
                    f"KT={KT}: slot {e[2]} overwritten while a warp may still read it"
