/*
 * GPU engine: one kernel per table function of codec's engine contract (hvd_table_*, below),
 * over the per-element functions of fpcodec.h, compiled by CuPy (NVRTC, hvd_aps/_cupy_engine.py)
 * and, in the tests, by nvcc for sm_80 and sm_90. Each kernel makes one pass over memory.
 */
#include "fpcodec.h"

__device__ __forceinline__ hvd_fmt_t hvd_make_fmt(int exp_bits, int man_bits, int policy, int saturate) {
  hvd_fmt_t f;
  f.exp_bits = exp_bits;
  f.man_bits = man_bits;
  f.policy = policy;
  f.saturate = saturate;
  return f;
}

/* value / divisor in float32; divisor 1 divides nothing (the device's division would
 * canonicalise a NaN the host keeps). */
__device__ __forceinline__ float hvd_divided(float value, float divisor) {
  return divisor == 1.0f ? value : value / divisor;
}

/* The value table of a format of <= 8 bits, divided by `divisor`, built by each block in shared
 * memory. */
__device__ __forceinline__ void hvd_fill_table(float *table, int count, hvd_fmt_t f, int shift, float divisor) {
  for (int c = threadIdx.x; c < count; c += blockDim.x)
    table[c] = hvd_divided(hvd_decode_one((unsigned int)c, f, shift), divisor);
  __syncthreads();
}

/* *result = max(*result, m over the block's threads): a warp reduction, then one atomic per block. */
__device__ __forceinline__ void hvd_block_max(unsigned int m, unsigned int *result) {
  __shared__ unsigned int partial[32];
  for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_down_sync(0xFFFFFFFFu, m, offset));
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_down_sync(0xFFFFFFFFu, m, offset));
    if (threadIdx.x == 0) atomicMax(result, m);
  }
}

/* The value of code c, from the block's table for formats of <= 8 bits. */
__device__ __forceinline__ float hvd_value(const float *table, int small, unsigned int c, hvd_fmt_t f, int shift) {
  return small ? table[c] : hvd_decode_one(c, f, shift);
}

/*
 * Block tables (host.c's hvd_table_*, hvd_aps/_tables.py): one launch per stage of a bucket,
 * one thread block per table row. Row b (HVD_COLUMNS long longs): SRC, its first element in the
 * float32 array; COUNT; BASE, the byte its packed stream starts at; POS, its first code's place
 * in that stream; INDEX, stochastic rounding's hash index of its first element. Per row: its
 * exponent shifts[b] (and seed seeds[b]).
 */

/* peaks[b] = max(itself, the bits of max |x| over row b's elements); peaks start at 0. */
extern "C" __global__ void hvd_table_amax(const float *x, const long long *table, unsigned int *peaks) {
  const long long *row = table + (long long)blockIdx.x * HVD_COLUMNS;
  const float *xb = x + row[HVD_SRC];
  unsigned int m = 0u;
  for (long long i = threadIdx.x; i < row[HVD_COUNT]; i += blockDim.x) m = max(m, hvd_f32_bits(xb[i]) & 0x7FFFFFFFu);
  hvd_block_max(m, peaks + blockIdx.x);
}

/* The aligned 32-bit word a byte lies in: the unit of the device's atomics. */
__device__ __forceinline__ size_t hvd_word_of(const unsigned char *at) {
  return reinterpret_cast<size_t>(at) & ~(size_t)3;
}

/* Byte `at` of a row's stream, `first` and `last` the row's first and last bytes: `mask` the bits
 * this row's codes own, `byte` their values. A word another row can touch holds the first or the
 * last byte of each row touching it, so the row's first and last words are written only through
 * atomics on the aligned word, each row replacing its own bits (the rest of the word unchanged);
 * a word between them is the row's alone and stored plainly. A stream's array is therefore
 * reached in whole aligned words at its ends. */
