"""The PTX of `decode_e4m3`'s kernel, as strings for `tl.inline_asm_elementwise`: loading a lane's q
fragments (`Q_ASM`, by q's dtype), loading one warp's step of 16 tokens (`LOAD_ASM`), computing it
(`STEP_ASM`) and storing a row's output
(`OUT_ASM`, by the output's dtype). Which bytes a lane loads and which registers hold what:
`decode_e4m3`'s docstring. Plain strings: this module imports no triton.
"""

from __future__ import annotations

import torch

__all__ = ["LOAD_ASM", "OUT_ASM", "Q_ASM", "STEP_ASM"]

NEG_INF = "0fFF800000"


def _q_asm(bf16: bool) -> str:
    """PTX loading lane (g, t)'s A fragments of q, once a program: out $0-$15, f16x2 word w holding d =
    32t + 2w and 32t + 2w + 1 of head g (widened from bf16 when `bf16`); in $16 the address of q[head g,
    32t], $17 nonzero when row g is a head of the group (zeros otherwise)."""
    lines = ["{", ".reg .pred pv;", ".reg .b32 r<16>, lo, hi;", "setp.ne.s32 pv, $17, 0;"]
    lines += [f"mov.b32 r{i}, 0;" for i in range(16)]
    lines += [
        f"@pv ld.global.v4.b32 {{r{4 * i}, r{4 * i + 1}, r{4 * i + 2}, r{4 * i + 3}}}, [$16+{16 * i}];"
        for i in range(4)
    ]
    for w in range(16):
        if bf16:
            lines += [f"shl.b32 lo, r{w}, 16;", f"and.b32 hi, r{w}, 0xffff0000;", f"cvt.rn.f16x2.f32 ${w}, hi, lo;"]
        else:
            lines.append(f"mov.b32 ${w}, r{w};")
    lines.append("}")
    return "\n".join(lines)


def _load_asm() -> str:
    """PTX loading one warp's step of 16 tokens into registers, issued a step before `STEP_ASM` uses them.
    Out: $0-$15 K's bytes [32t, 32t + 32) of tokens g ($0-$7) and 8 + g ($8-$15); $16-$31 V's bytes
    [16g, 16g + 16) of tokens 2t, 2t + 1, 2t + 8, 2t + 9 (4 words each). In: $32 the address of token g's
    byte 32t, $33 of token 2t's byte 16g, $34 the cache's token stride (bytes), $35 how many of the 16
    tokens are real (0-16). Rows past them are not read: zeros (V must be: a zero weight times a NaN of
    unwritten cache would not be zero)."""
    L = [
        "{",
        ".reg .pred pk0, pk1, p0, p1, p2, p3;",
        ".reg .b32 lane, g, t, tv0, tv1, tv2, tv3;",
        ".reg .b64 kp1, vp1, vp2, vp3, st8;",
        "mov.u32 lane, %laneid;",
        "and.b32 t, lane, 3;",
        "shr.u32 g, lane, 2;",
        "setp.lt.s32 pk0, g, $35;",
        "add.s32 tv0, g, 8;",
        "setp.lt.s32 pk1, tv0, $35;",
        "shl.b32 tv0, t, 1;",
        "add.s32 tv1, tv0, 1;",
        "add.s32 tv2, tv0, 8;",
        "add.s32 tv3, tv0, 9;",
        "setp.lt.s32 p0, tv0, $35;",
        "setp.lt.s32 p1, tv1, $35;",
        "setp.lt.s32 p2, tv2, $35;",
        "setp.lt.s32 p3, tv3, $35;",
        "shl.b64 st8, $34, 3;",
        "add.s64 kp1, $32, st8;",
        "add.s64 vp1, $33, $34;",
        "add.s64 vp2, $33, st8;",
        "add.s64 vp3, vp2, $34;",
    ]
    L += [f"mov.b32 ${i}, 0;" for i in range(32)]
    for p, r, a in (("pk0", 0, "$32"), ("pk0", 4, "$32+16"), ("pk1", 8, "kp1"), ("pk1", 12, "kp1+16")):
        L.append(f"@{p} ld.global.v4.b32 {{${r}, ${r + 1}, ${r + 2}, ${r + 3}}}, [{a}];")
    for p, r, a in (("p0", 16, "$33"), ("p1", 20, "vp1"), ("p2", 24, "vp2"), ("p3", 28, "vp3")):
        L.append(f"@{p} ld.global.v4.b32 {{${r}, ${r + 1}, ${r + 2}, ${r + 3}}}, [{a}];")
    L.append("}")
    return "\n".join(L)


