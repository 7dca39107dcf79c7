/*
 * CPU engine: plain loops over the shared per-element functions of fpcodec.h. Loaded with
 * ctypes; Python splits large arrays into chunks and calls these from a thread pool (ctypes
 * drops the GIL), so this file stays free of threading code. `offset` is the chunk's first flat
 * index, which keeps stochastic rounding independent of the chunking.
 */
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fpcodec.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One build runs everywhere; machines with AVX2 get the vectorised clone of the encode loops. */
#define HVD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVD_CLONES
#endif

#define ENCODE_LOOP(T, STOCHASTIC)                                                           \
  for (int64_t i = 0; i < n; ++i) {                                                          \
    const hvd_u32 r = STOCHASTIC ? hvd_random32(seed, (hvd_u64)(offset + i)) : 0u;           \
    ((T *)out)[i] = (T)hvd_encode_one(x[i], enc, shift, STOCHASTIC, r);                        \
  }

HVD_CLONES void hvd_encode(const float *x, void *out, int64_t n, int64_t offset, hvd_fmt_t f,
                           int32_t shift, int32_t stochastic, uint64_t seed) {
  const int wide = f.exp_bits + f.man_bits >= 8;
  const hvd_encoder_t enc = hvd_encoder(f);
  if (stochastic) {
    if (wide) ENCODE_LOOP(uint16_t, 1) else ENCODE_LOOP(uint8_t, 1)
  } else {
    if (wide) ENCODE_LOOP(uint16_t, 0) else ENCODE_LOOP(uint8_t, 0)
  }
}

/* Table of every code's value; decoding is then a gather, whatever the format. */
void hvd_decode_table(float *table, hvd_fmt_t f, int32_t shift) {
  const hvd_u32 count = 1u << (1 + f.exp_bits + f.man_bits);
  for (hvd_u32 c = 0; c < count; ++c) table[c] = hvd_decode_one(c, f, shift);
}

/* out[i] = table[codes[i]], for 1- or 2-byte codes and 4-byte (float32) or 2-byte (float16) values */
#define GATHER(NAME, CODE, VALUE)                                                             \
  HVD_CLONES void NAME(const CODE *codes, VALUE *out, int64_t n, const VALUE *table) {        \
    for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]];                                \
  }
GATHER(hvd_gather_u8_f32, uint8_t, float)
GATHER(hvd_gather_u16_f32, uint16_t, float)
GATHER(hvd_gather_u8_f16, uint8_t, uint16_t)
GATHER(hvd_gather_u16_f16, uint16_t, uint16_t)

/* acc[i] += table[codes[i]]: one rank's buffer into the float32 sum (codes-on-the-wire path) */
#define ACCUMULATE(NAME, CODE)                                                                \
  HVD_CLONES void NAME(const CODE *codes, float *acc, int64_t n, const float *table) {        \
    for (int64_t i = 0; i < n; ++i) acc[i] += table[codes[i]];                                \
  }
ACCUMULATE(hvd_accumulate_u8, uint8_t)
ACCUMULATE(hvd_accumulate_u16, uint16_t)

/*
 * One shard piece of the codes exchange straight from the received bytes: element lo + i of each
 * of `ranks` rows (a row every `stride` bytes; `bits` 4: two codes a byte, low nibble first; 8:
 * one; 16: two bytes, little-endian), looked up in `table`. hvd_sum_rows adds the ranks in order
 * from 0.0f into out[i] (what decode-then-add would give, in one pass instead of one per rank
 * and without unpacking) and returns max |out|, +Inf where a sum is NaN/Inf (the re-encode's
 * APS shift needs it); hvd_decode_row decodes one row (signed zeros kept). With more than four
 * ranks, blocks of SUM_BLOCK elements keep the partial sums in cache while the ranks' codes are
 * added.
 */
#define SUM_BLOCK 1024
/* Code j of a row; BITS 0: a width other than 4, 8 and 16, read bit by bit (`bits` at run time). */
#define ROW_CODE(row, j, BITS)                                                                \
  (BITS == 4 ? ((row)[(j) >> 1] >> (((j) & 1) * 4)) & 15u                                     \
   : BITS == 8 ? (row)[j]                                                                     \
   : BITS == 16 ? (hvd_u32)(row)[2 * (j)] | ((hvd_u32)(row)[2 * (j) + 1] << 8)                \
   : hvd_unpack_code(row, j, bits))

