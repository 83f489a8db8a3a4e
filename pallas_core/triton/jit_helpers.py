"""``@jit`` functions a generated Triton module defines for itself.

Two kinds, both emitted into the source only when a kernel uses them (so
the generated module stays self-contained and readable):

* combine functions for ``tl.reduce`` / ``tl.associative_scan``
  (``_combine_sum``, ``_combine_argmax`` …);
* math with XLA's semantics where the plain ``tl`` builtin differs: on the
  GPU ``tl.maximum`` drops NaNs while ``lax.max`` keeps them, ``log(1 + x)``
  loses every digit of ``log1p`` for tiny ``x``, and ``floor(x + 0.5)`` is
  not ``round`` (ties, signed zeros).

Every math helper takes float32 tensors (the writer upcasts 16-bit floats)
and returns float32. Negation is written ``r * -1.0``: Triton's unary minus
is ``0 - r``, which loses the sign of zero. Sources of the algorithms: log1p after D. Goldberg,
"What every computer scientist should know about floating-point
arithmetic" (1991), Theorem 4; expm1 after W. Kahan's companion trick
(``(u - 1) * x / log(u)`` with ``u = exp(x)``), which cancels the rounding
error of ``u`` as long as ``log`` is accurate (it is libdevice's on the GPU).
"""
from __future__ import annotations

import math
import struct

# NaN-propagating maximum / minimum, as lax.max / lax.min and XLA's reductions.
# For integers Triton ignores ``propagate_nan``, so one combiner serves every dtype.
_MAX = "tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)"
_MIN = "tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)"

# (value, index) pairs for argmax / argmin. Like jnp.argmax, a NaN beats every
# number and ties keep the smaller index (``a != a`` is only true for NaN).
_ARG_PICK = ("pick = (a {op} b) | ((a != a) & (b == b)) | (((a == b) | ((a != a) & (b != b))) & (i < j))\n"
             "    return tl.where(pick, a, b), tl.where(pick, i, j)")

COMBINERS = {
    "sum": ("a, b", "a + b"),
    "prod": ("a, b", "a * b"),
    "max": ("a, b", _MAX),
    "min": ("a, b", _MIN),
    "and": ("a, b", "a & b"),
    "or": ("a, b", "a | b"),
    "xor": ("a, b", "a ^ b"),
    "argmax": ("a, i, b, j", _ARG_PICK.format(op=">")),
    "argmin": ("a, i, b, j", _ARG_PICK.format(op="<")),
}

# The module global that says whether Triton's CPU interpreter runs the module
# (:func:`pallas_core.triton.runtime.load` sets it), for helpers with PTX in them.
INTERPRETED = "_INTERPRETED"

# exp(-|x|) as a sum of two floats, e_hi + e_lo, with no exp2 (the sigmoid and softplus
# helpers' first lines; t = |x| clamped at 87.5, NaN kept): t reduced as in the exp helper,
# exp(-t) = 2**-k exp(f), f = k ln2 - t = fh + fl in [-ln2/2, ln2/2] (fh exact), exp(f) =
# (1 + fh) + (fl + f^2 C(f)) with C of degree 5 (a least-squares fit reweighted towards
# minimax, 2**-29.7 absolute), each sum split exactly (Fast2Sum), and 2**-k built from
# exponent bits.
_EXP_NEG_ABS = """\
a = tl.abs(x)
t = tl.minimum(a, 87.5, propagate_nan=tl.PropagateNan.ALL)
k = (t * 1.4426950408889634 + 12582912.0) - 12582912.0
fh = k * 0.693145751953125 - t
fl = k * 1.428606765330187e-06
f = fh + fl
p = 0.0001991727331187576
p = p * f + 0.0013946091057732701
p = p * f + 0.008333266712725163
p = p * f + 0.041666269302368164
p = p * f + 0.1666666716337204
p = p * f + 0.5
h = 1.0 + fh
l = (fh - (h - 1.0)) + (fl + f * f * p)
e_hi = h + l
scale = ((127 - k.to(tl.int32)) << 23).to(tl.float32, bitcast=True)
e_lo = (l - (e_hi - h)) * scale
e_hi = e_hi * scale
"""


