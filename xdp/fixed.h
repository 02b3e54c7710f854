/* Branch-free fixed-point helpers of the optimizers (xdp/optim.h): products with a fraction,
 * sign masks, min/max, bit length and integer square roots, on the integers BPF has. No maps
 * and no BPF helpers: it compiles on its own.
 *
 *   mulfrac .. bit_length   branch-free fixed-point helpers (no conditional moves in BPF)
 *   bitlen_table, bitlen    bit length by a de Bruijn table (per element)
 *   isqrt64                 integer square root, digit by digit (once per block)
 *   isqrt62                 integer square root, seed and Newton steps (per element)
 */
#ifndef NICOFFLOAD_FIXED_H
#define NICOFFLOAD_FIXED_H

/* floor(x * c / 2^AR_OPT_FRAC) for |x| < 2^62 and 0 <= c <= 2^AR_OPT_FRAC, exactly (no 128-bit
 * product: x = xh * 2^32 + xl with 0 <= xl < 2^32). */
static __always_inline s64 mulfrac(s64 x, u64 c)
{
    s64 xh = x >> 32;
    u64 xl = (u64)x & 0xffffffffULL;
    return xh * (s64)c + (s64)((xl * c) >> 32);
}

/* Branch-free helpers for values below 2^63 (BPF has no conditional moves: a branch per element
 * would multiply the paths the verifier walks). The empty asm hides the sign mask from clang,
 * which would otherwise see through it and emit a compare and branch. */
#define opaque(x) asm volatile("" : "+r"(x))
static __always_inline u64 signmask(s64 x) { opaque(x); return (u64)(x >> 63); }
static __always_inline u64 min63(u64 a, u64 b) { u64 d = a - b; return b + (d & signmask((s64)d)); }
static __always_inline u64 max63(u64 a, u64 b) { u64 d = a - b; return a - (d & signmask((s64)d)); }
static __always_inline s64 relu(s64 x) { return x & ~(s64)signmask(x); }
/* Bits needed to hold v (0 for 0), any u64: every bit below the highest set one set too, then
 * counted (SWAR popcount): shifts by constants only, where the binary search it replaced took
 * 1.4 to 1.7 times as long per call (BPF_PROG_TEST_RUN). tests/bpf/test_isqrt.py checks it. */