/* Up to four ranks (R, a constant where it is expanded) in one pass: each sum kept in a register
 * from 0.0f, the ranks added in order, max |sum| taken as it is stored. */
#define SUM_FEW(BITS, R)                                                                      \
  for (int64_t j = lo; j < hi; ++j) {                                                         \
    float s = 0.0f + t[ROW_CODE(c0, j, BITS)];                                                \
    if (R > 1) s += t[ROW_CODE(c1, j, BITS)];                                                 \
    if (R > 2) s += t[ROW_CODE(c2, j, BITS)];                                                 \
    if (R > 3) s += t[ROW_CODE(c3, j, BITS)];                                                 \
    out[j - lo] = s;                                                                          \
    const hvd_u32 a = hvd_f32_bits(s) & 0x7FFFFFFFu;                                          \
    m = a > m ? a : m;                                                                        \
  }

/* More ranks are added four at a time (one load and store of the partial sums per four), in
 * order, a block at a time; the few-rank case in one pass (SUM_FEW): the same sums, the same bits. */
#define SUM_ROWS(NAME, BITS)                                                                  \
  static float NAME(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, int64_t lo,      \
                    int64_t hi, float *out, const float *t) {                                 \
    hvd_u32 m = 0u;                                                                           \
    if (ranks >= 1 && ranks <= 4) {                                                           \
      const uint8_t *c0 = rows, *c1 = ranks > 1 ? c0 + stride : c0, *c2 = ranks > 2 ? c1 + stride : c1; \
      const uint8_t *c3 = ranks > 3 ? c2 + stride : c2;                                       \
      switch (ranks) {                                                                        \
        case 1: SUM_FEW(BITS, 1) break;                                                       \
        case 2: SUM_FEW(BITS, 2) break;                                                       \
        case 3: SUM_FEW(BITS, 3) break;                                                       \
        default: SUM_FEW(BITS, 4) break;                                                      \
      }                                                                                       \
      return m >= 0x7F800000u ? INFINITY : hvd_bits_f32(m);                                   \
    }                                                                                         \
    for (int64_t b = lo; b < hi; b += SUM_BLOCK) {                                            \
      const int64_t n = (b + SUM_BLOCK < hi ? b + SUM_BLOCK : hi) - b;                        \
      float *o = out + (b - lo);                                                              \
      for (int64_t i = 0; i < n; ++i) o[i] = 0.0f;                                            \
      int32_t r = 0;                                                                          \
      for (; r + 4 <= ranks; r += 4) {                                                        \
        const uint8_t *c0 = rows + r * stride, *c1 = c0 + stride, *c2 = c1 + stride, *c3 = c2 + stride; \
        for (int64_t i = 0, j = b; i < n; ++i, ++j)                                           \
          o[i] = (((o[i] + t[ROW_CODE(c0, j, BITS)]) + t[ROW_CODE(c1, j, BITS)]) + t[ROW_CODE(c2, j, BITS)]) \
                 + t[ROW_CODE(c3, j, BITS)];                                                  \
      }                                                                                       \
      for (; r < ranks; ++r) {                                                                \
        const uint8_t *c = rows + r * stride;                                                 \
        for (int64_t i = 0, j = b; i < n; ++i, ++j) o[i] += t[ROW_CODE(c, j, BITS)];         \
      }                                                                                       \
      for (int64_t i = 0; i < n; ++i) {                                                       \
        const hvd_u32 a = hvd_f32_bits(o[i]) & 0x7FFFFFFFu;                                   \
        m = a > m ? a : m;                                                                    \
      }                                                                                       \
    }                                                                                         \
    return m >= 0x7F800000u ? INFINITY : hvd_bits_f32(m);                                     \
  }
HVD_CLONES SUM_ROWS(sum_rows4, 4)
HVD_CLONES SUM_ROWS(sum_rows8, 8)
HVD_CLONES SUM_ROWS(sum_rows16, 16)
SUM_ROWS(sum_rows_any, 0)

float hvd_sum_rows(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, int64_t lo, int64_t hi,
                   float *out, const float *table) {
  return (bits == 4 ? sum_rows4 : bits == 8 ? sum_rows8 : bits == 16 ? sum_rows16 : sum_rows_any)(
      rows, stride, ranks, bits, lo, hi, out, table);
}

