"""The E2M1 decode the one-row kernels share (:mod:`vllm_ext.nvfp4_gemv`'s row kernel, the row+lora kernel of
:mod:`vllm_ext.nvfp4_gemv_lora`, :mod:`vllm_ext.nvfp4_marlin_row` and :mod:`vllm_ext.nvfp4_gemv_tma`): an int32 word of
8 codes into 8 float32 values, each the code's value times a power of two that the kernels' epilogues undo
(:func:`_decode_up`). Three ways (:func:`decode_mode` picks one per launch): Triton's integer operations (the
interpreter), the float16 bit moves in PTX (docs/benchmarks.md §4j), and the decode through FP8 in PTX (sm_89 and
later, §4ba). The two PTX decodes give the same output bits."""

from __future__ import annotations

import os

import torch

from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

__all__ = ["DECODE_ENV", "decode_mode"]


# PTX for one int32 word of 8 E2M1 codes -> 8 float32 (code j times 2^-14, code j in bits 4j..4j+3): codes j and j+4
# become the two float16 halves of one register h_j (magnitude bits to 11-9, sign to 15), then each half is widened.
# Five integer operations per two codes (ptxas merges the and/or pairs), one conversion per code.


def _decode8_ptx() -> str:
    def masked(reg: str, by: int, mask: str) -> list[str]:  # reg = (word shifted left by `by`, right if < 0) & mask
        if by == 0:
            return [f"and.b32 {reg}, $8, {mask};"]
        op = f"shl.b32 {reg}, $8, {by};" if by > 0 else f"shr.b32 {reg}, $8, {-by};"
        return [op, f"and.b32 {reg}, {reg}, {mask};"]

    lines = ["{", ".reg .b32 t, u, h0, h1, h2, h3;", ".reg .b16 l0, l1, l2, l3, l4, l5, l6, l7;"]
    for j in range(4):  # the magnitudes of codes j and j + 4, then their signs
        lines += masked("t", 9 - 4 * j, "0x0E000E00") + masked("u", 12 - 4 * j, "0x80008000") + [f"or.b32 h{j}, t, u;"]
    lines += [f"mov.b32 {{l{j}, l{j + 4}}}, h{j};" for j in range(4)]  # the halves: code j low, code j + 4 high
    lines += [f"cvt.f32.f16 ${j}, l{j};" for j in range(8)]
    return "\n".join(lines + ["}"])


_DECODE8_PTX_TEXT = _decode8_ptx()
_DECODE8_PTX = tl.constexpr(_DECODE8_PTX_TEXT) if tl is not None else None  # a global a kernel may read


# The same 8 codes through FP8 (sm_89 and later; docs/benchmarks.md §4ba): a code's sign and 3 magnitude bits at bits
# 7 and 4-2 of a byte make the E4M3 byte of its value times 2^-6 (E2M1's exponent 0 lands on E4M3's subnormals,
# exactly). The low nibbles of the word's four bytes (codes 0, 2, 4, 6) take two shifts and two masks, the high ones
# (codes 1, 3, 5, 7; their sign is already bit 7) one shift and two masks; then cvt.rn.f16x2.e4m3x2 makes two
# float16s of each byte pair, and each is widened as before. 7 integer/logic operations per word instead of 16: the
# one-row kernels are bound by the ALU pipeline that executes them (§4ba).
def fp8_pair_lines(word: str) -> list[str]:
    """The PTX lines that decode the int32 operand ``word`` through FP8 into four float16 pairs, h0 = codes (0, 2),
    h1 = (4, 6), h2 = (1, 3), h3 = (5, 7) (low half first), each the code's value times 2^-6; they use the b32
    registers a, b, lo, hi, h0-h3 and the b16 registers p0-p3, which the caller declares."""
    return [f"shl.b32 a, {word}, 2;", "and.b32 a, a, 0x1C1C1C1C;", f"shl.b32 b, {word}, 4;",
            "and.b32 b, b, 0x80808080;", "or.b32 lo, a, b;",  # the E4M3 bytes of codes 0, 2, 4, 6
            f"shr.b32 a, {word}, 2;", "and.b32 a, a, 0x1C1C1C1C;", f"and.b32 b, {word}, 0x80808080;",
            "or.b32 hi, a, b;",  # codes 1, 3, 5, 7
            "mov.b32 {p0, p1}, lo;", "mov.b32 {p2, p3}, hi;",
            *(f"cvt.rn.f16x2.e4m3x2 h{i}, p{i};" for i in range(4))]  # the low byte to the low half


def _decode8_fp8_ptx() -> str:
    lines = ["{", ".reg .b32 a, b, lo, hi, h0, h1, h2, h3;",
             ".reg .b16 p0, p1, p2, p3, l0, l1, l2, l3, l4, l5, l6, l7;", *fp8_pair_lines("$8")]
    # h0: codes 0, 2; h1: 4, 6; h2: 1, 3; h3: 5, 7
    lines += ["mov.b32 {l0, l2}, h0;", "mov.b32 {l4, l6}, h1;", "mov.b32 {l1, l3}, h2;", "mov.b32 {l5, l7}, h3;"]
    lines += [f"cvt.f32.f16 ${j}, l{j};" for j in range(8)]
    return "\n".join(lines + ["}"])


