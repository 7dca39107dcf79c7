/*
 * CUDA's kernel language on the host: ops/kernels.cu compiles unchanged as C++ against this header
 * (simt.cc includes both), and its kernels run on the CPU as they would on a GPU, thread for thread.
 *
 * - A block's threads are fibers of one host thread (simt.cc): each runs the kernel's text until it
 *   finishes or waits at __syncthreads() or a shuffle, then the next runs. Several blocks run at
 *   once on a persistent pool of host threads, so blocks race as they do on a device.
 * - threadIdx, blockIdx, blockDim and gridDim are the running fiber's (`hvd_simt::lane()`).
 * - __shared__ memory is a block's: `static thread_local`, the host thread running the block.
 * - __syncthreads() is a barrier of the block's threads; __shfl_down_sync a warp's exchange, with a
 *   barrier of the lanes its mask names. A barrier not every thread reaches, a mask naming a lane
 *   that exited or never existed: the launch fails with the reason (on a device: a hang or garbage).
 * - atomicMax/And/Or are host atomics on the same 32-bit words (relaxed, as CUDA's are).
 * - The device math the kernels call maps to the host's IEEE functions with the same results:
 *   frexp, ldexp, isfinite and the float/double division and products (correctly rounded on both).
 *
 * What the host cannot give, and where the tests look instead:
 * - Contraction: nvcc fuses a*b+c into an FMA by default; g++ here never does (-ffp-contract=off).
 *   The kernels' float arithmetic avoids the question: every product that meets an add is
 *   __dmul_rn (never fused on a device, a plain product here). tests/test_gpu.py compares the stats
 *   kernel's float64 sums with this emulation's bit for bit on a device.
 * - NaN results of float arithmetic: x86 returns one operand's NaN (a sum where NaNs of both signs
 *   meet takes the sign of whichever the compiled operand order puts first), a device its canonical
 *   NaN (0x7FFFFFFF). Sums are compared NaN for NaN; a code's decoded NaN is exact everywhere.
 * - The memory model: the host's (x86-64: TSO) is stronger than a GPU's; code relying on ordering
 *   between blocks without atomics or fences could pass here and fail there. The kernels share no
 *   memory between blocks but through atomics (ThreadSanitizer checks that: tests/test_simt.py).
 * - Speed, and NVRTC's build: scripts/gpu_check.sh on a device.
 */
#ifndef HVD_SIMT_CUDA_ON_HOST_H_
#define HVD_SIMT_CUDA_ON_HOST_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct uint3 {
  unsigned int x, y, z;
};
typedef uint3 dim3;

namespace hvd_simt {

/* What a CUDA thread knows of itself: its place in the block and the grid. */
struct Lane {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};

const Lane &lane();  // the running fiber's
void sync_block();
unsigned long long shuffle_down(unsigned int mask, unsigned long long bits, unsigned int delta, int width);

/* A kernel by name, called by every thread of a launch with cudaLaunchKernel's argument array
 * (args[i] points at parameter i's value). kernels.cc lists the source's kernels. */
struct Registered {
  const char *name;
  void *kernel;
  void (*entry)(void *kernel, void **args);
};

}  // namespace hvd_simt

extern "C" const hvd_simt::Registered hvd_simt_kernels[];
extern "C" const int hvd_simt_kernel_count;

/* The kernel language */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define threadIdx (hvd_simt::lane().thread_idx)
#define blockIdx (hvd_simt::lane().block_idx)
#define blockDim (hvd_simt::lane().block_dim)
#define gridDim (hvd_simt::lane().grid_dim)

inline void __syncthreads() { hvd_simt::sync_block(); }

template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  static_assert(sizeof(T) <= sizeof(unsigned long long), "a shuffle moves at most 8 bytes");
  unsigned long long bits = 0;
  memcpy(&bits, &var, sizeof var);
  bits = hvd_simt::shuffle_down(mask, bits, delta, width);
  memcpy(&var, &bits, sizeof var);
  return var;
}

/* Atomics on 32-bit words of global memory: the old value, as CUDA's return it */
inline unsigned int atomicAnd(unsigned int *address, unsigned int value) {
  return __atomic_fetch_and(address, value, __ATOMIC_RELAXED);
}
inline unsigned int atomicOr(unsigned int *address, unsigned int value) {
  return __atomic_fetch_or(address, value, __ATOMIC_RELAXED);
}
inline unsigned int atomicMax(unsigned int *address, unsigned int value) {
  unsigned int old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < value && !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

/* Device functions the kernels and fpcodec.h's device branch call */
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
inline double __dmul_rn(double a, double b) { return a * b; }

/* From here on the text is device code, as nvcc sees it (fpcodec.h takes its device branch) */
#define __CUDACC__ 1

#endif /* HVD_SIMT_CUDA_ON_HOST_H_ */
