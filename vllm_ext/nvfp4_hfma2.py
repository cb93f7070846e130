"""The one-row kernel's products in float16 pairs (``QERL_ROW_DECODE=hfma2``, :func:`vllm_ext.nvfp4_decode.decode_mode`
3; experimental, docs/benchmarks.md §4bc): the codes decoded through FP8 into float16 pairs as in §4ba, then each
group's 16 products summed in float16 pairs with ``fma.rn.f16x2`` (HFMA2) and widened to float32 once per group,
instead of widening every code to float32 for its own FFMA.

Why: on an H200 the row kernel issues an instruction in 77 % of its cycles on the 7B gate/up projection, and per 4-byte
word of codes its loop issues 8 float16 -> float32 conversions (HADD2) and 8 FFMAs (§4ba). Here a word takes 4 HFMA2
and a group (2 words) 2 conversions and one FFMA with its scale.

``x`` must then be float16 pairs in the decode's order (:func:`_x_pairs`): each thread converts the ``x`` of its own
words once per K tile and uses it for every row it holds.

Numerics. A code's value times 2^-6 (at most 0.09375) is exact in float16, and so is ``x`` in float16's normal range
(bfloat16 has fewer significant bits); each HFMA2 rounds its sum to float16 (2^-11 relative), the group's two lanes
are added in float32 and times the group's scale in float32, and the groups summed in float32 as in the float32 row
kernel. A lane sums 8 products of at most 0.09375 |x| each, so no sum overflows where ``x`` fits float16 (|x| < 65 520);
an ``x`` beyond that makes its programs' sums infinite, and those programs sum their K tiles again with exact float32
products (:func:`vllm_ext.nvfp4_gemv._row_fallback`; not with ``hfma2-unguarded``, a knob for timing that guard only,
whose output is then infinite). Products below 2^-14 are float16 subnormals, exact to 2^-25 in the value's units.
vLLM's Marlin, for comparison, rounds each weight times its scale to bfloat16 (2^-9)."""

from __future__ import annotations

from vllm_ext.nvfp4_decode import fp8_pair_lines
from vllm_ext.triton_support import tl, triton

__all__: list[str] = []


def _x_pairs_ptx() -> str:
    """``$2``, ``$3``: two int32, each two bfloat16 of ``x`` (``x[2i]`` low, ``x[2i + 1]`` high), for ``x[j .. j + 3]``;
    out ``$0`` = float16 pair (x[j], x[j + 2]), ``$1`` = (x[j + 1], x[j + 3]) (low half first): the pairs the decode's
    halves meet."""
    return "\n".join(["{", ".reg .b32 a, b, c, d;",
                      "shl.b32 a, $2, 16;", "shl.b32 b, $3, 16;",  # x[j], x[j + 2] as float32
                      "and.b32 c, $2, 0xFFFF0000;", "and.b32 d, $3, 0xFFFF0000;",  # x[j + 1], x[j + 3]
                      "cvt.rn.f16x2.f32 $0, b, a;", "cvt.rn.f16x2.f32 $1, d, c;",  # the first operand to the high half
                      "}"])


ROWS = 4  # rows per group call: the x pairs converted once for all of them (the Triton side splits rows in fours)


def _group_ptx() -> str:
    """One group (16 codes: two words) of each of :data:`ROWS` rows against the same ``x`` pairs: outs ``$0 .. $3``,
    row r's float32 sum of its 16 products (value times 2^-6 times x); ins ``$4 .. $11``, row r's two words at
    ``$(4 + 2r)`` and ``$(5 + 2r)``, then ``$12 .. $15`` the first word's ``x`` pairs and ``$16 .. $19`` the second's,
    each in :func:`_x_pairs`' order: (x0, x2), (x4, x6), (x1, x3), (x5, x7) of the word's 8."""
    lines = ["{", ".reg .b32 a, b, lo, hi, h0, h1, h2, h3, s;", ".reg .b16 p0, p1, p2, p3, e, f;", ".reg .f32 u, v;"]
    assert ROWS == 4, "_row_tile_hfma2 splits the rows in fours (_rows_last, _split4)"
    xa, xb = 3 * ROWS, 3 * ROWS + 4  # after the ROWS outputs and the 2 ROWS words
    for r in range(ROWS):
        lines += fp8_pair_lines(f"${ROWS + 2 * r}")
        lines += [f"mul.rn.f16x2 s, h0, ${xa};"] + [f"fma.rn.f16x2 s, h{i}, ${xa + i}, s;" for i in (1, 2, 3)]
        lines += fp8_pair_lines(f"${ROWS + 2 * r + 1}")
        lines += [f"fma.rn.f16x2 s, h{i}, ${xb + i}, s;" for i in range(4)]
        lines += ["mov.b32 {e, f}, s;", "cvt.f32.f16 u, e;", "cvt.f32.f16 v, f;", f"add.f32 ${r}, u, v;"]
    return "\n".join(lines + ["}"])