_DECODE8_FP8_PTX_TEXT = _decode8_fp8_ptx()
_DECODE8_FP8_PTX = tl.constexpr(_DECODE8_FP8_PTX_TEXT) if tl is not None else None
DECODE_ENV = "QERL_ROW_DECODE"
_FP8_CVT: dict[str, bool] = {}
# the float16-pair modes (decode_mode 3 and 4), taken out after they failed the real-model check
_REMOVED = ("hfma2", "hfma2-unguarded")


def decode_mode(device: torch.device, asm: bool | None = None) -> int:
    """The one-row kernels' E2M1 decode, their ``ASM`` constexpr: 0 Triton's integer operations (``asm=False``, or
    by default under the interpreter or off CUDA), 1 the float16 bit moves in PTX (:func:`_decode8_ptx`), 2 the decode
    through FP8 (:func:`_decode8_fp8_ptx`, compute capability 8.9 and later). PTX takes 2 where the GPU has it, unless
    ``QERL_ROW_DECODE=f16`` (``fp8``, the default, or ``f16``; another value is an error at any launch). Both PTX
    decodes give the same output bits. ``asm``: None (by the device), false (0), or true (PTX, 1 or 2 as above).

    ``hfma2`` and ``hfma2-unguarded`` (3 and 4, the products summed in float16 pairs) were taken out after they
    failed the real-model check (docs/benchmarks.md §4bi, §4bk); they are errors that say so."""
    raw = os.environ.get(DECODE_ENV)
    choice = (raw or "fp8").strip().lower()
    if choice in _REMOVED:
        raise ValueError(f"{DECODE_ENV}={raw!r}: the float16-pair decode was removed (docs/benchmarks.md §4bk: it "
                         "failed its real-model check); use fp8 (the default) or f16")
    if choice not in ("fp8", "f16"):
        raise ValueError(f"{DECODE_ENV}={raw!r}: use fp8 (the default) or f16")
    if (asm is not None and not asm) or (asm is None and (device.type != "cuda" or _interpreting())):
        return 0
    if choice == "f16" or device.type != "cuda":
        return 1
    key = str(device)
    if key not in _FP8_CVT:
        _FP8_CVT[key] = torch.cuda.get_device_capability(device) >= (8, 9)
    return 2 if _FP8_CVT[key] else 1


if triton is not None:

    @triton.jit
    def _half_lo(h):
        """The low float16 of each int32, widened to float32."""
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _half_hi(h):
        """The high float16 of each int32, widened to float32."""
        return (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _decode_up(ASM: tl.constexpr):
        """What undoes :func:`_decode8`'s power of two: 2^6 after the FP8 decode (``ASM`` 2), else 2^14."""
        if ASM >= 2:
            up = 64.0
        else:
            up = 16384.0
        return up

    @triton.jit
    def _decode8_asm(wv, PTX: tl.constexpr):
        """The 8 float32 outputs of the decode PTX ``PTX`` for each int32 word of ``wv``."""
        return tl.inline_asm_elementwise(
            asm=PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[wv],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1,
        )  # fmt: skip

    @triton.jit
    def _decode8(wv, ASM: tl.constexpr):
        """The 8 E2M1 codes of each int32 word of ``wv`` (code j in bits 4j .. 4j + 3) as 8 float32 tensors shaped
        like ``wv``: code j's value times 2^-14, or times 2^-6 with ``ASM`` 2 (:func:`_decode_up` undoes either).
        ``ASM`` (:func:`decode_mode`): 1 and 2 in PTX (the interpreter cannot run it; the GPU tests check it), 2 through
        FP8 (sm_89 and later)."""
        if ASM >= 2:
            codes = _decode8_asm(wv, _DECODE8_FP8_PTX)
        elif ASM == 1:
            codes = _decode8_asm(wv, _DECODE8_PTX)
        else:  # codes j and j + 4 as two float16 in one int32 (halves: code j, code j + 4): the magnitude bits to
            # bits 11-9 of each half, the sign to bit 15; each float16 is the E2M1 value times 2^-14
            h0 = ((wv << 9) & 0x0E000E00) | ((wv << 12) & -2147450880)  # -2147450880 = 0x80008000 as int32
            h1 = ((wv << 5) & 0x0E000E00) | ((wv << 8) & -2147450880)
            h2 = ((wv << 1) & 0x0E000E00) | ((wv << 4) & -2147450880)
            h3 = ((wv >> 3) & 0x0E000E00) | (wv & -2147450880)
            codes = (_half_lo(h0), _half_lo(h1), _half_lo(h2), _half_lo(h3),
                     _half_hi(h0), _half_hi(h1), _half_hi(h2), _half_hi(h3))
        return codes