/*
 * Results far larger than the caches (a bucket of tens of MB) leave them before the optimizer
 * reads them back, so writing them through the cache only costs a read of every line first:
 * `stream` writes with non-temporal stores instead: 1.85x the speed of plain stores for 64 MiB
 * of e4m3 decoded to float32 (examples/benchmark_codec.py); 4-bit rows gain nothing, their
 * nibble extraction rather than the stores bounds them.
 */
#if defined(__x86_64__)
#define STREAM_ROW(BITS)                                                                      \
  if (stream) {                                                                               \
    for (; j < hi && ((uintptr_t)(out + (j - lo)) & 15u); ++j) out[j - lo] = table[ROW_CODE(row, j, BITS)]; \
    for (; j + 4 <= hi; j += 4)                                                               \
      _mm_stream_ps(out + (j - lo), _mm_set_ps(table[ROW_CODE(row, j + 3, BITS)], table[ROW_CODE(row, j + 2, BITS)], \
                                               table[ROW_CODE(row, j + 1, BITS)], table[ROW_CODE(row, j, BITS)])); \
    _mm_sfence();                                                                             \
  }
#else
#define STREAM_ROW(BITS)
#endif

#define DECODE_ROW(NAME, BITS)                                                                \
  static void NAME(const uint8_t *row, int32_t bits, int64_t lo, int64_t hi, float *out, const float *table, \
                   int32_t stream) {                                                          \
    int64_t j = lo;                                                                           \
    STREAM_ROW(BITS)                                                                          \
    for (; j < hi; ++j) out[j - lo] = table[ROW_CODE(row, j, BITS)];                         \
  }
HVD_CLONES DECODE_ROW(decode_row4, 4)
HVD_CLONES DECODE_ROW(decode_row8, 8)
HVD_CLONES DECODE_ROW(decode_row16, 16)
DECODE_ROW(decode_row_any, 0)

void hvd_decode_row(const uint8_t *row, int32_t bits, int64_t lo, int64_t hi, float *out, const float *table,
                    int32_t stream) {
  (bits == 4 ? decode_row4 : bits == 8 ? decode_row8 : bits == 16 ? decode_row16 : decode_row_any)(row, bits, lo, hi, out,
                                                                                             table, stream);
}

#define PACK(NAME, CODE)                                                                      \
  void NAME(const CODE *codes, int64_t n, int32_t bits, uint8_t *out, int64_t lo, int64_t hi) { \
    for (int64_t j = lo; j < hi; ++j) {                                                        \
      hvd_u32 byte = 0u;                                                                       \
      for (int64_t i = hvd_pack_first(j, bits); i <= hvd_pack_last(j, bits, n); ++i)           \
        byte |= hvd_pack_piece(codes[i], i, bits, j);                                          \
      out[j] = (uint8_t)byte;                                                                  \
    }                                                                                          \
  }
PACK(hvd_pack_u8, uint8_t)
PACK(hvd_pack_u16, uint16_t)

/* The 4-bit case on its own: two codes a byte, in loops compilers vectorise. */
HVD_CLONES void hvd_pack_nibbles(const uint8_t *codes, int64_t n, uint8_t *out, int64_t lo, int64_t hi) {
  const int64_t full = hi < n / 2 ? hi : n / 2;
  for (int64_t j = lo; j < full; ++j) out[j] = (uint8_t)((codes[2 * j] & 15u) | (codes[2 * j + 1] << 4));
  if (full < hi) out[full] = codes[2 * full] & 15u; /* odd n: the last byte's high half is 0 */
}

/*
 * Encode and pack in one pass: the codes of x[0..n) (stochastic rounding's hash indices
 * offset + i, so a tensor encoded piece by piece gets the codes of one encode) written straight
 * into a packed stream at code positions pos .. pos + n. Bits of `row` outside those positions
 * keep their value: the neighbouring pieces' codes. 8-bit codes are the stream already; other
 * widths are encoded a block at a time into a buffer that stays in L1 and packed from there
 * (whole bytes: blocks start where a group of 8 codes does), the few codes before the first
 * group and after the last one code by code.
 */
#define ROW_BLOCK 2048 /* a multiple of 8 */

