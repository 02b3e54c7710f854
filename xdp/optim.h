/* The optimizer offload of the XDP aggregator (OptimusNIC's idea): SGD and AdamW in fixed point on
 * a completed round of an optimizer job, in the kernel. The round's set holds the SUM64 lanes of
 * the ranks' pre-averaged gradients; sgd_apply() runs the job's update over the block's
 * parameters and momentum (ar_opt, entry = pool slot) with bpf_loop (callback ar_sgd, AdamW's
 * phase in adamw_chunk) and leaves the updated parameters as the round's int32 result lanes.
 * nicoffload/optim/ holds the models this arithmetic follows bit for bit (docs/optimizer.md).
 *
 *   fixed.h                 branch-free fixed-point helpers and integer square roots
 *   pow_fixed               powers, once per block
 *   adamw_constants         AdamW's per-step constants (bias corrections, step size)
 *   adamw_chunk, ar_sgd     the per-element update (bpf_loop callback)
 *   sgd_apply               runs it on a round (AR_OPT_SLOTS > 1: an aggregator with optimizer state)
 */
#ifndef NICOFFLOAD_OPTIM_H
#define NICOFFLOAD_OPTIM_H

#include "agg_maps.h"
#include "fixed.h"

/* AdamW's elements per callback: 4 where a record's elements allow it (8% less time per element
 * than 2: 45.4 against 49.4 ns, agg bench --optimizer), else 2 (elems is even); with 8 the
 * combined stack of the calls is over 512 bytes */
#if AR_ELEMS % 4 == 0
#define ADAM_CHUNK 4
#else
#define ADAM_CHUNK 2
#endif
#define ADAM_CHUNKS ((AR_ELEMS + ADAM_CHUNK - 1) / ADAM_CHUNK)
#define ADAM_QMAX (1ULL << 52)

/* A callback's first element k0 (a multiple of its chunk), hidden from clang: knowing k0's low bits
 * zero, clang computes k0 + j as an OR, which the verifier bounds by the known bits, not by the
 * range checks before it (for 6 elements k <= 7: with the set's offset, a lane read past the
 * slot's value; every elems but a power of two was refused so). Hidden, k0 + j is an ADD, whose
 * range the verifier keeps. A bound on each element's k instead cost 14 ns per element. */
#define CHUNK_BASE(k0) opaque(k0)

/* An update in progress: what the per-element callback needs. A per-CPU scratch value, not the
 * callback's context: bcc rewrites an exported function's parameters, and reading r2 by asm is
 * not reliable in a callback whose compiler uses r2 first. An XDP program runs to the end on its
 * CPU, so one update at a time uses the scratch. */
struct sgd_scratch {
    u32 slot, set;             /* the round's pool slot (ar_slots, ar_opt) and set */
    u32 lsh, rsh, cnt, out, phase, pad;
    s64 offset, half;          /* ranks * bias; rounding of the gradient's right shift */
    u64 mu, damp, wd, lr, mu_n;
    s64 nest;                  /* all ones: Nesterov */
    u64 any;                   /* the OR of |w|: its bit length is that of max |w| */
    /* AdamW (ar_adamw): per block and step */
    u64 b1, b2, omb1, omb2;    /* beta1, beta2, 1 - beta1, 1 - beta2 (AR_OPT_FRAC) */
    u64 eps;                   /* AR_ADAM_EPS_FRAC fractional bits (c->lr too, for AdamW) */
    u64 alpha;                 /* lr * sqrt(bc2) / bc1 = alpha * 2^-(AR_OPT_FRAC + ashift) */
    u64 epsd;                  /* eps * sqrt(bc2), AR_ADAM_FRAC fractional bits (>= 1) */
    u64 lrwd;                  /* lr * weight_decay (AR_OPT_FRAC) */
    s64 neg;                   /* all ones: maximize */
    u64 ams;                   /* all ones: amsgrad */
    u32 ashift, adam;          /* adam: phase 0 is AdamW's (ar_sgd dispatches to adamw_chunk) */
    u64 bltab[8];              /* bitlen's table (bitlen_table) */
    u64 nsh[ADAM_CHUNK];       /* adamw_chunk's normalising shifts: with bitlen's table pointer live,
                                * the calls' combined stack has no room for them (528 > 512 bytes) */
    u64 bls[ADAM_CHUNK];       /* without amsgrad: the bit lengths of the new s (the roots' e + nsh) */
    u64 bleps;                 /* the bit length of epsd */
};
BPF_TABLE("percpu_array", u32, struct sgd_scratch, ar_sgd_scratch, 1);
/* elements per callback: the lookups and the call are paid once per chunk */
#define SGD_CHUNK 8
#define SGD_CHUNKS ((AR_ELEMS + SGD_CHUNK - 1) / SGD_CHUNK)