def _reciprocal(note: str) -> str:
    """Helper lines setting ``q`` ~ ``1 / d``: rcp.approx.ftz.f32 (one MUFU, within 1 ulp)
    on a GPU, for a ``d`` the caller knows needs no range fix-ups (``note`` says why), and
    the division in Triton's interpreter, which cannot run PTX."""
    return f"""\
if {INTERPRETED}:
    q = 1.0 / d
else:  # {note}
    q = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32,
                                  is_pure=True, pack=1)
"""


MATH = {
    # Goldberg: log(u) * x / (u - 1) corrects the rounding of u = 1 + x.
    # u == 1 keeps tiny x (and -0.0) exactly; u == inf keeps log1p(inf) = inf.
    "log1p": ("x", """\
u = 1.0 + x
return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, tl.log(u) * (x / (u - 1.0))))"""),
    # Kahan: (u - 1) * x / log(u) corrects the rounding of u = exp(x); the
    # division comes first so exp(x) near the float32 maximum does not overflow.
    "expm1": ("x", """\
u = tl.exp(x)
em1 = (u - 1.0) * (x / tl.log(u))
em1 = tl.where(u == float("inf"), u, tl.where(u - 1.0 == -1.0, -1.0, em1))
return tl.where(u == 1.0, x, em1)"""),
    # tanh at libdevice's cost (one exp2, one reciprocal, a polynomial; no log):
    # |x| < 1.2: |x| + |x|^3 P(x^2), P of degree 9 (a least-squares fit of tanh's
    # relative error, reweighted towards minimax); above: 1 - 2 / (exp2(2 log2(e) |x|) + 1),
    # which saturates to 1 as exp2 overflows (rcp(inf) = 0). The sign comes back from x's
    # sign bit (an integer test: signed zeros and NaN pass through). On the GPU 1 / d is
    # rcp.approx.ftz.f32 (one MUFU, within 1 ulp; d >= 1 needs none of div.full's range
    # fix-ups), not corrected: above 1.2, 2 / d <= 0.17 while the result is >= 0.83, so
    # the quotient's ulp is a quarter of the result's, and a Newton step would cost three
    # instructions per element (a clamp against d = inf, two FMAs) to win that quarter.
    # Within 2 float32 ulps of float64 tanh over the whole float32 range, with exp2 and the
    # division exact (Triton's interpreter) and at the GPU's worst ex2.approx (2**-22
    # relative) and rcp.approx (2**-23) errors: 1.79 (tests/test_triton_backend.py). On
    # sm_90 the bias+gelu matmul (128 x 128 tile) takes 2296 SASS instructions, against
    # 2560 with 2 / d as div.full.f32 and the sign from two float compares.
    "tanh": ("x", """\
a = tl.abs(x)
z = a * a
p = 6.8239551183069125e-06
p = p * z + -7.049077248666435e-05
p = p * z + 0.0003558507887646556
p = p * z + -0.0012259919894859195
p = p * z + 0.003437281120568514
p = p * z + -0.0087938467040658
p = p * z + 0.021849777549505234
p = p * z + -0.05396498367190361
p = p * z + 0.13333305716514587
p = p * z + -0.3333333134651184
small = a + a * z * p
d = tl.exp2(a * 2.885390081777927) + 1.0
""" + _reciprocal("d >= 1 (or inf): no range fix-ups") + """\
r = tl.where(a >= 1.2, tl.fma(q, -2.0, 1.0), small)
return tl.where(x.to(tl.int32, bitcast=True) < 0, r * -1.0, r)"""),
    # exp with the argument reduced first (Cody & Waite): j = round(x log2(e)) (the
    # 1.5 * 2**23 shift rounds it in the addition), f = x - j ln2 in two steps (ln2's
    # high part has 16 trailing zero bits, so j * hi and the subtraction are exact),
    # then exp2(f log2(e)) (its argument in [-0.5, 0.5]; up to 1.7 where j is capped
    # at 127 so that results up to the float32 maximum stay finite) times exp2(j),
    # a power of two.
    # Building 2**j from exponent bits instead is exact everywhere (numpy's float32
    # exp2, in Triton's interpreter, can be an ulp off at integers) but costs ten
    # more instructions per element on sm_90. tl.exp alone is
    # exp2(x * log2(e)), whose rounded product costs up to |x| * 2**-24 of relative
    # accuracy (about 20 ulps near |x| = 88). x is clamped below at -88 (NaN passes;
    # -inf would make f NaN): the result is subnormal there, or 0 where the GPU's
    # flush-to-zero exp2 meets 2**-127. Above, no clamp is needed: j stays 127 and
    # exp2 of the remainder overflows to inf (x = +inf included).
    "exp": ("x", """\
a = tl.maximum(x, -88.0, propagate_nan=tl.PropagateNan.ALL)
j = tl.minimum((a * 1.4426950408889634 + 12582912.0) - 12582912.0, 127.0)
f = a - j * 0.693145751953125
f = f - j * 1.428606765330187e-06
return tl.exp2(f * 1.4426950408889634) * tl.exp2(j)"""),
    # lax.logistic in float32, within 0.8 ulps of float64, with no exp2 and whatever the
    # quotient's rounding. e = exp(-|x|) is carried as e_hi + e_lo (_EXP_NEG_ABS). Then
    # sigmoid(|x|) = 1 / (1 + e) and sigmoid(-|x|) = e / (1 + e) with two error-free
    # corrections (Muller et al., "Handbook of Floating-Point Arithmetic", 2nd ed., 2018,
    # sections 4.3 and 4.4): the rounding error of d = 1 + e_hi (Fast2Sum, exact as
    # 1 >= e_hi) and the residual of q ~ 1/d, rem = 1 - q d (one fused multiply-add, exact),
    # so 1 / (1 + e) = q + c with c = (rem - q err) q to second order. The quotient's own
    # error drops out, so the GPU takes rcp.approx.f32
    # (one MUFU; d is in [1, 2]) rather than div.full.f32's range fix-ups. Each result is
    # rounded once (a final fused multiply-add). x < -87.5 (results below 2**-126:
    # subnormal) gives 0; NaN stays NaN. Cost on sm_90: 42 SASS instructions per element
    # (1 / (1 + exp(-x)) on the exp helper: 20, 2.3 ulps with exp2 and the division exact,
    # 10 at ex2.approx's and div.full's 2**-22); with e rounded to one float, 34 and 1.5 ulps,
    # but x * sigmoid(x) (silu) is within 2 ulps only with e carried (1.5; XLA's: 2.6).
    "sigmoid": ("x", _EXP_NEG_ABS + """\
d = 1.0 + e_hi
err = (e_hi - (d - 1.0)) + e_lo
""" + _reciprocal("d in [1, 2]: no range fix-ups; the residual below corrects rcp.approx's ulp") + """\
rem = tl.fma(q * -1.0, d, 1.0)
c = (rem - q * err) * q
lo = tl.where(a > 87.5, 0.0, tl.fma(e_hi, q, tl.fma(e_lo, q, e_hi * c)))
return tl.where(x >= 0, q + c, lo)"""),
    # lax.round(..., TO_NEAREST_EVEN) (jnp.round): ties go to the even neighbour.
    # floor(x) is exact, so x - floor(x) is too; large, infinite and NaN x pass.
    "round_even": ("x", """\
r = tl.floor(x)
d = x - r
odd = (r - 2.0 * tl.floor(0.5 * r)) == 1.0
r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
return tl.where(r == 0.0, x * 0.0, r)"""),
    # lax.round(..., AWAY_FROM_ZERO): -0.3 -> -0.0, as XLA.
    "round_away": ("x", """\
a = tl.abs(x)
r = tl.floor(a)
r = tl.where(a - r >= 0.5, r + 1.0, r)
return tl.where(x > 0, r, tl.where(x < 0, r * -1.0, x))"""),
    # C's pow, as XLA: negative bases with integral exponents, zeros and
    # infinities keep their signs; pow(x, 0) = pow(1, y) = pow(-1, +-inf) = 1.
    # exp2(b * log2|a|) in float32 loses |b * log2 a| * 2^-24 of relative
    # accuracy (64 ulps at 2^128); float64 keeps the float32 result within an ulp.
    "pow": ("a, b", """\
inf = float("inf")
r = tl.exp2(b.to(tl.float64) * tl.log2(tl.abs(a).to(tl.float64))).to(tl.float32)
integral = tl.floor(b) == b
odd = integral & ((b - 2.0 * tl.floor(0.5 * b)) == 1.0)
r = tl.where(a < 0, tl.where(integral, tl.where(odd, r * -1.0, r), float("nan")), r)
zero = tl.where(b > 0, tl.where(odd, a, 0.0), tl.where(odd, 1.0 / a, inf))
r = tl.where((a == 0) & (b == b), zero, r)
one = (b == 0) | (a == 1.0) | ((a == -1.0) & (tl.abs(b) == inf))
return tl.where(one, 1.0, r)"""),
}