static void put_codes_one_by_one(const float *x, int64_t n, int64_t offset, uint8_t *row, int64_t pos, hvd_fmt_t f,
                                 int32_t shift, int32_t stochastic, uint64_t seed) {
  const int32_t bits = 1 + f.exp_bits + f.man_bits;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t code[1];
    hvd_encode(x + i, code, 1, offset + i, f, shift, stochastic, seed);
    hvd_put_code(row, pos + i, bits, bits > 8 ? code[0] : ((uint8_t *)code)[0]);
  }
}

void hvd_encode_row(const float *x, int64_t n, int64_t offset, uint8_t *row, int64_t pos, hvd_fmt_t f, int32_t shift,
                    int32_t stochastic, uint64_t seed) {
  const int32_t bits = 1 + f.exp_bits + f.man_bits;
  if (bits == 8) {
    hvd_encode(x, row + pos, n, offset, f, shift, stochastic, seed);
    return;
  }
  int64_t head = (8 - pos % 8) % 8;
  head = head < n ? head : n;
  put_codes_one_by_one(x, head, offset, row, pos, f, shift, stochastic, seed);
  uint16_t block[ROW_BLOCK]; /* uint8 codes use the first half of its bytes */
  int64_t i = head;
  while (n - i >= 8) {
    const int64_t m = (n - i < ROW_BLOCK ? n - i : ROW_BLOCK) & ~(int64_t)7, byte = (pos + i) / 8 * bits;
    hvd_encode(x + i, block, m, offset + i, f, shift, stochastic, seed);
    if (bits == 4) hvd_pack_nibbles((const uint8_t *)block, m, row + byte, 0, m / 2);
    else if (bits < 8) hvd_pack_u8((const uint8_t *)block, m, bits, row + byte, 0, m * bits / 8);
    else hvd_pack_u16(block, m, bits, row + byte, 0, m * bits / 8);
    i += m;
  }
  put_codes_one_by_one(x + i, n - i, offset + i, row, pos + i, f, shift, stochastic, seed);
}

HVD_CLONES void hvd_unpack_nibbles(const uint8_t *packed, uint8_t *out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) out[i] = (packed[i >> 1] >> ((i & 1) * 4)) & 15u;
}

void hvd_unpack_u8(const uint8_t *packed, int32_t bits, uint8_t *out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) out[i] = (uint8_t)hvd_unpack_code(packed, i, bits);
}

void hvd_unpack_u16(const uint8_t *packed, int32_t bits, uint16_t *out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) out[i] = (uint16_t)hvd_unpack_code(packed, i, bits);
}

/*
 * Blocked runs: the codes exchange gives every block of BLOCK codes of a tensor its own
 * re-encode exponent, so the numbers do not depend on how a bucket is cut into chunks or shards.
 * Block k of a run holds its codes k * block .. (k + 1) * block (the last block may be shorter);
 * `first` is the run index of x[0] (or of code `lo`), so threads may take any range of whole
 * blocks (sums) or of whole byte groups (encode, decode).
 */
void hvd_encode_row_blocks(const float *x, int64_t n, int64_t first, int64_t offset, uint8_t *row, int64_t pos,
                           hvd_fmt_t f, const int32_t *shifts, int64_t block, int32_t stochastic, uint64_t seed) {
  for (int64_t i = 0; i < n;) {
    const int64_t k = (first + i) / block, end = (k + 1) * block - first < n ? (k + 1) * block - first : n;
    hvd_encode_row(x + i, end - i, offset + i, row, pos + i, f, shifts[k], stochastic, seed);
    i = end;
  }
}

/* hvd_sum_rows over codes lo..hi, the max |sum| of block k into peaks[k]; run index of code lo: first. */
void hvd_sum_rows_blocks(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, int64_t lo, int64_t hi,
                         int64_t first, int64_t block, float *out, const float *table, float *peaks) {
  for (int64_t j = lo; j < hi;) {
    const int64_t k = (first + j - lo) / block, end = lo + (k + 1) * block - first < hi ? lo + (k + 1) * block - first : hi;
    peaks[k] = hvd_sum_rows(rows, stride, ranks, bits, j, end, out + (j - lo), table);
    j = end;
  }
}

/* hvd_decode_row over codes lo..hi, block k looked up in table `which[k]` of `tables` (one per
 * distinct re-encode exponent, 2^bits values each); run index of code lo: first. */
