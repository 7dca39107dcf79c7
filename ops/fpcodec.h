/*
 * Per-element conversion between float32 and a custom float format, written once for the host
 * compiler (the CPU engine, loaded through ctypes) and for NVRTC/nvcc (the CuPy kernels).
 *
 * Every function works on integers only: no float arithmetic touches the value being rounded,
 * so the result cannot depend on FTZ/DAZ modes, fused multiply-adds or the compiler, and the
 * two engines agree bit for bit. The APS power-of-two scale is folded into the exponent
 * (x * 2^shift is never formed), so scaling adds no rounding either.
 */
#ifndef HVD_APS_FPCODEC_H_
#define HVD_APS_FPCODEC_H_

#ifdef __CUDACC__
#define HVD_HD __host__ __device__ __forceinline__
typedef unsigned int hvd_u32;
typedef int hvd_i32;
typedef unsigned long long hvd_u64;
typedef long long hvd_i64;
#else
#include <stdint.h>
#include <string.h>
#define HVD_HD static inline
typedef uint32_t hvd_u32;
typedef int32_t hvd_i32;
typedef uint64_t hvd_u64;
typedef int64_t hvd_i64;
#endif

/* Special-value policies (FloatFormat.variant in Python). */
#define HVD_IEEE 0   /* top exponent holds Inf and NaN, like IEEE 754 and float8_e5m2 */
#define HVD_FN_NAN 1 /* no Inf; the all-ones magnitude is NaN (OCP FP8 E4M3, float8_e4m3fn) */
#define HVD_FINITE 2 /* every code is a number (OCP FP6/FP4, float4_e2m1fn) */

typedef struct {
  hvd_i32 exp_bits;
  hvd_i32 man_bits;
  hvd_i32 policy;
  hvd_i32 saturate; /* finite overflow clamps to +-max instead of Inf/NaN */
} hvd_fmt_t;

HVD_HD hvd_u32 hvd_f32_bits(float x) {
#ifdef __CUDACC__
  return __float_as_uint(x);
#else
  hvd_u32 u;
  memcpy(&u, &x, sizeof u);
  return u;
#endif
}

HVD_HD float hvd_bits_f32(hvd_u32 u) {
#ifdef __CUDACC__
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
#endif
}

HVD_HD hvd_u32 hvd_all_ones(hvd_fmt_t f) { return (1u << (f.exp_bits + f.man_bits)) - 1u; }

HVD_HD hvd_u32 hvd_inf_code(hvd_fmt_t f) { return ((1u << f.exp_bits) - 1u) << f.man_bits; }

/* Largest finite magnitude code. */
HVD_HD hvd_u32 hvd_max_code(hvd_fmt_t f) {
  return f.policy == HVD_IEEE ? hvd_inf_code(f) - 1u
         : f.policy == HVD_FN_NAN ? hvd_all_ones(f) - 1u : hvd_all_ones(f);
}

/*
 * Counter-based randomness for stochastic rounding: splitmix64 of (mixed seed, element index).
 * Any engine that knows the seed and an element's flat index draws the same 32 bits for it,
 * whatever the chunking or thread layout.
 */