__device__ __forceinline__ void hvd_store_bits(unsigned char *at, const unsigned char *first, const unsigned char *last,
                                               unsigned int mask, unsigned int byte) {
  const size_t word = hvd_word_of(at);
  if (mask == 0xFFu && word != hvd_word_of(first) && word != hvd_word_of(last)) {
    *at = (unsigned char)byte;
    return;
  }
  const unsigned int shift = 8u * (unsigned int)(reinterpret_cast<size_t>(at) - word);
  atomicAnd(reinterpret_cast<unsigned int *>(word), ~(mask << shift));
  atomicOr(reinterpret_cast<unsigned int *>(word), (byte & mask) << shift);
}

/* Every row's codes at its exponent into its stream, one thread per byte of it (a code that
 * straddles two bytes is encoded by both threads alike); with `res`, what each code lost (x
 * minus its value) into res at SRC, written by the thread holding the code's first bit. */
extern "C" __global__ void hvd_table_encode(const float *x, const long long *table, unsigned char *message, int e,
                                            int m, int policy, int saturate, const int *shifts, int stochastic,
                                            const unsigned long long *seeds, float *res) {
  const long long *row = table + (long long)blockIdx.x * HVD_COLUMNS;
  const hvd_fmt_t f = hvd_make_fmt(e, m, policy, saturate);
  const hvd_encoder_t p = hvd_encoder(f);
  const int bits = 1 + e + m, shift = shifts[blockIdx.x];
  const long long pos = row[HVD_POS], n = row[HVD_COUNT];
  const float *xb = x + row[HVD_SRC];
  unsigned char *stream = message + row[HVD_BASE];
  const unsigned long long seed = stochastic ? seeds[blockIdx.x] : 0ull;
  const long long begin = pos * bits / 8, end = ((pos + n) * bits + 7) / 8;
  for (long long j = begin + threadIdx.x; j < end; j += blockDim.x) {
    unsigned int byte = 0u, mask = 0u;
    const long long first = max(hvd_pack_first(j, bits), pos), last = hvd_pack_last(j, bits, pos + n);
    for (long long i = first; i <= last; ++i) {
      const unsigned int r = stochastic ? hvd_random32(seed, (unsigned long long)(row[HVD_INDEX] + i - pos)) : 0u;
      const unsigned int code = hvd_encode_one(xb[i - pos], p, shift, stochastic, r);
      byte |= hvd_pack_piece(code, i, bits, j);
      mask |= hvd_pack_piece((1u << bits) - 1u, i, bits, j);
      if (res && i * bits / 8 == j) res[row[HVD_SRC] + i - pos] = xb[i - pos] - hvd_decode_one(code, f, shift);
    }
    hvd_store_bits(stream + j, stream + begin, stream + end - 1, mask, byte);
  }
}

/* out[SRC + i] = the sum over `ranks` packed rows (`stride` bytes apart, the row's stream at
 * BASE of each) of its code POS + i decoded at shifts[b], in rank order from +0.0; peaks[b] the
 * bits of the row's max |sum| (peaks start at 0). */
extern "C" __global__ void hvd_table_sum(const unsigned char *rows, long long stride, int ranks,
                                         const long long *table, float *out, int e, int m, int policy,
                                         const int *shifts, unsigned int *peaks) {
  __shared__ float values[256];
  const long long *row = table + (long long)blockIdx.x * HVD_COLUMNS;
  const hvd_fmt_t f = hvd_make_fmt(e, m, policy, 0);
  const int bits = 1 + e + m, small = bits <= 8, shift = shifts[blockIdx.x];
  if (small) hvd_fill_table(values, 1 << bits, f, shift, 1.0f);
  unsigned int top = 0u;
  for (long long i = threadIdx.x; i < row[HVD_COUNT]; i += blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < ranks; ++r)
      acc += hvd_value(values, small, hvd_unpack_code(rows + r * stride + row[HVD_BASE], row[HVD_POS] + i, bits), f,
                       shift);
    out[row[HVD_SRC] + i] = acc;
    top = max(top, hvd_f32_bits(acc) & 0x7FFFFFFFu);
  }
  hvd_block_max(top, peaks + blockIdx.x);
}

