/*
 * A CUDA source's kernels (HVD_SIMT_SOURCE: ops/kernels.cu, or selftest.cu) compiled as host code
 * against cuda_on_host.h, and their table by name for simt.cc's launches. A translation unit of
 * its own: the counting build instruments it alone (count.cc), so only the kernels' own memory
 * accesses are counted.
 */
#include <cstddef>
#include <type_traits>
#include <utility>

#include "cuda_on_host.h"  // ends with __CUDACC__ defined: the source (and fpcodec.h) as device code
#include HVD_SIMT_SOURCE

namespace {

template <class... A>
struct Kernel {
  template <size_t... I>
  static void call(void (*fn)(A...), void **args, std::index_sequence<I...>) {
    fn(*static_cast<std::remove_cv_t<A> *>(args[I])...);
  }
  static void entry(void *fn, void **args) {
    call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
  }
};

template <class... A>
hvd_simt::Registered registered(const char *name, void (*fn)(A...)) {
  return {name, reinterpret_cast<void *>(fn), &Kernel<A...>::entry};
}

}  // namespace

/* HVD_SIMT_KERNELS: X(name) for every extern "C" kernel of the source (tests/simt.py lists them) */
#define X(name) registered(#name, &name),
extern "C" const hvd_simt::Registered hvd_simt_kernels[] = {HVD_SIMT_KERNELS};
#undef X
extern "C" const int hvd_simt_kernel_count = sizeof hvd_simt_kernels / sizeof hvd_simt_kernels[0];