void hvd_decode_row_blocks(const uint8_t *row, int32_t bits, int64_t lo, int64_t hi, int64_t first, int64_t block,
                           float *out, const float *tables, const int32_t *which, int32_t stream) {
  for (int64_t j = lo; j < hi;) {
    const int64_t k = (first + j - lo) / block, end = lo + (k + 1) * block - first < hi ? lo + (k + 1) * block - first : hi;
    hvd_decode_row(row, bits, j, end, out + (j - lo), tables + ((int64_t)which[k] << bits), stream);
    j = end;
  }
}

/* max |x|, or +Inf when x holds a NaN or Inf: APS must see every non-finite value. */
HVD_CLONES float hvd_amax(const float *x, int64_t n) {
  hvd_u32 m = 0u;
  for (int64_t i = 0; i < n; ++i) {
    const hvd_u32 a = hvd_f32_bits(x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m >= 0x7F800000u ? INFINITY : hvd_bits_f32(m);
}

/* hvd_amax of every block of `block` elements of x into peaks. */
void hvd_amax_blocks(const float *x, int64_t n, int64_t block, float *peaks) {
  for (int64_t k = 0; k * block < n; ++k) peaks[k] = hvd_amax(x + k * block, n - k * block < block ? n - k * block : block);
}

/* Counters in memory shared between the processes of one host (hvd_aps._host_memory): a release
 * store after the data it publishes, an acquire load before the data it guards. */
void hvd_store_release(int64_t *counter, int64_t value) { __atomic_store_n(counter, value, __ATOMIC_RELEASE); }

int64_t hvd_load_acquire(const int64_t *counter) { return __atomic_load_n(counter, __ATOMIC_ACQUIRE); }

/*
 * Block tables: one engine call per stage of a bucket's exchange. Row b of `table` (HVD_COLUMNS
 * int64 each) is one block of at most a re-encode block's codes:
 *   SRC   its first element in the float32 array read or written (x, out, residual),
 *   COUNT its elements,
 *   BASE  the byte where its packed stream starts (a destination's part of a message),
 *   POS   the code position of its first element in that stream,
 *   INDEX stochastic rounding's hash index of its first element (its place in its tensor).
 * hvd_aps/_tables.py makes the tables once per bucket layout. A call covers blocks b0 .. b1, the
 * first from its element o0 on, the last up to (not including) its element o1: a thread's share,
 * cut where no byte of a packed stream is shared with another thread's share. Per block: its
 * exponent (shifts[b]), its seed (seeds[b]) and its decode table (tables + (which[b] << bits)).
 */

/* Elements [*lo, *hi) of block b within the share (b0, o0) .. (b1, o1). */
static inline void share_of(const int64_t *row, int64_t b, int64_t b0, int64_t o0, int64_t b1, int64_t o1, int64_t *lo,
                            int64_t *hi) {
  *lo = b == b0 ? o0 : 0;
  *hi = b == b1 ? o1 : row[HVD_COUNT];
}

/* peaks[b] = max |x| over block b (whole blocks b0 .. b1 - 1), +Inf where it holds a NaN or Inf. */
void hvd_table_amax(const float *x, const int64_t *table, int64_t b0, int64_t b1, float *peaks) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    peaks[b] = hvd_amax(x + row[HVD_SRC], row[HVD_COUNT]);
  }
}

/* Code j of a packed stream of `bits`-bit codes. */
static inline hvd_u32 stream_code(const uint8_t *stream, int64_t j, int32_t bits) {
  return bits == 8 ? stream[j] : bits == 4 ? (stream[j >> 1] >> ((j & 1) * 4)) & 15u : hvd_unpack_code(stream, j, bits);
}

/* Every block's elements encoded at its exponent into its stream (hvd_encode_row); with `res`,
 * what the codes lost (x minus their value, table `which[b]`) into res at the same offsets. */
void hvd_table_encode(const float *x, const int64_t *table, int64_t b0, int64_t o0, int64_t b1, int64_t o1,
                      uint8_t *message, hvd_fmt_t f, const int32_t *shifts, int32_t stochastic, const uint64_t *seeds,
                      float *res, const float *tables, const int32_t *which) {
  const int32_t bits = 1 + f.exp_bits + f.man_bits;
  for (int64_t b = b0; b <= b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    int64_t lo, hi;
    if (b == b1 && o1 == 0) break;
    share_of(row, b, b0, o0, b1, o1, &lo, &hi);
    if (lo >= hi) continue;
    const float *xb = x + row[HVD_SRC];
    uint8_t *stream = message + row[HVD_BASE];
    hvd_encode_row(xb + lo, hi - lo, row[HVD_INDEX] + lo, stream, row[HVD_POS] + lo, f, shifts[b], stochastic,
                   stochastic ? seeds[b] : 0u);
    if (res) {
      const float *t = tables + ((int64_t)which[b] << bits);
      float *rb = res + row[HVD_SRC];
      for (int64_t i = lo; i < hi; ++i) rb[i] = xb[i] - t[stream_code(stream, row[HVD_POS] + i, bits)];
    }
  }
}

