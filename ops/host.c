/*
 * CPU engine: plain loops over the shared per-element functions of fpcodec.h. Loaded with
 * ctypes, which calls the block-table functions (hvd_table_*, at the end) and the decode table;
 * Python cuts a table into threads' shares and calls these from a thread pool (ctypes drops the
 * GIL), so this file stays free of threading code. `offset` is the first element's stochastic
 * hash index, which keeps stochastic rounding independent of how the elements are cut.
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

/* A stream's 16-bit codes (low byte first) are the host's own uint16 where it is little-endian. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HVD_LITTLE_ENDIAN 1
#else
#define HVD_LITTLE_ENDIAN 0
#endif

#define ENCODE_LOOP(T, STOCHASTIC)                                                           \
  for (int64_t i = 0; i < n; ++i) {                                                          \
    const hvd_u32 r = STOCHASTIC ? hvd_random32(seed, (hvd_u64)(offset + i)) : 0u;           \
    ((T *)out)[i] = (T)hvd_encode_one(x[i], enc, shift, STOCHASTIC, r);                        \
  }

HVD_CLONES static void encode_codes(const float *x, void *out, int64_t n, int64_t offset, hvd_fmt_t f,
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

/*
 * One block of the codes exchange straight from the received bytes: element lo + i of each of
 * `ranks` rows (a row every `stride` bytes; `bits` 4: two codes a byte, low nibble first; 8:
 * one; 16: two bytes, little-endian), looked up in `table`. sum_rows adds the ranks in order
 * from 0.0f into out[i] (what decode-then-add would give, in one pass instead of one per rank
 * and without unpacking) and returns max |out|, +Inf where a sum is NaN/Inf (the re-encode's
 * APS shift needs it); decode_row decodes one row (signed zeros kept). With more than four
 * ranks, blocks of SUM_BLOCK elements keep the partial sums in cache while the ranks' codes are
 * added.
 */
#define SUM_BLOCK 1024

/* Code j of a stream of 16-bit codes: one 2-byte load where the host is little-endian. */
static inline hvd_u32 code16(const uint8_t *row, int64_t j) {
  if (HVD_LITTLE_ENDIAN) {
    uint16_t code;
    memcpy(&code, row + 2 * j, sizeof code);
    return code;
  }
  return (hvd_u32)row[2 * j] | ((hvd_u32)row[2 * j + 1] << 8);
}

