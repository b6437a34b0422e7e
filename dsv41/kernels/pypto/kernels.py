"""``pypto.frontend.jit`` kernel factories, one per kernel spec; imported only inside pypto workers.

Each factory takes normalized (shapes, dtypes, run_mode) and returns a jit function whose positional
arguments follow ``specs`` layouts (outputs last, written with ``y[:] =`` or ``assemble``).
Shapes are closure constants that pypto resolves when it parses the body. No `from __future__ import
annotations` here: the jit reads the annotations as objects to tell tensor from scalar parameters.
Tile choices follow the measurements in shared/notes/pypto-on-cpu.md.
"""

import pypto

DT = {"bf16": pypto.DT_BF16, "fp16": pypto.DT_FP16, "fp32": pypto.DT_FP32, "int32": pypto.DT_INT32,
      "int8": pypto.DT_INT8}

# FP32 elements per vector tile. Fewer, bigger tiles simulate faster up to what fits the 192 KB UB, and
# that limit depends on how many tile buffers a kernel keeps live (swept at the FLASH shapes):
VEC_TILE_ELEMS = 2 * 5120   # RMSNorm [2,5120] 17.6 us vs [4,5120] 20.2, [8,5120] fails; softmax alike
LANE_TILE_ELEMS = 4 * 5120  # hc.pre/hc.post: [4,5120] 24.3/144 us vs [2,5120] 29.0/215, [8,5120] fails
COPY_TILE_ELEMS = 128 * 448 # plain BF16 copies (rope pass-through): [128,448] 10.5 us vs [16,448] 45


def _opts(run_mode: str) -> dict:
    return {"run_mode": pypto.RunMode.NPU if run_mode == "npu" else pypto.RunMode.SIM}