def _f32(value: float) -> float:
    """``value`` rounded to float32 (to nearest), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


# gelu's tanh form, jax.nn.gelu(x) = 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3),
# as the equal x sigmoid(u), u = 2y = K1 x + K3 x^3, which does not cancel below x = -1 as
# 1 + tanh(y) does: within 1.4 ulps of float64 for every float32 x with a normal result,
# whatever the rounding of rcp.approx (tests/test_triton_backend.py). One path serves both
# signs: with v = -|x|, G = v e / (1 + e), e = exp(u(v)) <= 1, is gelu(v), and for x >= 0
# gelu(x) = x + G (gelu(x) - gelu(-x) = x), G no larger than half of x. Steps:
# * u as a sum of two floats: w = v^2 and its rounding error (one FMA); K1 + K3 w as ph + pl,
#   ph's rounding error from one FMA (K1's high part K1h is a multiple of 2**-20, so K1h - ph
#   is exact for ph < 16) and the constants' float32 residuals K1l, K3l in pl; uh = v ph,
#   ul = (v ph - uh) + v pl. |u| reaches 89.6: its float32 rounding alone would cost up to
#   89.6 * 2**-24 of relative accuracy in e, which is the result's for x << 0.
# * e = 2**k (h + l): k = round(uh log2(e)) (the 1.5 * 2**23 shift rounds it), f = fh + fl
#   = u - k ln2 (fh exact, as in the exp and sigmoid helpers), h = 1 + fh, l = fl + f^2 C(f),
#   C of degree 4 (a least-squares fit reweighted towards minimax: 2**-28.2 absolute).
# * G = v (h + l) / (1 + e) 2**k. v h is split exactly (one FMA); d = 1 + e and its rounding
#   error (Fast2Sum, e <= 1) with e = 2**max(k, -126) (h + l) from exponent bits (below
#   2**-126, e only needs to be tiny); q ~ 1/d by rcp.approx (1 ulp, d in [1, 2]) and the
#   quotient corrected by its residual 1 - q d (one FMA), as in the sigmoid helper (Muller
#   et al., "Handbook of Floating-Point Arithmetic", 2nd ed., 2018, sections 4.3-4.4). The
#   quotient, v (h + l) / (1 + e), is a normal float wherever G is (down to k = -129 at the
#   last normal result, x = -10.1006, where 2**k is not one), and 2**k is added to its
#   exponent bits last, exactly, so no intermediate is subnormal where the result is normal
#   (Triton's interpreter runs under XLA's flush of subnormals). |x| is clamped at 10.104,
#   where k = -129 still: beyond it, G is that point's subnormal -1e-38 (an exponent field
#   that reaches 0, not below). Every product that must be exact is an FMA, so the GPU's
#   contraction of a * b + c changes nothing.
# Edges: NaN stays NaN (x + G), +inf gives inf, -inf gives -1e-38 (the limit 0 within a
# subnormal; jax.nn.gelu(-inf) is NaN), signed zeros keep their sign (the residual of v h is
# negated twice, so v = -0 carries -0 through). Cost on sm_90: 42 SASS instructions per
# element, 15 more than 0.5 x (1 + t) on the tanh helper.
_K1 = 2.0 * math.sqrt(2.0 / math.pi)  # float64, as the reference formula's constants
_K3 = _K1 * 0.044715
_K1H = round(_K1 * 2**20) / 2**20  # exact in float32 (21 significant bits)
_K1L = _f32(_K1 - _K1H)
_K3H = _f32(_K3)
_K3L = _f32(_K3 - _K3H)
_EXP_C4 = (0.5, 0.166665181517601, 0.041666436940431595, 0.008368954062461853,
           0.0013937497278675437)  # (exp(f) - 1 - f) / f^2, lowest degree first
MATH["gelu_tanh"] = ("x", f"""\
v = tl.maximum(tl.abs(x) * -1.0, -10.104)
w = v * v
wl = tl.fma(v, v, w * -1.0)
ph = tl.fma(w, {_K3H!r}, {_K1H!r})
pl = tl.fma(w, {_K3H!r}, {_K1H!r} - ph)
pl = tl.fma(wl, {_K3H!r}, pl + tl.fma(w, {_K3L!r}, {_K1L!r}))
uh = v * ph
ul = tl.fma(v, pl, tl.fma(v, ph, uh * -1.0))
s = tl.fma(uh, 1.4426950408889634, 12582912.0)
k = s - 12582912.0
fh = tl.fma(k, -0.693145751953125, uh)
fl = tl.fma(k, -1.428606765330187e-06, ul)
f = fh + fl
p = tl.fma({_EXP_C4[4]!r}, f, {_EXP_C4[3]!r})
p = tl.fma(p, f, {_EXP_C4[2]!r})
p = tl.fma(p, f, {_EXP_C4[1]!r})
p = tl.fma(p, f, {_EXP_C4[0]!r})
h = 1.0 + fh
l = tl.fma(f * f, p, fl)
gh = v * h
gl = tl.fma(v, l, tl.fma(v * -1.0, h, gh) * -1.0)
kbits = s.to(tl.int32, bitcast=True) << 23
scale = tl.maximum(s, 12582786.0).to(tl.int32, bitcast=True) << 23
scale = (scale + (127 << 23)).to(tl.float32, bitcast=True)
e = h + l
d = tl.fma(e, scale, 1.0)
err = tl.fma(e, scale, 1.0 - d)
""" + _reciprocal("d in [1, 2]: no range fix-ups; the residual below corrects rcp.approx's ulp") + """\
c = tl.fma(q * -1.0, err, tl.fma(q * -1.0, d, 1.0))
g = tl.fma(gh, q, tl.fma(gh, c, gl) * q)
g = (g.to(tl.int32, bitcast=True) + kbits).to(tl.float32, bitcast=True)
return tl.where(x < 0, g, x + g)""")

# jax.nn.softplus, log(1 + e^x) = max(x, 0) + log1p(e), e = exp(-|x|) in (0, 1] carried as
# e_hi + e_lo (_EXP_NEG_ABS), within 1.2 ulps of float64 log1p(exp(x)) for every float32 x
# with a normal result, whatever the rounding of rcp.approx (tests/test_triton_backend.py).
# log1p(e) = 2 atanh(e / (2 + e)), which does not cancel for small e, where the result is
# about e: with S = e / (1 + e/2) (twice the atanh argument, a normal float wherever the
# result is), log1p(e) = S + S^3 B(S^2), B(w) = A(w/4) / 4 where atanh(s) = s + s^3 A(s^2),
# A of degree 3 (a least-squares fit reweighted towards minimax: 2**-27.7 of atanh(s) / s,
# s <= 1/3). S as sh + sl: d = 1 + e_hi/2 and its rounding error (Fast2Sum), q ~ 1/d by
# rcp.approx, sh = e_hi q, sl = (e - sh (1 + e/2)) q from two FMA residuals (Muller et al.,
# "Handbook of Floating-Point Arithmetic", 2nd ed., 2018, sections 4.3-4.4). The result is
# rounded once for x <= 0 (sh + (sl + sh^3 B)), twice for x > 0 (x + (sl + sh^3 B) first).
# x < -87.5 (results below 2**-126) gives 0; +inf gives inf, NaN stays NaN. Cost on sm_90:
# 45 SASS instructions per element (jax.nn.softplus on the exp and log1p helpers: 55, 4.2
# ulps).
_ATANH_A3 = (0.3333320617675781, 0.20010866224765778, 0.1399935632944107, 0.14013078808784485)
_LOG1P_B3 = tuple(a / 4 ** (n + 1) for n, a in enumerate(_ATANH_A3))  # exact: powers of 2
MATH["softplus"] = ("x", _EXP_NEG_ABS + """\
d = tl.fma(e_hi, 0.5, 1.0)
err = tl.fma(e_lo, 0.5, tl.fma(e_hi, 0.5, 1.0 - d))
""" + _reciprocal("d in [1, 1.5]: no range fix-ups; the residuals below correct rcp.approx's ulp") + f"""\
sh = e_hi * q
sl = (tl.fma(sh * -1.0, d, e_hi) + tl.fma(sh * -1.0, err, e_lo)) * q
z = sh * sh
p = tl.fma({_LOG1P_B3[3]!r}, z, {_LOG1P_B3[2]!r})
p = tl.fma(p, z, {_LOG1P_B3[1]!r})
p = tl.fma(p, z, {_LOG1P_B3[0]!r})
r = sh + (tl.maximum(x, 0.0) + tl.fma(sh * z, p, sl))
return tl.where(x < -87.5, 0.0, r)""")

# pallas_core.triton.approx_tanh: PTX's tanh.approx.f32 (about 2**-11 relative error)
# on a GPU; the interpreter cannot run PTX and computes the accurate tanh.
MATH["approx_tanh"] = ("x", f"""\
if {INTERPRETED}:
    return _tanh(x)
return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                 is_pure=True, pack=1)""")

# Helpers that call other helpers.
_NEEDS = {"approx_tanh": ("tanh",)}
# Helpers with PTX in them: their module defines INTERPRETED.
PTX = frozenset({"approx_tanh", "gelu_tanh", "sigmoid", "softplus", "tanh"})


def with_dependencies(names) -> list[str]:
    """``names`` plus the math helpers they call, dependencies first."""
    out: list[str] = []

    def visit(name):
        for dep in _NEEDS.get(name, ()):
            visit(dep)
        if name not in out:
            out.append(name)

    for name in sorted(names):
        visit(name)
    return out


def combiner_source(name: str) -> str:
    """Module source of ``_combine_<name>``."""
    params, body = COMBINERS[name]
    body = body if "return" in body else f"return {body}"
    return f"\n@jit\ndef _combine_{name}({params}):\n    {body}\n"


def math_source(name: str) -> str:
    """Module source of ``_<name>``, one of :data:`MATH`."""
    params, body = MATH[name]
    lines = "\n".join("    " + line for line in body.splitlines())
    return f"\n@jit\ndef _{name}({params}):\n{lines}\n"