/* Code j of a row; BITS 0: a width other than 4, 8 and 16, read bit by bit (`bits` at run time). */
#define ROW_CODE(row, j, BITS)                                                                \
  (BITS == 4 ? ((row)[(j) >> 1] >> (((j) & 1) * 4)) & 15u                                     \
   : BITS == 8 ? (row)[j]                                                                     \
   : BITS == 16 ? code16(row, j)                                                              \
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

static float sum_rows(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, int64_t lo, int64_t hi,
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

static void decode_row(const uint8_t *row, int32_t bits, int64_t lo, int64_t hi, float *out, const float *table,
                       int32_t stream) {
  (bits == 4 ? decode_row4 : bits == 8 ? decode_row8 : bits == 16 ? decode_row16 : decode_row_any)(row, bits, lo, hi, out,
                                                                                             table, stream);
}

/*
 * m codes (a multiple of 8) packed into m * bits / 8 bytes, in loops compilers vectorise: 4-bit
 * codes two a byte, the other widths below 8 a group of 8 codes (`bits` bytes) at a time through
 * a 64-bit word, 16-bit codes two bytes each, low byte first (whatever the host's byte order);
 * the rare widths of 9 to 15 bits byte by byte, from the codes each byte overlaps.
 */
static void pack_bytewise(const uint16_t *codes, int64_t m, int32_t bits, uint8_t *out) {
  for (int64_t j = 0; j < m * bits / 8; ++j) {
    hvd_u32 byte = 0u;
    for (int64_t i = hvd_pack_first(j, bits); i <= hvd_pack_last(j, bits, m); ++i)
      byte |= hvd_pack_piece(codes[i], i, bits, j);
    out[j] = (uint8_t)byte;
  }
}

HVD_CLONES static void pack_nibbles(const uint8_t *codes, int64_t m, uint8_t *out) {
  for (int64_t j = 0; j < m / 2; ++j) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
}

HVD_CLONES static void pack_groups(const uint8_t *codes, int64_t m, int32_t bits, uint8_t *out) {
  for (int64_t g = 0; g < m / 8; ++g) {
    uint64_t word = 0u;
    for (int32_t k = 0; k < 8; ++k) word |= (uint64_t)codes[8 * g + k] << (k * bits);
    for (int32_t b = 0; b < bits; ++b) out[g * bits + b] = (uint8_t)(word >> (8 * b));
  }
}

HVD_CLONES static void pack_pairs(const uint16_t *codes, int64_t m, uint8_t *out) {
  for (int64_t i = 0; i < m; ++i) {
    out[2 * i] = (uint8_t)codes[i];
    out[2 * i + 1] = (uint8_t)(codes[i] >> 8);
  }
}

/*
 * Encode and pack in one pass: the codes of x[0..n) (stochastic rounding's hash indices
 * offset + i, so a tensor encoded piece by piece gets the codes of one encode) written straight
 * into a packed stream at code positions pos .. pos + n. Bits of `row` outside those positions
 * keep their value: the neighbouring pieces' codes. 8-bit codes are the stream already, and so
 * are 16-bit ones where the host is little-endian and they lie aligned; other widths are encoded
 * a block at a time into a buffer that stays in L1 and packed from there (whole bytes: blocks
 * start where a group of 8 codes does), the few codes before the first group and after the last
 * one code by code.
 */
#define ROW_BLOCK 2048 /* a multiple of 8 */

static void put_codes_one_by_one(const float *x, int64_t n, int64_t offset, uint8_t *row, int64_t pos, hvd_fmt_t f,
                                 int32_t shift, int32_t stochastic, uint64_t seed) {
  const int32_t bits = 1 + f.exp_bits + f.man_bits;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t code[1];
    encode_codes(x + i, code, 1, offset + i, f, shift, stochastic, seed);
    hvd_put_code(row, pos + i, bits, bits > 8 ? code[0] : ((uint8_t *)code)[0]);
  }
}

static void encode_row(const float *x, int64_t n, int64_t offset, uint8_t *row, int64_t pos, hvd_fmt_t f,
                       int32_t shift, int32_t stochastic, uint64_t seed) {
  const int32_t bits = 1 + f.exp_bits + f.man_bits;
  if (bits == 8 || (bits == 16 && HVD_LITTLE_ENDIAN && ((uintptr_t)(row + 2 * pos) & 1u) == 0)) {
    encode_codes(x, row + pos * bits / 8, n, offset, f, shift, stochastic, seed);
    return;
  }
  int64_t head = (8 - pos % 8) % 8;
  head = head < n ? head : n;
  put_codes_one_by_one(x, head, offset, row, pos, f, shift, stochastic, seed);
  uint16_t block[ROW_BLOCK]; /* uint8 codes use the first half of its bytes */
  int64_t i = head;
  while (n - i >= 8) {
    const int64_t m = (n - i < ROW_BLOCK ? n - i : ROW_BLOCK) & ~(int64_t)7, byte = (pos + i) / 8 * bits;
    encode_codes(x + i, block, m, offset + i, f, shift, stochastic, seed);
    if (bits == 4) pack_nibbles((const uint8_t *)block, m, row + byte);
    else if (bits < 8) pack_groups((const uint8_t *)block, m, bits, row + byte);
    else if (bits == 16) pack_pairs(block, m, row + byte);
    else pack_bytewise(block, m, bits, row + byte);
    i += m;
  }
  put_codes_one_by_one(x + i, n - i, offset + i, row, pos + i, f, shift, stochastic, seed);
}

/* max |x|, or +Inf when x holds a NaN or Inf: APS must see every non-finite value. */
HVD_CLONES static float amax(const float *x, int64_t n) {
  hvd_u32 m = 0u;
  for (int64_t i = 0; i < n; ++i) {
    const hvd_u32 a = hvd_f32_bits(x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m >= 0x7F800000u ? INFINITY : hvd_bits_f32(m);
}

/* Counters in memory shared between the processes of one host (hvd_aps._host_memory): a release
 * store after the data it publishes, an acquire load before the data it guards. */
void hvd_store_release(int64_t *counter, int64_t value) { __atomic_store_n(counter, value, __ATOMIC_RELEASE); }

int64_t hvd_load_acquire(const int64_t *counter) { return __atomic_load_n(counter, __ATOMIC_ACQUIRE); }

/*
 * Block tables: one engine call per stage of a bucket's exchange, or per codec function on a
 * run. Row b of `table` (HVD_COLUMNS int64 each) is one block of codes (a re-encode block, or a
 * row of a run's table):
 *   SRC   its first element in the float32 array read or written (x, out, residual),
 *   COUNT its elements,
 *   BASE  the byte where its packed stream starts (a destination's part of a message),
 *   POS   the code position of its first element in that stream,
 *   INDEX stochastic rounding's hash index of its first element (its place in its tensor).
 * hvd_aps/_tables.py makes the tables once per bucket layout or run. A call covers blocks
 * b0 .. b1, the first from its element o0 on, the last up to (not including) its element o1: a
 * thread's share, cut where no byte of a packed stream is shared with another thread's share.
 * Per block: its exponent (shifts[b]), its seed (seeds[b]) and its decode table
 * (tables + (which[b] << bits)).
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
    peaks[b] = amax(x + row[HVD_SRC], row[HVD_COUNT]);
  }
}

/* Code j of a packed stream of `bits`-bit codes. */
static inline hvd_u32 stream_code(const uint8_t *stream, int64_t j, int32_t bits) {
  return bits == 8 ? stream[j] : bits == 4 ? (stream[j >> 1] >> ((j & 1) * 4)) & 15u : hvd_unpack_code(stream, j, bits);
}

/* Every block's elements encoded at its exponent into its stream (encode_row); with `res`,
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
    encode_row(xb + lo, hi - lo, row[HVD_INDEX] + lo, stream, row[HVD_POS] + lo, f, shifts[b], stochastic,
               stochastic ? seeds[b] : 0u);
    if (res) {
      const float *t = tables + ((int64_t)which[b] << bits);
      float *rb = res + row[HVD_SRC];
      for (int64_t i = lo; i < hi; ++i) rb[i] = xb[i] - t[stream_code(stream, row[HVD_POS] + i, bits)];
    }
  }
}

/* The ranks' codes of every block (whole blocks b0 .. b1 - 1) summed in rank order into out at
 * SRC (sum_rows: rows `stride` bytes apart, each block's stream at BASE of every row), its
 * max |sum| into peaks[b]. */
void hvd_table_sum(const uint8_t *rows, int64_t stride, int32_t ranks, int32_t bits, const int64_t *table, int64_t b0,
                   int64_t b1, float *out, const float *tables, const int32_t *which, float *peaks) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    peaks[b] = sum_rows(rows + row[HVD_BASE], stride, ranks, bits, row[HVD_POS], row[HVD_POS] + row[HVD_COUNT],
                            out + row[HVD_SRC], tables + ((int64_t)which[b] << bits));
  }
}

/* Every block's codes (its stream at BASE, from POS) decoded through table `which[b]` into out at SRC. */
void hvd_table_decode(const uint8_t *message, int32_t bits, const int64_t *table, int64_t b0, int64_t b1, float *out,
                      const float *tables, const int32_t *which, int32_t stream) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t *row = table + b * HVD_COLUMNS;
    decode_row(message + row[HVD_BASE], bits, row[HVD_POS], row[HVD_POS] + row[HVD_COUNT], out + row[HVD_SRC],
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