def _step_asm() -> str:
    """PTX for one warp's step of 16 tokens, loaded by `LOAD_ASM`. Out: $0 the running max logit of row g,
    $1 its exp sum (this lane's share: its 4 tokens a step), $2-$33 row g's output (n-tile j: $2 + 2j at
    d = 32t + j, $3 + 2j at 32t + 16 + j). In: $34-$67 the same before the step, $68-$83 q's fragments,
    $84-$115 the step's K and V registers (`LOAD_ASM`'s $0-$31), $116 how many of the 16 tokens are real
    (0-16), $117 the logits' scale (log2 units)."""
    L = [
        "{",
        ".reg .pred p0, p1, p2, p3, pz;",
        ".reg .b32 lane, t, tv0, tv1, tv2, tv3, zero, b0, b1, pa0, pa2, x0, x1, x2, x3;",
        ".reg .b16 h0, h1;",
        ".reg .f32 s<8>, mx, tmp, mnew, mref, alpha, e0, e1, e2, e3, fz, d0, d1;",
        "mov.u32 lane, %laneid;",
        "and.b32 t, lane, 3;",
        "mov.b32 zero, 0;",
        "mov.f32 fz, 0f00000000;",
        "shl.b32 tv0, t, 1;",
        "add.s32 tv1, tv0, 1;",
        "add.s32 tv2, tv0, 8;",
        "add.s32 tv3, tv0, 9;",
        "setp.lt.s32 p0, tv0, $116;",
        "setp.lt.s32 p1, tv1, $116;",
        "setp.lt.s32 p2, tv2, $116;",
        "setp.lt.s32 p3, tv3, $116;",
    ]
    L += [f"mov.f32 s{i}, 0f00000000;" for i in range(8)]
    for st in range(8):
        for tile in range(2):
            c = 4 * tile
            L += [
                f"mov.b32 {{h0, h1}}, ${84 + 8 * tile + st};",
                "cvt.rn.f16x2.e4m3x2 b0, h0;",
                "cvt.rn.f16x2.e4m3x2 b1, h1;",
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                f"{{s{c}, s{c + 1}, s{c + 2}, s{c + 3}}}, {{${68 + 2 * st}, zero, ${69 + 2 * st}, zero}}, {{b0, b1}}, "
                f"{{s{c}, s{c + 1}, s{c + 2}, s{c + 3}}};",
            ]
    # row g's logits: tile 0 columns 2t, 2t + 1 (s0, s1), tile 1 columns 8 + 2t, 9 + 2t (s4, s5)
    for s, p in (("s0", 0), ("s1", 1), ("s4", 2), ("s5", 3)):
        L += [f"mul.f32 {s}, {s}, $117;", f"selp.f32 {s}, {s}, {NEG_INF}, p{p};"]
    L += [
        "max.f32 mx, s0, s1;",
        "max.f32 mx, mx, s4;",
        "max.f32 mx, mx, s5;",
        "shfl.sync.bfly.b32 tmp, mx, 1, 0x1f, 0xffffffff;",
        "max.f32 mx, mx, tmp;",
        "shfl.sync.bfly.b32 tmp, mx, 2, 0x1f, 0xffffffff;",
        "max.f32 mx, mx, tmp;",
        "max.f32 mnew, $34, mx;",
        # a warp that has seen no token yet (its steps so far past the end) measures from 0, not -inf
        "setp.eq.f32 pz, mnew, 0fFF800000;",
        "selp.f32 mref, 0f00000000, mnew, pz;",
        "sub.f32 tmp, $34, mref;",
        "ex2.approx.ftz.f32 alpha, tmp;",
    ]
    for e, s in (("e0", "s0"), ("e1", "s1"), ("e2", "s4"), ("e3", "s5")):
        L += [f"sub.f32 tmp, {s}, mref;", f"ex2.approx.ftz.f32 {e}, tmp;"]
    L += [
        "add.f32 tmp, e0, e1;",
        "add.f32 tmp, tmp, e2;",
        "add.f32 tmp, tmp, e3;",
        "fma.rn.f32 $1, $35, alpha, tmp;",
        "mov.f32 $0, mnew;",
        "cvt.rn.f16x2.f32 pa0, e1, e0;",
        "cvt.rn.f16x2.f32 pa2, e3, e2;",
    ]
    for w in range(4):
        L += [
            f"prmt.b32 x0, ${100 + w}, ${104 + w}, 0x5140;",
            f"prmt.b32 x1, ${100 + w}, ${104 + w}, 0x7362;",
            f"prmt.b32 x2, ${108 + w}, ${112 + w}, 0x5140;",
            f"prmt.b32 x3, ${108 + w}, ${112 + w}, 0x7362;",
        ]
        for i in range(4):
            j = 4 * w + i
            lo, hi = ("x0", "x2") if i < 2 else ("x1", "x3")
            half = "h0" if i % 2 == 0 else "h1"
            L += [
                f"mov.b32 {{h0, h1}}, {lo};",
                f"cvt.rn.f16x2.e4m3x2 b0, {half};",
                f"mov.b32 {{h0, h1}}, {hi};",
                f"cvt.rn.f16x2.e4m3x2 b1, {half};",
                f"mul.f32 ${2 + 2 * j}, ${36 + 2 * j}, alpha;",
                f"mul.f32 ${3 + 2 * j}, ${37 + 2 * j}, alpha;",
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                f"{{${2 + 2 * j}, ${3 + 2 * j}, d0, d1}}, {{pa0, zero, pa2, zero}}, {{b0, b1}}, "
                f"{{${2 + 2 * j}, ${3 + 2 * j}, fz, fz}};",
            ]
    L.append("}")
    return "\n".join(L)