/* b^t with AR_OPT_FRAC fractional bits, by squaring, floored after each product */
static __always_inline u64 pow_fixed(u64 b, u32 t)
{
    u64 r = 1ULL << AR_OPT_FRAC;
#pragma nounroll
    for (int i = 0; i < 32; i++) {
        u64 on = t & 1;
        opaque(on);
        on = -on;
        r = (((r * b) >> 32) & on) | (r & ~on);
        b = (b * b) >> 32;
        t >>= 1;
    }
    return r;
}

/* The per-block constants of AdamW's update number t (1-based), from the hyperparameters that
 * sgd_apply copied into the scratch (run by the first chunk's callback: its own stack). */
static __always_inline void adamw_constants(struct sgd_scratch *c, u32 t)
{
    u64 one = 1ULL << AR_OPT_FRAC;
    u64 bc1 = one - pow_fixed(c->b1, t);
    u64 bc2 = one - pow_fixed(c->b2, t);
    u64 sq = isqrt64(bc2 << 30) << 1;            /* sqrt(bc2), AR_OPT_FRAC fractional bits */
    u64 x = (u64)mulfrac((s64)c->lr, sq);        /* lr * sqrt(bc2), 62 fractional bits */
    u64 a62 = (1ULL << 62) - 1;
    if (bc1) {
        u64 hi = x / bc1;
        if (hi < (1ULL << 30)) {
            u64 lo = ((x % bc1) << 32) / bc1;
            u64 v = (hi << 32) + lo;
            a62 = v < a62 ? v : a62;
        }
    }
    u32 r = (u32)relu((s64)bit_length(a62) - 32);
    c->alpha = a62 >> (r & 63);
    c->ashift = 30 - r;
    u64 epsd = (u64)mulfrac((s64)c->eps, sq) >> (AR_ADAM_EPS_FRAC - AR_ADAM_FRAC);
    c->epsd = epsd ? epsd : 1;
    c->bleps = bit_length(c->epsd);
    c->lrwd = (u64)mulfrac((s64)c->lr, c->wd) >> (AR_ADAM_EPS_FRAC - AR_OPT_FRAC);
}

/* AdamW on elements [i * ADAM_CHUNK, (i + 1) * ADAM_CHUNK) of a completed round,
 * as torch.optim.AdamW (nicoffload/optim/adamw.py is the model, bit for bit, and derives each
 * step): decoupled weight decay, m = b1 m + (1 - b1) g, s = sqrt(b2 s^2 + (1 - b2) g^2) on
 * operands normalised to 31 bits, w -= alpha * m / (s + eps') with the quotient normalised to
 * 31 significant bits. Phase 0 of ar_sgd for an AdamW job (one bpf_loop callback for both: the
 * loader links a function's callback references to one next function); its phase 1 writes the
 * result lanes as for SGD. */