def _x_pairs_f16_ptx() -> str:
    """:func:`_x_pairs_ptx` for float16 ``x``: the same pairs by byte permutes, no conversion."""
    return "\n".join(["{", "prmt.b32 $0, $2, $3, 0x5410;", "prmt.b32 $1, $2, $3, 0x7632;", "}"])


def _marlin_group_ptx() -> str:
    """One group of one word pair's two outputs on Marlin's layout (:mod:`vllm_ext.nvfp4_marlin_row`): the 4 words
    ``a`` = 0-3 (``$2 .. $5``) of outputs ``b`` = 0, 1, each against its inputs ``2a, 2a + 1`` (``$6 .. $9``, a float16
    pair) and ``2a + 8, 2a + 9`` (``$10 .. $13``). A word's decoded pairs are (codes 0, 2), (4, 6), (1, 3), (5, 7), whose
    lanes are the outputs b = 0, 1 (Marlin's nibble order), so each meets one input in both lanes: the pair's low or
    high float16 repeated (a free operand swizzle in SASS). Outs ``$0``, ``$1``: the two outputs' float32 sums of their
    16 products (value times 2^-6 times x), in two chains of 8 per lane (words 0-1 and words 2-3), each summed in
    float16 and the two added in float32: a chain as long as the checkpoint layout's (§4bc call 4: one chain of 16 was
    worse than the bfloat16 weight on the 7B down projection)."""
    lines = ["{", ".reg .b32 a, b, lo, hi, h0, h1, h2, h3, s, t, d0, d1, d2, d3;",
             ".reg .b16 p0, p1, p2, p3, e, f, xl, xh;", ".reg .f32 u, v;"]
    for w in range(4):
        acc = "s" if w < 2 else "t"
        lines += fp8_pair_lines(f"${2 + w}")
        lines += [f"mov.b32 {{xl, xh}}, ${6 + w};", "mov.b32 d0, {xl, xl};", "mov.b32 d1, {xh, xh};",
                  f"mov.b32 {{xl, xh}}, ${10 + w};", "mov.b32 d2, {xl, xl};", "mov.b32 d3, {xh, xh};"]
        lines += [f"mul.rn.f16x2 {acc}, h0, d0;" if w % 2 == 0 else f"fma.rn.f16x2 {acc}, h0, d0, {acc};"]
        lines += [f"fma.rn.f16x2 {acc}, h{i}, d{i}, {acc};" for i in (1, 2, 3)]
    lines += ["mov.b32 {e, f}, s;", "cvt.f32.f16 u, e;", "cvt.f32.f16 v, f;",
              "mov.b32 {e, f}, t;", "cvt.f32.f16 $0, e;", "cvt.f32.f16 $1, f;",
              "add.f32 $0, $0, u;", "add.f32 $1, $1, v;", "}"]
    return "\n".join(lines)


def _x_pair_f16_ptx() -> str:
    """``$1``: two bfloat16 of ``x`` (low first) -> ``$0``: the same two as a float16 pair."""
    return "\n".join(["{", ".reg .b32 a, b;", "shl.b32 a, $1, 16;", "and.b32 b, $1, 0xFFFF0000;",
                      "cvt.rn.f16x2.f32 $0, b, a;", "}"])