def _out_asm(kind: str) -> str:
    """Store row g's normalised output. $0 out: l summed over the row's 4 lanes; $1-$32 acc; $33 l (this
    lane's share); $34 address of out[head g, d = 32t]; $35 nonzero for a real row; $36 a factor (v_scale).
    Accumulator pair j holds d = 32t + j and 32t + 16 + j."""
    L = [
        "{",
        ".reg .pred pv;",
        ".reg .f32 l, tmp, r;",
        ".reg .b16 hb;",
        "shfl.sync.bfly.b32 tmp, $33, 1, 0x1f, 0xffffffff;",
        "add.f32 l, $33, tmp;",
        "shfl.sync.bfly.b32 tmp, l, 2, 0x1f, 0xffffffff;",
        "add.f32 l, l, tmp;",
        "div.rn.f32 r, $36, l;",
        "setp.ne.s32 pv, $35, 0;",
    ]
    size = 4 if kind == "f32" else 2
    for j in range(16):
        for half, reg in ((0, 1 + 2 * j), (1, 2 + 2 * j)):
            off = (16 * half + j) * size
            L.append(f"mul.f32 tmp, ${reg}, r;")
            if kind == "f32":
                L.append(f"@pv st.global.f32 [$34+{off}], tmp;")
            else:
                L += [f"cvt.rn.{kind}.f32 hb, tmp;", f"@pv st.global.b16 [$34+{off}], hb;"]
    L += ["mov.f32 $0, l;", "}"]
    return "\n".join(L)


Q_ASM = {torch.bfloat16: _q_asm(True), torch.float16: _q_asm(False)}
LOAD_ASM = _load_asm()
STEP_ASM = _step_asm()
OUT_ASM = {torch.bfloat16: _out_asm("bf16"), torch.float16: _out_asm("f16"), torch.float32: _out_asm("f32")}