HVD_HD hvd_u64 hvd_mix64(hvd_u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

HVD_HD hvd_u32 hvd_random32(hvd_u64 seed, hvd_u64 index) {
  return (hvd_u32)(hvd_mix64(hvd_mix64(seed) + (index + 1ull) * 0x9E3779B97F4A7C15ull) >> 32);
}

/* Everything hvd_encode_one needs that does not depend on the element: computed once per call,
 * so the per-element code is branch-free selects that compilers vectorise. */
typedef struct {
  hvd_i32 exp_bits, man_bits;
  hvd_u32 max_code;     /* largest finite magnitude */
  hvd_u32 overflow_mag; /* finite overflow: Inf (ieee), NaN (fn) or max (saturate, finite-only) */
  hvd_u32 inf_mag;      /* Inf input: Inf, NaN or max, as ml_dtypes has it */
  hvd_u32 nan_mag;      /* NaN input; formats without NaN give a zero ... */
  hvd_u32 nan_flip;     /* ... of the opposite sign, as ml_dtypes does */
} hvd_encoder_t;

HVD_HD hvd_encoder_t hvd_encoder(hvd_fmt_t f) {
  const hvd_u32 quiet = f.man_bits ? 1u << (f.man_bits - 1) : 0u;
  hvd_encoder_t p;
  p.exp_bits = f.exp_bits;
  p.man_bits = f.man_bits;
  p.max_code = hvd_max_code(f);
  p.inf_mag = f.policy == HVD_IEEE ? hvd_inf_code(f) : f.policy == HVD_FN_NAN ? hvd_all_ones(f) : p.max_code;
  p.overflow_mag = (f.saturate || f.policy == HVD_FINITE) ? p.max_code : p.inf_mag;
  p.nan_mag = f.policy == HVD_IEEE ? hvd_inf_code(f) | quiet : f.policy == HVD_FN_NAN ? hvd_all_ones(f) : 0u;
  p.nan_flip = f.policy == HVD_FINITE;
  return p;
}

/*
 * Code of x * 2^shift. `stochastic` rounds up with probability equal to the discarded fraction,
 * resolved to 2^-32, using `rnd`; otherwise round to nearest, ties to the even code.
 */
HVD_HD hvd_u32 hvd_encode_one(float x, hvd_encoder_t p, hvd_i32 shift, int stochastic, hvd_u32 rnd) {
  const hvd_i32 E = p.exp_bits, M = p.man_bits;
  const hvd_u32 u = hvd_f32_bits(x);
  const hvd_u32 sign = u >> 31, a = u & 0x7FFFFFFFu;
  /* float32 subnormals are normalised through an exact int->float conversion */
  const hvd_u32 b = hvd_f32_bits((float)(hvd_i32)(a & 0x7FFFFFu));
  const int sub = a < 0x800000u;
  const hvd_i32 e32 = sub ? (hvd_i32)(b >> 23) - 149 : (hvd_i32)(a >> 23);
  const hvd_u32 sig = ((sub ? b : a) & 0x7FFFFFu) | 0x800000u;
  /* t = biased target exponent - 1; t < 0 means the value lands in the target's subnormals */
  const hvd_i32 t = e32 - 129 + shift + (1 << (E - 1));
  const hvd_i32 tmax = 1 << E;
  const hvd_u32 base = t > 0 ? (hvd_u32)(t < tmax ? t : tmax) << M : 0u;
  const hvd_i32 drop = 23 - M - (t < 0 ? t : 0);
  hvd_u32 q, up;
  if (stochastic) { /* 64-bit: the threshold keeps 32 random bits below the kept ones */
    const hvd_i32 d = drop < 56 ? drop : 56;
    const hvd_u64 rem = (hvd_u64)sig & ((1ull << d) - 1ull);
    q = (hvd_u32)((hvd_u64)sig >> d);
    up = (hvd_u64)rnd < (d <= 32 ? rem << (32 - d) : rem >> (d - 32));
  } else { /* 32-bit: past 25 dropped bits a 24-bit significand rounds to 0 either way */
    const hvd_i32 d = drop < 25 ? drop : 25;
    /* ties go to the even *code*: with man_bits=0, base + q's last bit is the exponent's */
    q = (sig + (1u << (d - 1)) - 1u + ((base + (sig >> d)) & 1u)) >> d;
    up = 0u;
  }
  hvd_u32 mag = base + q + up;
  mag = mag > p.max_code ? p.overflow_mag : mag;
  mag = a == 0u ? 0u : mag;
  const int nan = a > 0x7F800000u;
  mag = a == 0x7F800000u ? p.inf_mag : nan ? p.nan_mag : mag;
  return ((sign ^ (nan & p.nan_flip)) << (E + M)) | mag;
}

/* Index of the highest set bit of x (x > 0). */
HVD_HD hvd_i32 hvd_msb(hvd_u32 x) {
#ifdef __CUDACC__
  return 31 - __clz(x);
#else
  return 31 - __builtin_clz(x);
#endif
}

#define HVD_F32_MIN_EXP (-126)      /* smallest normal exponent */
#define HVD_F32_SUBNORMAL_EXP (-149) /* weight of the last bit of a subnormal */

/* float32 bits of significand * 2^k (significand < 2^24), rounded to nearest even where the
 * value falls below float32's normal range, Inf above it. Integer-only: ldexpf flushed subnormal
 * results to zero in NVRTC builds, which made the GPU decode differ from the host's. */
HVD_HD hvd_u32 hvd_scaled_bits(hvd_u32 significand, hvd_i32 k) {
  if (significand == 0u) return 0u;
  const hvd_i32 p = hvd_msb(significand), e = p + k;
  if (e > 127) return 0x7F800000u;
  if (e >= HVD_F32_MIN_EXP) return ((hvd_u32)(e + 127) << 23) | ((significand << (23 - p)) & 0x7FFFFFu);
  const hvd_i32 t = k - HVD_F32_SUBNORMAL_EXP; /* the value in units of the smallest subnormal: s * 2^t */
  if (t >= 0) return significand << t;
  const hvd_i32 r = -t;
  if (r > 24) return 0u; /* below half the smallest subnormal */
  const hvd_u32 q = significand >> r, rest = significand & ((1u << r) - 1u), half = 1u << (r - 1);
  return q + (rest > half || (rest == half && (q & 1u))); /* may carry into the smallest normal */
}

/* float32 value of code * 2^-shift (one rounding, only where the result leaves float32's range). */
HVD_HD float hvd_decode_one(hvd_u32 code, hvd_fmt_t f, hvd_i32 shift) {
  const hvd_i32 E = f.exp_bits, M = f.man_bits;
  const hvd_u32 sign = (code >> (E + M)) & 1u, mag = code & hvd_all_ones(f);
  const hvd_u32 ef = mag >> M, man = mag & ((1u << M) - 1u);
  const hvd_u32 sbit = sign << 31;
  if (f.policy == HVD_IEEE && ef == (1u << E) - 1u)
    return hvd_bits_f32(sbit | (man ? 0x7FC00000u : 0x7F800000u));
  if (f.policy == HVD_FN_NAN && mag == hvd_all_ones(f)) return hvd_bits_f32(sbit | 0x7FC00000u);
  const hvd_i32 bias = (1 << (E - 1)) - 1;
  const hvd_i32 significand = (hvd_i32)(ef ? (man | (1u << M)) : man);
  const hvd_i32 k = (hvd_i32)(ef ? ef : 1u) - bias - M - shift;
  return hvd_bits_f32(sbit | hvd_scaled_bits((hvd_u32)significand, k));
}

/*
 * Sub-byte packing: n codes of `bits` bits as one little-endian bit stream (code i occupies bits
 * i*bits .. i*bits+bits-1). Each output byte, and each unpacked code, depends only on its own
 * index, so one thread per byte (or code) packs (unpacks) in a single pass.
 */
/* The part of code i that lands in byte j of the stream. */
HVD_HD hvd_u32 hvd_pack_piece(hvd_u32 code, hvd_i64 i, hvd_i32 bits, hvd_i64 j) {
  const hvd_i64 offset = i * bits - 8 * j;
  return (offset >= 0 ? code << offset : code >> -offset) & 0xFFu;
}

/* Codes that overlap byte j: first..last (inclusive), clipped to n codes. */
HVD_HD hvd_i64 hvd_pack_first(hvd_i64 j, hvd_i32 bits) { return 8 * j / bits; }
HVD_HD hvd_i64 hvd_pack_last(hvd_i64 j, hvd_i32 bits, hvd_i64 n) {
  const hvd_i64 last = (8 * j + 7) / bits;
  return last < n - 1 ? last : n - 1;
}

/* Byte j of a stream with code i's part of it replaced by `code`'s, the other codes' bits kept. */
HVD_HD hvd_u32 hvd_place_piece(hvd_u32 byte, hvd_u32 code, hvd_i64 i, hvd_i32 bits, hvd_i64 j) {
  return (byte & ~hvd_pack_piece((1u << bits) - 1u, i, bits, j)) | hvd_pack_piece(code, i, bits, j);
}

/* Code i written into the stream, the bits of every other code in the bytes it touches kept. */
HVD_HD void hvd_put_code(unsigned char *packed, hvd_i64 i, hvd_i32 bits, hvd_u32 code) {
  for (hvd_i64 j = i * bits / 8; j <= (i * bits + bits - 1) / 8; ++j)
    packed[j] = (unsigned char)hvd_place_piece(packed[j], code, i, bits, j);
}

/* Code i read back from the stream. */
HVD_HD hvd_u32 hvd_unpack_code(const unsigned char *packed, hvd_i64 i, hvd_i32 bits) {
  const hvd_i64 start = i * bits;
  hvd_u32 v = 0u;
  for (hvd_i64 k = start / 8; k <= (start + bits - 1) / 8; ++k) {
    const hvd_i64 offset = 8 * k - start;
    v |= offset >= 0 ? (hvd_u32)packed[k] << offset : (hvd_u32)packed[k] >> -offset;
  }
  return v & ((1u << bits) - 1u);
}

/*
 * Block tables (hvd_aps/_tables.py): the columns of a table's rows, one int64 each, and the sums
 * the stats' sample takes per block (samples, nonzero inputs, nonzero values sent, inputs beyond
 * the limit, (sent - input)^2, input^2). Both engines' table functions read them.
 */
#define HVD_SRC 0
#define HVD_COUNT 1
#define HVD_BASE 2
#define HVD_POS 3
#define HVD_INDEX 4
#define HVD_COLUMNS 5
#define HVD_STATS 6

#endif /* HVD_APS_FPCODEC_H_ */