/* out[SRC + i] = code POS + i of the row's stream (at BASE) decoded at shifts[b], divided by
 * `divisor` in float32 (the average's N). */
extern "C" __global__ void hvd_table_decode(const unsigned char *message, const long long *table, float *out, int e,
                                            int m, int policy, const int *shifts, float divisor) {
  const long long *row = table + (long long)blockIdx.x * HVD_COLUMNS;
  const hvd_fmt_t f = hvd_make_fmt(e, m, policy, 0);
  const int bits = 1 + e + m, shift = shifts[blockIdx.x];
  const unsigned char *stream = message + row[HVD_BASE];
  for (long long i = threadIdx.x; i < row[HVD_COUNT]; i += blockDim.x)
    out[row[HVD_SRC] + i] = hvd_divided(hvd_decode_one(hvd_unpack_code(stream, row[HVD_POS] + i, bits), f, shift),
                                        divisor);
}


/* host.c's hvd_table_stats: row b's sample (elements first[b], + step[b], ...) against the values
 * its codes carry, summed per row into sums[HVD_STATS * b ...] (doubles; a tree's order). The
 * products are __dmul_rn: never fused into the adds, so every device and the CPU agree bit for bit. */
extern "C" __global__ void hvd_table_stats(const float *x, const unsigned char *message, const long long *table,
                                           const long long *first, const long long *step, int e, int m, int policy,
                                           const int *shifts, const float *limits, double *sums) {
  __shared__ double partial[HVD_STATS][256];
  const long long *row = table + (long long)blockIdx.x * HVD_COLUMNS;
  const hvd_fmt_t f = hvd_make_fmt(e, m, policy, 0);
  const int bits = 1 + e + m, shift = shifts[blockIdx.x];
  const float limit = limits[blockIdx.x];
  const unsigned char *stream = message + row[HVD_BASE];
  double s[HVD_STATS] = {0, 0, 0, 0, 0, 0};
  for (long long i = first[blockIdx.x] + threadIdx.x * step[blockIdx.x]; i < row[HVD_COUNT];
       i += (long long)blockDim.x * step[blockIdx.x]) {
    const float v = x[row[HVD_SRC] + i];
    const float sent = hvd_decode_one(hvd_unpack_code(stream, row[HVD_POS] + i, bits), f, shift);
    const double d = (double)sent - (double)v;
    s[0] += 1.0, s[1] += v != 0.0f, s[2] += sent != 0.0f, s[3] += v > limit || v < -limit;
    s[4] += __dmul_rn(d, d), s[5] += __dmul_rn((double)v, (double)v);
  }
  for (int k = 0; k < HVD_STATS; ++k) partial[k][threadIdx.x] = s[k];
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width >>= 1) {
    if ((int)threadIdx.x < width)
      for (int k = 0; k < HVD_STATS; ++k) partial[k][threadIdx.x] += partial[k][threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x < HVD_STATS) sums[HVD_STATS * (long long)blockIdx.x + threadIdx.x] = partial[threadIdx.x][0];
}

/* scaling.shifts_under per block: the largest s with peak * 2^s <= limit (0 for a peak of 0 or not
 * finite), in float64 as NumPy computes it, written as an int and as the block's little-endian
 * int16 exponent where the message carries it: the re-encode's exponents never leave the device. */
extern "C" __global__ void hvd_table_shifts(const float *peaks, long long n, double limit, int *shifts,
                                          unsigned char *exponents) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const double peak = peaks[i];
    int s = 0;
    if (isfinite(peak) && peak > 0) {
      int e;
      frexp(limit / peak, &e);
      s = e - 1; /* floor(log2(limit / peak)): exact unless the quotient is a subnormal double (a limit */
      s += ldexp(peak, s + 1) <= limit; /* under 2^-1022 x peak), whose rounding these two steps undo */
      s -= ldexp(peak, s) > limit;
    }
    shifts[i] = s;
    exponents[2 * i] = (unsigned char)(s & 0xFF);
    exponents[2 * i + 1] = (unsigned char)((s >> 8) & 0xFF);
  }
}