/* The ranks' codes of every block (whole blocks b0 .. b1 - 1) summed in rank order into out at
 * SRC (hvd_sum_rows: rows `stride` bytes apart, each block's stream at BASE of every row), its
 * max |sum| into peaks[b]. */
void hvd_table_sum(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, const int64_t *table, int64_t b0,
                   int64_t b1, float *out, const float *tables, const int32_t *which, float *peaks) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    peaks[b] = hvd_sum_rows(rows + row[HVD_BASE], stride, ranks, bits, row[HVD_POS], row[HVD_POS] + row[HVD_COUNT],
                            out + row[HVD_SRC], tables + ((int64_t)which[b] << bits));
  }
}

/* Every block's codes (its stream at BASE, from POS) decoded through table `which[b]` into out at SRC. */
void hvd_table_decode(const uint8_t *message, int32_t bits, const int64_t *table, int64_t b0, int64_t b1, float *out,
                      const float *tables, const int32_t *which, int32_t stream) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    hvd_decode_row(message + row[HVD_BASE], bits, row[HVD_POS], row[HVD_POS] + row[HVD_COUNT], out + row[HVD_SRC],
                   tables + ((int64_t)which[b] << bits), stream);
  }
}

/*
 * The stats' sample of every block (whole blocks b0 .. b1 - 1): elements first[b], first[b] +
 * step[b], ... of the block, against the value their codes (BASE, POS) carry (table which[b])
 * and the largest magnitude the format takes at the block's exponent (limits[b]). Into
 * sums[HVD_STATS * b ...]: samples, nonzero inputs, nonzero values sent, inputs beyond the
 * limit, sum of (sent - input)^2 and of input^2 (doubles, as the Python stats take them).
 */

/* One block's sample sums, for codes of BITS bits (0: `bits` at run time, read bit by bit). */
#define STATS_BLOCK(NAME, BITS)                                                               \
  static void NAME(const float *xb, const uint8_t *stream, int32_t bits, int64_t pos, int64_t n, int64_t first, \
                   int64_t step, const float *t, float limit, double *s) {                   \
    int64_t count = 0, nonzero = 0, sent_nonzero = 0, saturated = 0;                          \
    double error = 0, norm = 0;                                                               \
    for (int64_t i = first; i < n; i += step) {                                               \
      const float v = xb[i], sent = t[ROW_CODE(stream, pos + i, BITS)];                       \
      const double d = (double)sent - (double)v;                                              \
      count += 1;                                                                             \
      nonzero += v != 0.0f;                                                                   \
      sent_nonzero += sent != 0.0f;                                                           \
      saturated += v > limit || v < -limit;                                                   \
      error += d * d;                                                                         \
      norm += (double)v * (double)v;                                                          \
    }                                                                                         \
    s[0] = (double)count, s[1] = (double)nonzero, s[2] = (double)sent_nonzero, s[3] = (double)saturated; \
    s[4] = error, s[5] = norm;                                                                \
  }
HVD_CLONES STATS_BLOCK(stats_block4, 4)
HVD_CLONES STATS_BLOCK(stats_block8, 8)
HVD_CLONES STATS_BLOCK(stats_block16, 16)
STATS_BLOCK(stats_block_any, 0)

void hvd_table_stats(const float *x, const uint8_t *message, int32_t bits, const int64_t *table, int64_t b0, int64_t b1,
                     const int64_t *first, const int64_t *step, const float *tables, const int32_t *which,
                     const float *limits, double *sums) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    (bits == 4 ? stats_block4 : bits == 8 ? stats_block8 : bits == 16 ? stats_block16 : stats_block_any)(
        x + row[HVD_SRC], message + row[HVD_BASE], bits, row[HVD_POS], row[HVD_COUNT], first[b], step[b],
        tables + ((int64_t)which[b] << bits), limits[b], sums + HVD_STATS * b);
  }
}