static __always_inline long adamw_chunk(u64 i, struct sgd_scratch *c, struct ar_slot *slot, struct ar_opt *o,
                                        const int ams)
{
    if (i >= ADAM_CHUNKS)
        return 1;
    if (i == 0)
        adamw_constants(c, o->steps + 1);
    u32 *lane = (u32 *)slot->set[c->set & 1].acc;
    const u8 *tab = (const u8 *)c->bltab;
    u64 any = 0;
    u64 t[ADAM_CHUNK];                  /* the square roots' operands, then their roots */
    u64 *nsh = c->nsh;
    u64 k0 = i * ADAM_CHUNK;
    CHUNK_BASE(k0);
    if (k0 > AR_ELEMS - ADAM_CHUNK)
        return 1;
    /* the moments' recurrences up to the square root's operand */
#pragma unroll
    for (int j = 0; j < ADAM_CHUNK; j++) {
        u64 k = k0 + j;
        s64 live = ((s64)k - (s64)c->cnt) >> 63;
        s64 q = (s64)lane[k] - c->offset;
        s64 g = (((q << (c->lsh & 63)) + c->half) >> (c->rsh & 63)) & live;
        g = (g ^ c->neg) - c->neg;
        s64 w = o->w[k];
        o->w[k] = w - mulfrac(w, c->lrwd);
        o->m[k] = mulfrac(o->m[k], c->b1) + mulfrac(g, c->omb1);
        u64 ag = (u64)((g ^ (g >> 63)) - (g >> 63));
        u64 sv = (u64)o->s[k];
        u64 sh = bitlen32(max63(sv, ag) >> 31, tab);   /* the bits above 31: both are below 2^63 */
        nsh[j] = sh;
        u64 s1 = sv >> sh, g1 = ag >> sh;
        t[j] = (u64)mulfrac((s64)(s1 * s1), c->b2) + (u64)mulfrac((s64)(g1 * g1), c->omb2);
    }
    /* the square roots: ADAM_CHUNK independent dependency chains */
#pragma unroll
    for (int j = 0; j < ADAM_CHUNK; j++) {
        u64 e = isqrt_e(t[j], tab);
        t[j] = isqrt62_e(t[j], e);
        if (!ams)                       /* the root has e bits (none for 0): s = root << nsh has e + nsh */
            c->bls[j] = (e + nsh[j]) & signmask((s64)(0 - e));
    }
    /* the step */
#pragma unroll
    for (int j = 0; j < ADAM_CHUNK; j++) {
        u64 k = k0 + j;
        s64 m = o->m[k];
        s64 w = o->w[k];
        u64 sv = t[j] << nsh[j];
        o->s[k] = (s64)sv;
        u64 d = sv;
        if (ams) {                      /* a constant: the copy without amsgrad has no smax traffic */
            d = max63(sv, (u64)o->smax[k]);
            o->smax[k] = (s64)d;
        }
        d += c->epsd;
        u64 am = (u64)((m ^ (m >> 63)) - (m >> 63));
        u64 L = 62 - bitlen(am, tab);
        u64 bd;
        if (ams) {
            bd = bitlen(d, tab);
        } else {                        /* s < 2^bls, epsd < 2^bleps: d = s + epsd has B or B + 1 bits */
            u64 B = max63(c->bls[j], c->bleps);
            bd = B + (d >> (B & 63));
        }
        u64 sd = (u64)relu((s64)bd - 31);
        u64 Q = (am << L) / (d >> sd);
        s64 kk = (s64)(L + sd) - 32;
        u64 kpos = (u64)relu(kk), kneg = (u64)relu(-kk);
        u64 qa = min63(Q >> kpos, ADAM_QMAX >> kneg) << kneg;
        s64 sgn = m >> 63;
        s64 qs = ((s64)qa ^ sgn) - sgn;
        w -= mulfrac(qs, c->alpha) >> (c->ashift & 63);
        o->w[k] = w;
        any |= (u64)((w ^ (w >> 63)) - (w >> 63));
    }
    c->any |= any;
    return 0;
}

/* bpf_loop callback: element k of an update (phase 0: the SGD step; phase 1: the result lane).
 * The round of block o is complete: its set's acc holds the SUM64 lanes of the ranks'
 * pre-averaged gradients, each rank's lane offset by bias and scaled by 2^-exp (the round's
 * exponent). SGD as torch.optim.SGD does it (weight decay, momentum with dampening, Nesterov;
 * the first update sets the momentum to the gradient) in fixed point with AR_OPT_FRAC
 * fractional bits, on the round's count elements (the padding of a partial block stays 0
 * whatever its lanes); then the updated parameters as int32 lanes with one exponent for the
 * block (value = lane * 2^exp). SGD_CHUNK elements per call; branch-free per element. */
