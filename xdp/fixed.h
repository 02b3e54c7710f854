/* Branch-free fixed-point helpers of the optimizers (xdp/optim.h): products with a fraction,
 * sign masks, min/max, bit length and integer square roots, on the integers BPF has. No maps
 * and no BPF helpers: it compiles on its own.
 *
 *   mulfrac .. bit_length   branch-free fixed-point helpers (no conditional moves in BPF)
 *   isqrt64                 integer square root, digit by digit (once per block)
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
static __always_inline u64 nonzero63(u64 v) { s64 n = -(s64)v; opaque(n); return (u64)n >> 63; }
static __always_inline u64 min63(u64 a, u64 b) { u64 d = a - b; return b + (d & signmask((s64)d)); }
static __always_inline u64 max63(u64 a, u64 b) { u64 d = a - b; return a - (d & signmask((s64)d)); }
static __always_inline s64 relu(s64 x) { return x & ~(s64)signmask(x); }
/* Bits needed to hold v (0 for 0), any u64: each test sees a value below 2^32 */
static __always_inline u64 bit_length(u64 v)
{
    u64 n = 0, sh;
    sh = nonzero63(v >> 32) << 5; v >>= sh; n += sh;
    sh = nonzero63(v >> 16) << 4; v >>= sh; n += sh;
    sh = nonzero63(v >> 8) << 3; v >>= sh; n += sh;
    sh = nonzero63(v >> 4) << 2; v >>= sh; n += sh;
    sh = nonzero63(v >> 2) << 1; v >>= sh; n += sh;
    sh = nonzero63(v >> 1); v >>= sh; n += sh;
    return n + v;
}

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

#endif