def vec_rows(rows: int, cols: int, elems: int = VEC_TILE_ELEMS) -> int:
    """Rows per vector tile: the largest power of two whose [r, cols] FP32 tile fits, at most ``rows``."""
    r = max(1, elems // cols)
    return min(1 << (r.bit_length() - 1), rows)


def _ceil16(x: int) -> int:
    return -(-x // 16) * 16


L1_BYTES = 512 * 1024


def cube_tiles(m: int, k: int, n: int, elem_bytes: int = 2, concurrent: int = 1
               ) -> tuple[list[int], list[int], list[int]]:
    """[L0, L1] tiles per dim for the 910B cube (L0A/L0B 64 KB each, L1 512 KB).

    ``concurrent``: how many same-shaped matmuls run side by side (a batch dim, g and u of an expert).
    A cube task streams its [tm, K] and [K, tn] panels from GM at ~90 GB/s per core in the cost model
    (a [96,5120] + [5120,64] BF16 pair, 1.64 MB, in 18.4 us), so its time follows tm + tn, and the
    tasks run in rounds over the CUBE_CORES cores. tn is the candidate with the fewest rounds x
    (tm + tn): the anchor's work list balanced over the 24 cube cores. Swept, SIM us before -> after:
    [192,5120]x[5120,512] n 128 -> 64 (8 -> 16 tasks) 26.9 -> 21.0; [192,2048]x[2048,5120]
    n 128 -> 224 (46 tasks, two rounds) 52.1 -> 36.6; [32,1280]x[1280,8192] n 128 -> 192 26.3 -> 20.1;
    shared expert at 48 rows (g, u n 192: 24 tasks; down n 224: 23) 78.7 -> 61.7.
    tn above 128 needs k0 128 (L0B 64 KB). k1 keeps both L1 panels within L1: K=1280 with k1=1280
    took 116 us against 44 with 1024. m 192 fails to compile with k0 256 and takes 218 us with k0 128;
    equal m tiles (96 + 96) lost on the shared expert (194 us against 174 at 192 rows), so tm stays 128.
    """
    tm = min(128, _ceil16(m))
    fits = sorted({min(t, _ceil16(n)) for t in (64, 96, 128, 160, 192, 224, 256)})
    tn = min(fits, key=lambda t: (-(-(-(-m // tm) * -(-n // t) * concurrent) // CUBE_CORES)) * (tm + t))
    k0 = min((256 if tn <= 128 else 128) * 2 // elem_bytes, _ceil16(k))
    fit = L1_BYTES // (elem_bytes * (tm + tn)) // k0 * k0
    k1 = max(k0, min(fit, -(-k // k0) * k0))
    return [tm, tm], [k0, k1], [tn, tn]


CUBE_CORES = 24  # 910B AIC count (A2A3.ini)


def token_tiles(m: int, k: int, n: int) -> tuple[list[int], list[int], list[int]]:
    """Tiles for a batch of tiny per-token matmuls (attention: M = local heads, K/N = keys or head dim).

    Each cube task pays ~2 us of setup in the cost model (pv [16,128]x[128,128] tasks: 2.0-2.2 us each),
    so the whole K stays in one L1 panel and the task covers all of a token's work; the batch of
    tokens is what spreads over the 24 cube cores (the anchor's per-(token, key block) work items).
    Swept at T=24, H=16, d=512, K=640: PV k [128,640] n 256 8.2 us per token-task vs k [64,128] n 512
    12.8, [128,128] n 128 14.2 (x2 tasks); QK k [128,512] n 256 7.9 vs k [256,512] n 128 5.6 x2.
    n 640 or k0 64 with n 512 fail to compile (L0B is 64 KB).
    """
    tm, k0 = _ceil16(m), min(128, _ceil16(k))
    return [tm, tm], [k0, -(-k // k0) * k0], [min(256, _ceil16(n))] * 2


def tokens_per_cube_task(tokens: int) -> int:
    """Same-structure per-token cube tasks merged into one (``cube_nbuffer_setting``): each merge saves
    a task setup, but fewer tasks than cube cores leave cores idle. At T=192, K=128 QK: 1 -> 60.6 us
    (192 tasks), 4 -> 43.2 (48 tasks, 2 per core), 8 -> 50.7 (24 tasks, no overlap with the vector side)."""
    return max(1, min(4, tokens // CUBE_CORES))


def rms_norm(s, d, run_mode):
    T, D, EPS = s["T"], s["D"], float(s["eps"])
    ACT, W = DT[d["act"]], DT[d["w"]]
    RT, INV_D = vec_rows(T, D), 1.0 / D

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def norm_rms(x: pypto.Tensor((T, D), ACT), w: pypto.Tensor((1, D), W), y: pypto.Tensor((T, D), ACT)):
        pypto.set_vec_tile_shapes(RT, D)
        xf = pypto.cast(x, pypto.DT_FP32)
        ms = pypto.mul(pypto.sum(pypto.mul(xf, xf), -1, keepdim=True), INV_D)
        inv = pypto.rsqrt(pypto.add(ms, EPS))
        y[:] = pypto.cast(pypto.mul(pypto.mul(xf, inv), pypto.cast(w, pypto.DT_FP32)), ACT)
    return norm_rms


def rope_rows(s, d, run_mode):
    """cos/sin rows for positions; a negative position gives the identity row (cos 1, sin 0).

    The mask is computed in FP32 (integer compare/max did not compile): ok = clamp(pos + 1, 0, 1).
    cos = g*ok + (1 - ok) keeps g bit-exact where ok = 1.
    """
    T, C, HALF = s["T"], s["C"], s["half"]
    RT = vec_rows(T, HALF)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def rope_rows_k(ct: pypto.Tensor((C, HALF), pypto.DT_FP32), st: pypto.Tensor((C, HALF), pypto.DT_FP32),
                    pos: pypto.Tensor((T, 1), pypto.DT_INT32),
                    co: pypto.Tensor((T, HALF), pypto.DT_FP32), so: pypto.Tensor((T, HALF), pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(RT, HALF)
        posf = pypto.cast(pos, pypto.DT_FP32)
        ok = pypto.minimum(pypto.maximum(pypto.add(posf, 1.0), 0.0), 1.0)
        not_ok = pypto.add(pypto.mul(ok, -1.0), 1.0)
        m = pypto.cast(pypto.maximum(posf, 0.0), pypto.DT_INT32)
        pypto.set_vec_tile_shapes(T)
        idx = pypto.reshape(m, [T])
        pypto.set_vec_tile_shapes(RT, HALF)
        co[:] = pypto.add(pypto.mul(pypto.index_select(ct, 0, idx), ok), not_ok)
        so[:] = pypto.mul(pypto.index_select(st, 0, idx), ok)
    return rope_rows_k


def rope_apply(s, d, run_mode):
    """Adjacent-pair rotation of the last 2*half channels of each [T*H, dim] row: y = x*C + swap(x)*S.

    C and S are gathered per row from cos/sin [T, half] with the index tables of specs._rope_consts.
    """
    T, H, DIM, HALF = s["T"], s["H"], s["dim"], s["half"]
    NR, W, NOPE, ACT = T * H, 2 * HALF, DIM - 2 * HALF, DT[d["act"]]
    RT = vec_rows(NR, W)
    RN = vec_rows(NR, max(NOPE, 1), COPY_TILE_ELEMS)

    # The parser evaluates calls to plain Python helpers without its variables in scope, so the
    # rotation is spelled out in both variants (with and without pass-through channels).
    if NOPE:
        @pypto.frontend.jit(runtime_options=_opts(run_mode))
        def rope_apply_k(x: pypto.Tensor((NR, DIM), ACT), cos: pypto.Tensor((T, HALF), pypto.DT_FP32),
                         sin: pypto.Tensor((T, HALF), pypto.DT_FP32), row: pypto.Tensor((NR,), pypto.DT_INT32),
                         rep: pypto.Tensor((W,), pypto.DT_INT32), swap: pypto.Tensor((W,), pypto.DT_INT32),
                         sign: pypto.Tensor((1, W), pypto.DT_FP32), y: pypto.Tensor((NR, DIM), ACT)):
            pypto.set_vec_tile_shapes(RN, NOPE)
            pypto.assemble(pypto.view(x, [NR, NOPE], [0, 0]), [0, 0], y)
            pypto.set_vec_tile_shapes(RT, W)
            c = pypto.index_select(pypto.index_select(cos, 0, row), 1, rep)
            sn = pypto.mul(pypto.index_select(pypto.index_select(sin, 0, row), 1, rep), sign)
            xr = pypto.cast(pypto.view(x, [NR, W], [0, NOPE]), pypto.DT_FP32)
            rot = pypto.add(pypto.mul(xr, c), pypto.mul(pypto.index_select(xr, 1, swap), sn))
            pypto.assemble(pypto.cast(rot, ACT), [0, NOPE], y)
        return rope_apply_k

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def rope_apply_full(x: pypto.Tensor((NR, DIM), ACT), cos: pypto.Tensor((T, HALF), pypto.DT_FP32),
                        sin: pypto.Tensor((T, HALF), pypto.DT_FP32), row: pypto.Tensor((NR,), pypto.DT_INT32),
                        rep: pypto.Tensor((W,), pypto.DT_INT32), swap: pypto.Tensor((W,), pypto.DT_INT32),
                        sign: pypto.Tensor((1, W), pypto.DT_FP32), y: pypto.Tensor((NR, DIM), ACT)):
        pypto.set_vec_tile_shapes(RT, W)
        c = pypto.index_select(pypto.index_select(cos, 0, row), 1, rep)
        sn = pypto.mul(pypto.index_select(pypto.index_select(sin, 0, row), 1, rep), sign)
        xr = pypto.cast(x, pypto.DT_FP32)
        y[:] = pypto.cast(pypto.add(pypto.mul(xr, c), pypto.mul(pypto.index_select(xr, 1, swap), sn)), ACT)
    return rope_apply_full


def hc_pre(s, d, run_mode):
    """Lane sum in the device order (x0 p0 + x1 p1) + (x2 p2 + x3 p3) (spec 01 §4.2), then BF16."""
    T, HC, D, ACT = s["T"], s["hc"], s["D"], DT[d["act"]]
    if HC % 2:
        raise ValueError(f"hc.pre: hc must be even for the pairwise lane sum, got {HC}")
    RT = vec_rows(T, D, LANE_TILE_ELEMS)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def hc_pre_k(x: pypto.Tensor((T, HC * D), pypto.DT_FP32), pre: pypto.Tensor((T, HC), pypto.DT_FP32),
                 y: pypto.Tensor((T, D), ACT)):
        pypto.set_vec_tile_shapes(RT, D)
        acc = pypto.add(pypto.mul(pypto.view(x, [T, D], [0, 0]), pypto.view(pre, [T, 1], [0, 0])),
                        pypto.mul(pypto.view(x, [T, D], [0, D]), pypto.view(pre, [T, 1], [0, 1])))
        for j in range(2, HC, 2):
            pair = pypto.add(pypto.mul(pypto.view(x, [T, D], [0, j * D]), pypto.view(pre, [T, 1], [0, j])),
                             pypto.mul(pypto.view(x, [T, D], [0, (j + 1) * D]), pypto.view(pre, [T, 1], [0, j + 1])))
            acc = pypto.add(acc, pair)
        y[:] = pypto.cast(acc, ACT)
    return hc_pre_k


def hc_post(s, d, run_mode):
    """out[:, k] = bf16(post_k * sub + sum_j comb[j, k] * x_j), stored FP32 like the residual stream."""
    T, HC, D, ACT = s["T"], s["hc"], s["D"], DT[d["act"]]
    RT = vec_rows(T, D, LANE_TILE_ELEMS)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def hc_post_k(sub: pypto.Tensor((T, D), ACT), x: pypto.Tensor((T, HC * D), pypto.DT_FP32),
                  post: pypto.Tensor((T, HC), pypto.DT_FP32), comb: pypto.Tensor((T, HC * HC), pypto.DT_FP32),
                  out: pypto.Tensor((T, HC * D), pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(RT, D)
        sf = pypto.cast(sub, pypto.DT_FP32)
        for k in range(HC):
            acc = pypto.mul(pypto.view(x, [T, D], [0, 0]), pypto.view(comb, [T, 1], [0, k]))
            for j in range(1, HC):
                acc = pypto.add(acc, pypto.mul(pypto.view(x, [T, D], [0, j * D]),
                                               pypto.view(comb, [T, 1], [0, j * HC + k])))
            acc = pypto.add(pypto.mul(sf, pypto.view(post, [T, 1], [0, k])), acc)
            pypto.assemble(pypto.cast(pypto.cast(acc, pypto.DT_BF16), pypto.DT_FP32), [0, k * D], out)
    return hc_post_k


def matmul(s, d, run_mode):
    """y = x @ w^T with w in the checkpoint's [N, K] layout (b_trans), FP32 accumulation."""
    M, K, N = s["M"], s["K"], s["N"]
    ACT, W, OUT = DT[d["act"]], DT[d["w"]], DT[d["out"]]
    TM, TK, TN = cube_tiles(M, K, N)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def matmul_k(x: pypto.Tensor((M, K), ACT), w: pypto.Tensor((N, K), W), y: pypto.Tensor((M, N), OUT)):
        pypto.set_cube_tile_shapes(TM, TK, TN)
        y[:] = pypto.matmul(x, w, OUT, b_trans=True)
    return matmul_k


def router_scores(s, d, run_mode):
    """sqrt(softplus(x W^T)) in FP32; softplus as max(z, 0) + log1p(exp(-|z|)) (no overflow)."""
    T, D, E = s["T"], s["D"], s["E"]
    ACT, W = DT[d["act"]], DT[d["w"]]
    TM, TK, TN = cube_tiles(T, D, E)
    RT = vec_rows(T, E)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def moe_gate_k(x: pypto.Tensor((T, D), ACT), w: pypto.Tensor((E, D), W),
                   scores: pypto.Tensor((T, E), pypto.DT_FP32)):
        pypto.set_cube_tile_shapes(TM, TK, TN)
        z = pypto.matmul(x, w, pypto.DT_FP32, b_trans=True)
        pypto.set_vec_tile_shapes(RT, E)
        sp = pypto.add(pypto.maximum(z, 0.0), pypto.log1p(pypto.exp(pypto.mul(pypto.abs(z), -1.0))))
        scores[:] = pypto.sqrt(sp)
    return moe_gate_k


def softmax_tile(s, d, run_mode):
    R, K, OUT = s["R"], s["K"], DT[d["out"]]
    RT = vec_rows(R, K)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def softmax_k(scores: pypto.Tensor((R, K), pypto.DT_FP32), probs: pypto.Tensor((R, K), OUT)):
        pypto.set_vec_tile_shapes(RT, K)
        probs[:] = pypto.cast(pypto.softmax(scores, -1), OUT)
    return softmax_k


def attn_qk_tile(s, d, run_mode):
    """logits [T, H, K] = scale * q [T, H, d] . keys [T, K, d]: one key tile, batched over tokens."""
    T, H, K, DD, SCALE = s["T"], s["H"], s["K"], s["d"], float(s["scale"])
    ACT = DT[d["act"]]
    TM, TK, TN = token_tiles(H, DD, K)
    RT, MERGE = vec_rows(H, K), tokens_per_cube_task(T)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def qk_tile_k(q: pypto.Tensor((T, H, DD), ACT), keys: pypto.Tensor((T, K, DD), ACT),
                  logits: pypto.Tensor((T, H, K), pypto.DT_FP32)):
        pypto.set_pass_options(cube_nbuffer_setting={-1: MERGE})
        pypto.set_cube_tile_shapes(TM, TK, TN)
        z = pypto.matmul(q, keys, pypto.DT_FP32, b_trans=True)
        pypto.set_vec_tile_shapes(1, RT, K)
        logits[:] = pypto.mul(z, SCALE)
    return qk_tile_k


def attn_pv_tile(s, d, run_mode):
    """out [T, H, d] = probs [T, H, K] @ values [T, K, d] (K = V, the shared head), FP32 accumulation."""
    T, H, K, DD = s["T"], s["H"], s["K"], s["d"]
    ACT = DT[d["act"]]
    TM, TK, TN = token_tiles(H, K, DD)
    MERGE = tokens_per_cube_task(T)

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def pv_tile_k(probs: pypto.Tensor((T, H, K), ACT), values: pypto.Tensor((T, K, DD), ACT),
                  out: pypto.Tensor((T, H, DD), pypto.DT_FP32)):
        pypto.set_pass_options(cube_nbuffer_setting={-1: MERGE})
        pypto.set_cube_tile_shapes(TM, TK, TN)
        out[:] = pypto.matmul(probs, values, pypto.DT_FP32)
    return pv_tile_k


def moe_experts(s, d, run_mode):
    """G SwiGLU experts as batched matmuls over padded rows [G, T, D] (a grouped GEMM).

    g = min(x w1^T, limit), u = clip(x w3^T, +-limit), h = silu(g) u weight, y = bf16(h w2^T).
    ``w`` int8 (routed experts): W8A8, the a2 stand-in for the seed's MXFP8 cube path with
    dynamically quantized activations (pypto 0.2.0 runs no FP8/FP4 matmul on a2, docs/pypto.md):
    INT8 weights, one byte each like FP8, with a scale per output channel; each activation row
    quantized to INT8 by its absmax on the vector cores; INT8 x INT8 -> INT32 on the cube; FP32
    dequant. At the FLASH slices (3 and 6 of 48 experts, [16,5120]x[5120,2304]) 107.4 / 158.4 us
    against 123.3 / 215.5 in BF16: half the weight bytes through the cube panels.
    ``w`` bf16 (shared expert): BF16 weights, bf16(x w1^T) and bf16(x w3^T). W8A8 lost there (48 rows,
    one expert: 74.3 us against 61.7): the two quantize stages and the dequant cost more than the
    halved weight bytes save.
    """
    G, T, D, I, LIM = s["G"], s["T"], s["D"], s["I"], float(s["limit"])
    ACT, F32 = DT[d["act"]], pypto.DT_FP32
    GROUP = s["group"] or G  # the tiles of the whole grouped GEMM when this call is one slice of it
    EB = 1 if d["w"] == "int8" else 2
    T1, K1, N1 = cube_tiles(T, D, I, elem_bytes=EB, concurrent=2 * GROUP)   # g and u side by side
    T2, K2, N2 = cube_tiles(T, I, D, elem_bytes=EB, concurrent=GROUP)
    RT, RX = vec_rows(T, I), vec_rows(T, D)
    Q = 1.0 / 127

    if d["w"] == "int8":
        I8 = pypto.DT_INT8

        @pypto.frontend.jit(runtime_options=_opts(run_mode))
        def experts_w8a8(x: pypto.Tensor((G, T, D), ACT), w1: pypto.Tensor((G, I, D), I8),
                         w3: pypto.Tensor((G, I, D), I8), w2: pypto.Tensor((G, D, I), I8),
                         s1: pypto.Tensor((G, 1, I), F32), s3: pypto.Tensor((G, 1, I), F32),
                         s2: pypto.Tensor((G, 1, D), F32), weight: pypto.Tensor((G, T, 1), F32),
                         y: pypto.Tensor((G, T, D), ACT)):
            pypto.set_vec_tile_shapes(1, RX, D)
            xf = pypto.cast(x, F32)
            xs = pypto.add(pypto.mul(pypto.amax(pypto.abs(xf), -1, keepdim=True), Q), 1e-30)
            xq = pypto.cast(pypto.cast(pypto.div(xf, xs), pypto.DT_INT32, pypto.CastMode.CAST_RINT), I8)
            pypto.set_cube_tile_shapes(T1, K1, N1)
            g = pypto.matmul(xq, w1, pypto.DT_INT32, b_trans=True)
            u = pypto.matmul(xq, w3, pypto.DT_INT32, b_trans=True)
            pypto.set_vec_tile_shapes(1, RT, I)
            gf = pypto.minimum(pypto.mul(pypto.mul(pypto.cast(g, F32), xs), s1), LIM)
            uf = pypto.minimum(pypto.maximum(pypto.mul(pypto.mul(pypto.cast(u, F32), xs), s3), -LIM), LIM)
            h = pypto.mul(pypto.mul(pypto.mul(gf, pypto.sigmoid(gf)), uf), weight)
            hs = pypto.add(pypto.mul(pypto.amax(pypto.abs(h), -1, keepdim=True), Q), 1e-30)
            hq = pypto.cast(pypto.cast(pypto.div(h, hs), pypto.DT_INT32, pypto.CastMode.CAST_RINT), I8)
            pypto.set_cube_tile_shapes(T2, K2, N2)
            yi = pypto.matmul(hq, w2, pypto.DT_INT32, b_trans=True)
            pypto.set_vec_tile_shapes(1, RX, D)
            y[:] = pypto.cast(pypto.mul(pypto.mul(pypto.cast(yi, F32), hs), s2), ACT)
        return experts_w8a8

    W = DT[d["w"]]

    @pypto.frontend.jit(runtime_options=_opts(run_mode))
    def experts_k(x: pypto.Tensor((G, T, D), ACT), w1: pypto.Tensor((G, I, D), W), w3: pypto.Tensor((G, I, D), W),
                  w2: pypto.Tensor((G, D, I), W), weight: pypto.Tensor((G, T, 1), F32),
                  y: pypto.Tensor((G, T, D), ACT)):
        pypto.set_cube_tile_shapes(T1, K1, N1)
        g = pypto.matmul(x, w1, pypto.DT_BF16, b_trans=True)
        u = pypto.matmul(x, w3, pypto.DT_BF16, b_trans=True)
        pypto.set_vec_tile_shapes(1, RT, I)
        gf = pypto.minimum(pypto.cast(g, F32), LIM)
        uf = pypto.minimum(pypto.maximum(pypto.cast(u, F32), -LIM), LIM)
        h = pypto.mul(pypto.mul(pypto.mul(gf, pypto.sigmoid(gf)), uf), weight)
        hb = pypto.cast(h, pypto.DT_BF16)
        pypto.set_cube_tile_shapes(T2, K2, N2)
        y[:] = pypto.matmul(hb, w2, ACT, b_trans=True)
    return experts_k
