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
