/* Sixteen float32 lanes for the decode step (decode_step.c), and the exponential it shares with the
 * prefill attention (AVX-512 only there): one __m512 where the build has AVX-512F, two __m256 where it has
 * AVX2 with FMA and F16C (KVM_VEC16 is 1 in either case, else 0).
 *
 * Every operation is lane-wise and the same instruction on each half, and the one horizontal
 * operation (vf_hsum) sums by the same tree in both builds (the two halves first, then quarters,
 * ...), so a kernel written in vf16 runs the same operations in the same order on an AVX2 CPU as
 * on an AVX-512 one (their bits not yet compared across two such CPUs).
 */
#ifndef KVM_CPU_VEC16_H
#define KVM_CPU_VEC16_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define KVM_VEC16 1
#include <immintrin.h>

typedef __m512 vf16;

static inline vf16 vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf16 vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
static inline vf16 vf_abs(vf16 a) { return _mm512_abs_ps(a); }
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c */
static inline vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
/* Lanes where g < 0 from if_negative, the others from otherwise. */
static inline vf16 vf_where_negative(vf16 g, vf16 if_negative, vf16 otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), otherwise, if_negative);
}
/* Each lane rounded to the nearest integer, ties to even. */
static inline vf16 vf_round(vf16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integer-valued lanes n in [-126, 127]. */
static inline vf16 vf_exp2_integer(vf16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* The first `count` (< 16) lanes from p, the others 0; and their store. */
static inline vf16 vf_load_first(const float *p, int count) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
}
static inline void vf_store_first(float *p, vf16 v, int count) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), v);
}
/* 16 bfloat16 widened to float32 (exactly: a bfloat16 is a float32's upper half). */
static inline vf16 vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 16 int8 codes as float32. */
static inline vf16 vf_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bytes of int4 codes: the low nibbles (codes 0..15) and the high ones (codes 16..31). */
static inline void vf_load_nibbles(const uint8_t *p, vf16 *low, vf16 *high) {
    __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
    *high = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
}
/* A float16 (its bits) in every lane. */
static inline vf16 vf_set1_half(uint16_t bits) { return _mm512_cvtph_ps(_mm256_set1_epi16((short)bits)); }
/* Keeps v in registers here (an empty asm the compiler cannot see through). */
#define VF_KEEP(v) __asm__("" : "+v"(v))
/* The 16 lanes' sum by one tree: halves, then quarters, ... */
static inline float vf_hsum(vf16 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVM_VEC16 1
#include <immintrin.h>

typedef struct {
    __m256 lo, hi; /* lanes 0..7, 8..15 */
} vf16;

#define VF_EACH(OP, a, b) ((vf16){OP((a).lo, (b).lo), OP((a).hi, (b).hi)})

static inline vf16 vf_zero(void) { return (vf16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf16 vf_set1(float x) { return (vf16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf16 vf_load(const float *p) { return (vf16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vf16 vf_add(vf16 a, vf16 b) { return VF_EACH(_mm256_add_ps, a, b); }
static inline vf16 vf_sub(vf16 a, vf16 b) { return VF_EACH(_mm256_sub_ps, a, b); }
static inline vf16 vf_mul(vf16 a, vf16 b) { return VF_EACH(_mm256_mul_ps, a, b); }
static inline vf16 vf_div(vf16 a, vf16 b) { return VF_EACH(_mm256_div_ps, a, b); }
static inline vf16 vf_max(vf16 a, vf16 b) { return VF_EACH(_mm256_max_ps, a, b); }
static inline vf16 vf_abs(vf16 a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return (vf16){_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf16 vf_where_negative(vf16 g, vf16 if_negative, vf16 otherwise) {
    const __m256 zero = _mm256_setzero_ps();
    return (vf16){_mm256_blendv_ps(otherwise.lo, if_negative.lo, _mm256_cmp_ps(g.lo, zero, _CMP_LT_OQ)),
                  _mm256_blendv_ps(otherwise.hi, if_negative.hi, _mm256_cmp_ps(g.hi, zero, _CMP_LT_OQ))};
}
static inline vf16 vf_round(vf16 a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (vf16){_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
static inline __m256 exp2_integer8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf16 vf_exp2_integer(vf16 n) { return (vf16){exp2_integer8(n.lo), exp2_integer8(n.hi)}; }
static inline vf16 vf_load_first(const float *p, int count) {
    float lanes[16] = {0};
    memcpy(lanes, p, sizeof(float) * count);
    return vf_load(lanes);
}
static inline void vf_store_first(float *p, vf16 v, int count) {
    float lanes[16];
    vf_store(lanes, v);
    memcpy(p, lanes, sizeof(float) * count);
}
static inline __m256 bf16_to_float8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf16 vf_load_bf16(const uint16_t *p) { return (vf16){bf16_to_float8(p), bf16_to_float8(p + 8)}; }
static inline __m256 i8_to_float8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf16 vf_load_i8(const int8_t *p) { return (vf16){i8_to_float8(p), i8_to_float8(p + 8)}; }
static inline void vf_load_nibbles(const uint8_t *p, vf16 *low, vf16 *high) {
    const __m256i fifteen = _mm256_set1_epi32(15);
    __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    *low = (vf16){_mm256_cvtepi32_ps(_mm256_and_si256(w0, fifteen)), _mm256_cvtepi32_ps(_mm256_and_si256(w1, fifteen))};
    *high = (vf16){_mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4))};
}
static inline vf16 vf_set1_half(uint16_t bits) {
    __m256 x = _mm256_cvtph_ps(_mm_set1_epi16((short)bits));
    return (vf16){x, x};
}
#define VF_KEEP(v) __asm__("" : "+x"((v).lo), "+x"((v).hi))
static inline float vf_hsum(vf16 v) {
    __m256 a = _mm256_add_ps(v.lo, v.hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

#else
#define KVM_VEC16 0
#endif

#if KVM_VEC16
/* vf16 accumulators a dot-product pass keeps: all in registers on AVX-512; on AVX2 some spill to
 * the L1 cache, which costs less than another pass that widens the weights again. */
#define KVM_VEC16_ACCUMULATORS 16

/* exp(x) for x <= 0 in 16 lanes (Cephes' polynomial, as decode_attention.c's); below -87 as -87.
 * Shared by the decode step (SiLU) and the prefill attention (softmax). */
static inline vf16 exp_nonpositive(vf16 x) {
    x = vf_max(x, vf_set1(-87.0f));
    vf16 n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf16 r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187045e-06f), r);
    vf16 p = vf_set1(1.9875691500E-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507E-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073E-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894E-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459E-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201E-1f));
    p = vf_add(vf_fmadd(vf_mul(p, r), r, r), vf_set1(1.0f));
    return vf_mul(p, vf_exp2_integer(n));
}
#endif

#endif
