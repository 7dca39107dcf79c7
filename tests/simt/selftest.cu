/*
 * Kernels that hold the SIMT layer to CUDA's semantics (tests/test_simt.py): indices, a block's
 * shared memory and barrier, warp shuffles, atomics; kernels a device would hang on, which the
 * layer must refuse with the reason; and races and overruns the checked builds must report.
 */

/* Every thread's place, eight values a thread in linear order: thread x y z, block x y z, threads
 * a block, blocks. */
extern "C" __global__ void simt_indices(unsigned int *out) {
  const unsigned int threads = blockDim.x * blockDim.y * blockDim.z;
  const unsigned int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned int *at = out + 8ull * (block * threads + t);
  at[0] = threadIdx.x, at[1] = threadIdx.y, at[2] = threadIdx.z;
  at[3] = blockIdx.x, at[4] = blockIdx.y, at[5] = blockIdx.z;
  at[6] = threads, at[7] = gridDim.x * gridDim.y * gridDim.z;
}

/* Each block's run of blockDim.x values reversed through shared memory. */
extern "C" __global__ void simt_reverse(const float *in, float *out) {
  __shared__ float tile[1024];
  const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x;
  tile[threadIdx.x] = in[base + threadIdx.x];
  __syncthreads();
  out[base + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}

/* out[i] = __shfl_down_sync(all, in[i], delta, width), twice in a row (the second on the first's
 * result): lanes read their partner's value of the same shuffle, never the next one's. */
extern "C" __global__ void simt_shuffle(const unsigned int *in, unsigned int *out, unsigned int delta, int width) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned int once = __shfl_down_sync(0xFFFFFFFFu, in[i], delta, width);
  out[i] = __shfl_down_sync(0xFFFFFFFFu, once, delta, width);
}

/* *top = max of in; bits[i / 32] gets bit i % 32 set, and clear[i / 32] bit i % 32 cleared. */
extern "C" __global__ void simt_atomics(const unsigned int *in, unsigned int *top, unsigned int *bits,
                                        unsigned int *clear) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  atomicMax(top, in[i]);
  atomicOr(bits + i / 32, 1u << (i % 32));
  atomicAnd(clear + i / 32, ~(1u << (i % 32)));
}

/* A barrier only the odd threads reach: a hang on a device. */
extern "C" __global__ void simt_divergent_barrier(unsigned int *out) {
  if (threadIdx.x % 2) __syncthreads();
  out[threadIdx.x] = 1;
}

/* A shuffle whose mask names lane 5, which never shuffles. */
extern "C" __global__ void simt_missing_lane(unsigned int *out) {
  if (threadIdx.x != 5) out[threadIdx.x] = __shfl_down_sync(0xFFFFFFFFu, threadIdx.x, 1);
}

/* Races the checked build must report: every block adding to one word without an atomic ... */
extern "C" __global__ void simt_race_between_blocks(unsigned int *out) {
  if (threadIdx.x == 0) out[0] += blockIdx.x + 1;
}

/* ... a block's threads reading their neighbour's shared value with no barrier between ... */
extern "C" __global__ void simt_race_in_block(unsigned int *out) {
  __shared__ unsigned int value[1024];
  value[threadIdx.x] = threadIdx.x;
  out[threadIdx.x] = value[(threadIdx.x + 1) % blockDim.x];
}

/* ... one block's plain byte store beside another's atomic on the same word; and an overrun:
 * thread n writes one element past an array of n. */
extern "C" __global__ void simt_plain_beside_atomic(unsigned char *bytes) {
  if (threadIdx.x) return;
  if (blockIdx.x == 0) bytes[0] = 1;
  else atomicOr(reinterpret_cast<unsigned int *>(bytes), 1u << 8);
}

extern "C" __global__ void simt_overrun(float *out, long long n) {
  if (threadIdx.x <= n) out[threadIdx.x] = 1.0f;
}