_MARLIN_GROUP_PTX_TEXT = _marlin_group_ptx()
_X_PAIR_F16_PTX_TEXT = _x_pair_f16_ptx()
_MARLIN_GROUP_PTX = tl.constexpr(_MARLIN_GROUP_PTX_TEXT) if tl is not None else None
_X_PAIR_F16_PTX = tl.constexpr(_X_PAIR_F16_PTX_TEXT) if tl is not None else None
_X_PAIRS_PTX_TEXT = _x_pairs_ptx()
_X_PAIRS_F16_PTX_TEXT = _x_pairs_f16_ptx()
_X_PAIRS_F16_PTX = tl.constexpr(_X_PAIRS_F16_PTX_TEXT) if tl is not None else None
_GROUP_PTX_TEXT = _group_ptx()
_X_PAIRS_PTX = tl.constexpr(_X_PAIRS_PTX_TEXT) if tl is not None else None
_GROUP_PTX = tl.constexpr(_GROUP_PTX_TEXT) if tl is not None else None
_GROUP_CONSTRAINTS = tl.constexpr(",".join(["=r"] * ROWS + ["r"] * (2 * ROWS + 8))) if tl is not None else None


if triton is not None:

    @triton.jit
    def _x_pairs(xi, X_F16: tl.constexpr):
        """``xi`` ``[WORDS, 4]`` int32 (each word's 8 values of ``x``, two per int32; bfloat16, or float16 with
        ``X_F16``) -> 4 ``[WORDS]`` int32 tensors of float16 pairs: (x0, x2), (x4, x6), (x1, x3), (x5, x7)."""
        a, b = tl.split(tl.reshape(xi, (xi.shape[0], 2, 2)))  # a: int32s 0 and 2 of the word; b: 1 and 3
        p, q = tl.inline_asm_elementwise(asm=_X_PAIRS_F16_PTX if X_F16 else _X_PAIRS_PTX, constraints="=r,=r,r,r",
                                         args=[a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        x02, x46 = tl.split(p)
        x13, x57 = tl.split(q)
        return x02, x46, x13, x57

    @triton.jit
    def _by_group(v, WORDS: tl.constexpr):
        """``[WORDS]`` -> the even and the odd words of each group, ``[WORDS / 2]`` each, as rows ``[1, WORDS / 2]``."""
        a, b = tl.split(tl.reshape(v, (WORDS // 2, 2)))
        return a[None, :], b[None, :]

    @triton.jit
    def _rows_last(v, BLOCK_N: tl.constexpr, G: tl.constexpr):
        """``[BLOCK_N, G]`` -> ``[BLOCK_N / 4, G, 4]``: row 4 i + r at ``[i, :, r]``."""
        return tl.permute(tl.reshape(v, (BLOCK_N // 4, 4, G)), (0, 2, 1))

    @triton.jit
    def _split4(v):
        """``[A, G, 4]`` -> its 4 slices along the last axis, in order."""
        a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))  # a: 0 and 2, b: 1 and 3
        v0, v2 = tl.split(a)
        v1, v3 = tl.split(b)
        return v0, v1, v2, v3

    @triton.jit
    def _row_tile_hfma2(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
        """K tile ``t`` of the one-row kernel's loop (:func:`vllm_ext.nvfp4_gemv._row_dot`) with the products in
        float16 pairs: ``[BLOCK_N / 4, WORDS / 2, 4]`` float32 (row 4 i + r at ``[i, :, r]``), each group's 16
        products (value times 2^-6 times x) times its scale."""
        G: tl.constexpr = WORDS // 2
        cw = t * WORDS + tl.arange(0, WORDS)
        wv = tl.load(w_ptr + rn[:, None] * kw + cw[None, :], mask=n_ok[:, None], other=0)
        cg = t * G + tl.arange(0, G)
        sg = tl.load(s_ptr + rn[:, None] * kg + cg[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        xi = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + 4 * cw[:, None] + tl.arange(0, 4)[None, :])
        x02, x46, x13, x57 = _x_pairs(xi, x_ptr.dtype.element_ty == tl.float16)
        a02, b02 = _by_group(x02, WORDS)
        a46, b46 = _by_group(x46, WORDS)
        a13, b13 = _by_group(x13, WORDS)
        a57, b57 = _by_group(x57, WORDS)
        wa, wb = tl.split(tl.reshape(wv, (BLOCK_N, G, 2)))
        wa0, wa1, wa2, wa3 = _split4(_rows_last(wa, BLOCK_N, G))
        wb0, wb1, wb2, wb3 = _split4(_rows_last(wb, BLOCK_N, G))
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_GROUP_PTX, constraints=_GROUP_CONSTRAINTS,
            args=[wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3, a02, a46, a13, a57, b02, b46, b13, b57],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        part = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N // 4, G, 4))
        return part * _rows_last(sg, BLOCK_N, G)

    @triton.jit
    def _f16_pairs(p, X_F16: tl.constexpr):
        """int32 pairs of ``x`` (bfloat16, or float16 with ``X_F16``: returned as they are) as float16 pairs."""
        if X_F16:
            h = p
        else:
            h = tl.inline_asm_elementwise(asm=_X_PAIR_F16_PTX, constraints="=r,r", args=[p], dtype=tl.int32,
                                          is_pure=True, pack=1)
        return h

    @triton.jit
    def _marlin_sums_hfma2(x_ptr, w_ptr, wbase, t, N, HB: tl.constexpr, T: tl.constexpr, ASUM: tl.constexpr):
        """Groups ``t T .. t T + T - 1`` on Marlin's layout (:func:`vllm_ext.nvfp4_marlin_row._marlin_tile_asum`'s
        forms 3 and 4: ``x`` as 4-byte pairs or two 16-byte runs per group) with the products in float16 pairs: two
        ``[T, HB, 4]`` float32 tensors (``[group, h, j]``; outputs ``b`` = 0, 1), each output's 16 products per group
        summed, before the group's scale."""
        k3 = (t * T + tl.arange(0, T))[:, None, None]
        h3 = tl.arange(0, HB)[None, :, None]
        j3 = tl.arange(0, 4)[None, None, :]
        X_F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
        xw = x_ptr.to(tl.pointer_type(tl.int32))
        if ASUM == 4:  # [T, 2, 4] int32: half, pair a
            xg = _f16_pairs(tl.load(xw + k3 * 8 + tl.arange(0, 2)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]),
                            X_F16)
            even, odd = tl.split(tl.reshape(xg, (T, 2, 2, 2)))  # [T, 2, 2]: half, a // 2
            x_a0, x_a2 = tl.split(even)  # [T, 2]: half
            x_a1, x_a3 = tl.split(odd)
            l0, u0 = tl.split(x_a0)
            l1, u1 = tl.split(x_a1)
            l2, u2 = tl.split(x_a2)
            l3, u3 = tl.split(x_a3)
            l0, l1, l2, l3 = l0[:, None, None], l1[:, None, None], l2[:, None, None], l3[:, None, None]
            u0, u1, u2, u3 = u0[:, None, None], u1[:, None, None], u2[:, None, None], u3[:, None, None]
        else:  # form 3: pairs a and a + 4 of each group's 8, [T, 1, 1]
            l0 = _f16_pairs(tl.load(xw + k3 * 8), X_F16)
            l1 = _f16_pairs(tl.load(xw + k3 * 8 + 1), X_F16)
            l2 = _f16_pairs(tl.load(xw + k3 * 8 + 2), X_F16)
            l3 = _f16_pairs(tl.load(xw + k3 * 8 + 3), X_F16)
            u0 = _f16_pairs(tl.load(xw + k3 * 8 + 4), X_F16)
            u1 = _f16_pairs(tl.load(xw + k3 * 8 + 5), X_F16)
            u2 = _f16_pairs(tl.load(xw + k3 * 8 + 6), X_F16)
            u3 = _f16_pairs(tl.load(xw + k3 * 8 + 7), X_F16)
        wrow = w_ptr + wbase + k3 * (2 * N) + h3 * 16 + j3
        w0 = tl.load(wrow)
        w1 = tl.load(wrow + 4)
        w2 = tl.load(wrow + 8)
        w3 = tl.load(wrow + 12)
        return tl.inline_asm_elementwise(
            asm=_MARLIN_GROUP_PTX, constraints="=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
            args=[w0, w1, w2, w3, l0, l1, l2, l3, u0, u1, u2, u3], dtype=(tl.float32, tl.float32),
            is_pure=True, pack=1)