static __always_inline u64 bit_length(u64 v)
{
    v |= v >> 1; v |= v >> 2; v |= v >> 4; v |= v >> 8; v |= v >> 16; v |= v >> 32;
    v -= (v >> 1) & 0x5555555555555555ULL;
    v = (v & 0x3333333333333333ULL) + ((v >> 2) & 0x3333333333333333ULL);
    v = (v + (v >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (v * 0x0101010101010101ULL) >> 56;
}

/* Bits needed to hold v < 2^63, by a de Bruijn sequence: v smeared to 2^n - 1; the top 6 bits of
 * 2^n * BITLEN_DEBRUIJN are an index of its own for each n <= 63, which a 64-byte table the caller
 * holds maps back to n (bitlen_table fills it, as 8 little-endian u64).
 * About 13 fewer instructions than bit_length's popcount. The AdamW update takes 4 per element;
 * bit_length's were 31% of its time (BPF_PROG_TEST_RUN with them stubbed out), and bitlen took it
 * from 47.8 to 43.0 ns per element. tests/bpf/test_isqrt.py checks it on every bit length,
 * tests/unit/test_isqrt_seed.py the table. */
#define BITLEN_DEBRUIJN 0x022fdd63cc95386dULL
static __always_inline void bitlen_table(u64 *tab)
{
    tab[0] = 0x1b36070335020100ULL; tab[1] = 0x1c30372208292604ULL;    /* BITLEN_TABLE */
    tab[2] = 0x09162a2c2e27053eULL; tab[3] = 0x0b1d1231383b2318ULL;
    tab[4] = 0x2f2128251a06343fULL; tab[5] = 0x0a113a17152b2d3dULL;
    tab[6] = 0x1039143c20241933ULL; tab[7] = 0x0c0d0e1e0f131f32ULL;
}
/* bitlen of v < 2^32: smeared 31 places down */
static __always_inline u64 bitlen32(u64 v, const u8 *tab)
{
    v |= v >> 1; v |= v >> 2; v |= v >> 4; v |= v >> 8; v |= v >> 16;
    return tab[((v + 1) * BITLEN_DEBRUIJN) >> 58];
}
/* any v < 2^63: smeared 32 places first, then 31 (the order of the steps does not matter) */
static __always_inline u64 bitlen(u64 v, const u8 *tab) { return bitlen32(v | (v >> 32), tab); }

/* One digit of floor(sqrt(t)), digit by digit, branch-free: bit runs over the powers of four
 * from the highest (t < 4 * bit) down; the caller shifts it by 2 between digits. */
#define ISQRT_DIGIT(t, r, bit) do {                    \
        u64 c_ = (r) + (bit);                          \
        u64 ge_ = ~signmask((s64)((t) - c_));          \
        (t) -= c_ & ge_;                               \
        (r) = ((r) >> 1) + ((bit) & ge_);              \
    } while (0)

/* floor(sqrt(t)) for t <= 2^62 (32 result bits; a loop: once per block) */
static __always_inline u64 isqrt64(u64 t)
{
    u64 r = 0, bit = 1ULL << 62;
#pragma nounroll
    for (int i = 0; i < 32; i++) {
        ISQRT_DIGIT(t, r, bit);
        bit >>= 2;
    }
    return r;
}

/* sqrt(X) ~ (ISQRT_C0 + ISQRT_C1 X + ISQRT_C2 X^2) / 2^30 for X in [1, 4): the quadratic of
 * (near) least maximum relative error, within 0.503% at every X = u / 2^20 the seed computes
 * (tests/unit/test_isqrt_seed.py checks each) */
#define ISQRT_C0 556791937LL
#define ISQRT_C1 564800064LL
#define ISQRT_C2 (-42456117LL)

/* floor(sqrt(t)) for 0 <= t < 2^62, exactly, branch-free: the per-element square root. The seed
 * r is the quadratic above on t normalised by a power of four, shifted back: within 0.58% of
 * sqrt(t) for t >= 2^24. Newton's integer step r' = floor((r + floor(t / r)) / 2) never goes below
 * floor(sqrt(t)) and takes a relative error d to at most d^2 / (2 (1 - d)): 1.7e-5 after the
 * first step, under 0.31 of a unit after the second (sqrt(t) < 2^31), so r is floor(sqrt(t)) or
 * one more, which the last line takes back. Below 2^24 tests/unit/test_isqrt_seed.py checks every
 * t. Division is a BPF instruction; the seed is at least 2, so no divisor is 0 (t = 0 included). */
static __always_inline u64 isqrt62_e(u64 t, u64 e)
{
    s64 u = (s64)((t << (62 - 2 * e)) >> 40);       /* X = t / 4^(e-1) as u / 2^20, [2^20, 2^22) */
    s64 p = ISQRT_C1 + ((ISQRT_C2 * u) >> 20);
    u64 y = (u64)(ISQRT_C0 + ((p * u) >> 20));      /* 2^30 sqrt(X), within 0.503% */
    u64 r = (y >> (31 - e)) | 2;                    /* sqrt(t) = sqrt(X) 2^(e-1) */
    r = (r + t / r) >> 1;
    r = (r + t / r) >> 1;
    return r + signmask((s64)(t - r * r));          /* r * r <= 2^62: minus one where above t */
}
/* e = isqrt_e(t): 4^(e-1) <= t < 4^e where t > 0 (0 for 0), so the root's bit length is e */
static __always_inline u64 isqrt_e(u64 t, const u8 *tab) { return (bitlen(t, tab) + 1) >> 1; }
static __always_inline u64 isqrt62(u64 t, const u8 *tab) { return isqrt62_e(t, isqrt_e(t, tab)); }

#endif