long ar_sgd(u64 i)
{
    u32 zero = 0;
    struct sgd_scratch *c = ar_sgd_scratch.lookup(&zero);
    if (!c || i >= ADAM_CHUNKS)
        return 1;
    u32 idx = c->slot;
    struct ar_slot *slot = ar_slots.lookup(&idx);
    struct ar_opt *o = ar_opt.lookup(&idx);
    if (!slot || !o)
        return 1;
    if (c->adam && !c->phase)
        return c->ams ? adamw_chunk(i, c, slot, o, 1) : adamw_chunk(i, c, slot, o, 0);
    if (i >= SGD_CHUNKS)
        return 1;
    u32 *lane = (u32 *)slot->set[c->set & 1].acc;
    u64 any = 0;
    u64 k0 = i * SGD_CHUNK;
    CHUNK_BASE(k0);
#pragma unroll
    for (int j = 0; j < SGD_CHUNK; j++) {
        u64 k = k0 + j;
        if (k >= AR_ELEMS)
            break;
        if (c->phase) {
            ((s32 *)lane)[k] = (s32)(o->w[k] >> (c->out & 63));
            continue;
        }
        s64 live = ((s64)k - (s64)c->cnt) >> 63;
        s64 q = (s64)lane[k] - c->offset;
        s64 g = (((q << (c->lsh & 63)) + c->half) >> (c->rsh & 63)) & live;
        s64 w = o->w[k];
        g += mulfrac(w, c->wd);
        s64 m = mulfrac(o->m[k], c->mu) + g - mulfrac(g, c->damp);
        o->m[k] = m;
        s64 d = ((g + mulfrac(m, c->mu_n)) & c->nest) | (m & ~c->nest);
        w -= mulfrac(d, c->lr);
        o->w[k] = w;
        any |= (u64)((w ^ (w >> 63)) - (w >> 63));
    }
    c->any |= any;
    return 0;
}

#if AR_OPT_SLOTS > 1
/* Apply the job's optimizer to the completed round in set `set` of pool slot idx (its state
 * SET_UPDATING, so nothing else reads or writes the acc meanwhile; no lock held: bpf_loop is a
 * helper). Returns the result's exponent, wire order, or 0xffff if the scratch is missing. */
static __always_inline u32 sgd_apply(struct ar_job *job, struct ar_hyper *hp, struct ar_opt *o, struct ar_set *s,
                                     u32 idx, u32 set)
{
    u32 zero = 0;
    struct sgd_scratch *c = ar_sgd_scratch.lookup(&zero);
    if (!c)
        return 0xffff;
    s32 gexp = (s16)bpf_ntohs(s->exp);           /* gradient value = lane sum * 2^-gexp */
    /* to AR_OPT_FRAC fractional bits (AdamW: AR_ADAM_FRAC) */
    s32 sh = (hp->opt == AR_OPT_ADAMW ? AR_ADAM_FRAC : AR_OPT_FRAC) - gexp;
    u32 first = o->steps == 0;
    c->slot = idx;
    c->set = set;
    c->offset = (s64)job->workers * (s64)hp->bias;
    c->mu = first ? 0 : hp->momentum;            /* the first update: momentum = gradient */
    c->damp = first ? 0 : hp->dampening;
    c->wd = hp->weight_decay;
    c->lr = hp->lr;
    c->mu_n = hp->momentum;
    c->nest = -(s64)(hp->flags & AR_OPT_NESTEROV);
    c->lsh = sh > 0 ? sh : 0;
    c->rsh = sh < 0 ? -sh : 0;
    c->half = c->rsh ? (1LL << ((c->rsh - 1) & 63)) : 0;
    c->cnt = s->count;
    c->any = 0;
    c->phase = 0;
    c->adam = hp->opt == AR_OPT_ADAMW;
    c->b1 = hp->beta1;
    c->b2 = hp->beta2;
    c->omb1 = hp->omb1;
    c->omb2 = hp->omb2;
    c->eps = hp->eps;
    c->neg = (hp->flags & AR_OPT_MAXIMIZE) ? -1 : 0;
    c->ams = (hp->flags & AR_OPT_AMSGRAD) ? ~0ULL : 0;
    if (c->adam)
        bitlen_table(c->bltab);
    bpf_loop(c->adam ? ADAM_CHUNKS : SGD_CHUNKS, ar_sgd, 0, 0);
    o->steps += 1;
    u32 bits = bit_length(c->any);
    c->out = bits > 31 ? bits - 31 : 0;          /* |lane| < 2^31 */
    c->phase = 1;
    bpf_loop(SGD_CHUNKS, ar_sgd, 0, 0);
    return bpf_htons((u16)(s16)((s32)c->out - AR_OPT_FRAC));
}
#endif

#endif
