/*
 * The SIMT runtime under cuda_on_host.h, and ops/kernels.cu compiled with it: a launch runs the
 * grid's blocks on host threads, a block's threads as fibers of the host thread running it.
 *
 *   const char *hvd_simt_launch(const char *kernel, const unsigned grid[3], const unsigned block[3],
 *                               void **args)
 *
 * runs `kernel` (one of kernels.cu's extern "C" kernels) as cudaLaunchKernel would: args[i] points
 * at the value of the kernel's i-th parameter. It returns when every block is done: NULL, or why
 * the launch failed (a barrier some threads never reach, a shuffle naming a lane that exited).
 *
 * Why fibers: a block's 256 threads as 256 host threads cost about 2 ms a __syncthreads() on two
 * cores (futex wake-ups); the device-path tests run about a million blocks. A fiber switch is a
 * dozen instructions (hvd_simt_swap below, x86-64; elsewhere ucontext). Fibers keep what the
 * tests need of threads: each CUDA thread has its own stack and runs the kernel's text to a
 * barrier; ThreadSanitizer sees each as a thread of its own (switches without synchronisation,
 * barriers and shuffles annotated as what orders them), so a race between a block's threads is
 * reported wherever the schedule puts them.
 *
 * Two builds (tests/simt.py): the shared library the counting CuPy stand-in launches through
 * (persistent host threads, fiber stacks kept), and the checked ones (HVD_SIMT_CHECKED, under
 * ThreadSanitizer or AddressSanitizer, with replay.cc's main), where every block runs on a host
 * thread and fibers of its own, unordered with the launch's other blocks: its __shared__ memory
 * and stacks are new to the sanitizers, as a new block's are on a device, and nothing but the
 * kernel's own atomics orders one block against another.
 */
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define HVD_SIMT_TSAN 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define HVD_SIMT_ASAN 1
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "cuda_on_host.h"

namespace hvd_simt {
namespace {

constexpr unsigned kWarp = 32;
constexpr unsigned kMaxThreads = 1024;  // a block's, as on every CUDA device
#if defined(HVD_SIMT_CHECKED)
constexpr size_t kStack = 512 << 10;  // sanitizers' frames are large
#else
constexpr size_t kStack = 64 << 10;
#endif

/* ThreadSanitizer's view of ordering: a barrier releases what each thread did before it to every
 * thread after it. Elsewhere nothing. */
inline void released(const void *token) {
#if HVD_SIMT_TSAN
  __tsan_release(const_cast<void *>(token));
#else
  (void)token;
#endif
}
inline void acquired(const void *token) {
#if HVD_SIMT_TSAN
  __tsan_acquire(const_cast<void *>(token));
#else
  (void)token;
#endif
}

/* ---- Fibers: a stack and a saved context each ------------------------------------------------ */
#if defined(__x86_64__)
extern "C" void hvd_simt_swap(void **save, void *to);
extern "C" void hvd_simt_boot();
/* hvd_simt_swap: push the callee-saved registers, save the stack pointer, take the other's, pop
 * its registers, return into it. hvd_simt_boot: a new fiber's first return lands here, with its
 * entry function in r13 and argument in r12. */
asm(R"(
  .text
  .globl hvd_simt_swap
  .hidden hvd_simt_swap
  .type hvd_simt_swap,@function
hvd_simt_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hvd_simt_swap, .-hvd_simt_swap
  .globl hvd_simt_boot
  .hidden hvd_simt_boot
  .type hvd_simt_boot,@function
hvd_simt_boot:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size hvd_simt_boot, .-hvd_simt_boot
)");
#endif

struct Fiber {
  char *stack = nullptr;  // mapped with a guard page below it
  size_t size = 0;
#if defined(__x86_64__)
  void *sp = nullptr;
#else
  ucontext_t context;
#endif
#if HVD_SIMT_TSAN
  void *tsan = nullptr;
#endif
#if HVD_SIMT_ASAN
  void *fake_stack = nullptr;
  const void *bottom = nullptr;  // of the host thread's own stack, for the scheduler's fiber
  size_t bottom_size = 0;
#endif

  Fiber() = default;
  Fiber(const Fiber &) = delete;
  Fiber &operator=(const Fiber &) = delete;
  ~Fiber() {
    if (stack) munmap(stack - page(), size + page());
  }

  static size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }

  void map() {
    if (stack) return;
    size = kStack;
    char *base = static_cast<char *>(
        mmap(nullptr, size + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base == MAP_FAILED) {
      perror("hvd_simt: mmap of a fiber stack");
      abort();
    }
    mprotect(base, page(), PROT_NONE);  // an overflow faults instead of writing a neighbour
    stack = base + page();
  }

  /* The next switch into this fiber calls entry(arg) on its stack. */
  void start(void (*entry)(void *), void *arg) {
    map();
#if defined(__x86_64__)
    void **top = reinterpret_cast<void **>((reinterpret_cast<uintptr_t>(stack + size) & ~(uintptr_t)15));
    void **frame = top - 7;  // r15 r14 r13 r12 rbx rbp, then the return address
    frame[0] = nullptr;
    frame[1] = nullptr;
    frame[2] = reinterpret_cast<void *>(entry);
    frame[3] = arg;
    frame[4] = nullptr;
    frame[5] = nullptr;
    frame[6] = reinterpret_cast<void *>(&hvd_simt_boot);
    sp = frame;
#else
    getcontext(&context);
    context.uc_stack.ss_sp = stack;
    context.uc_stack.ss_size = size;
    context.uc_link = nullptr;
    makecontext(&context, reinterpret_cast<void (*)()>(entry), 1, arg);  // one pointer argument: glibc's
#endif
  }
};

/* from -> to; returns when something switches back to `from`. `leaving`: from never resumes.
 * `done`: a token released last thing before the switch (what `from` did, for whoever frees it). */
void swap(Fiber &from, Fiber &to, bool leaving, const void *done = nullptr) {
#if HVD_SIMT_TSAN
  void *target = to.tsan;
  if (done) released(done);
  __tsan_switch_to_fiber(target, __tsan_switch_to_fiber_no_sync);
#else
  (void)done;
#endif
#if HVD_SIMT_ASAN
  __sanitizer_start_switch_fiber(leaving ? nullptr : &from.fake_stack, to.stack ? to.stack : to.bottom,
                                 to.stack ? to.size : to.bottom_size);
#else
  (void)leaving;
#endif
#if defined(__x86_64__)
  hvd_simt_swap(&from.sp, to.sp);
#else
  swapcontext(&from.context, &to.context);
#endif
#if HVD_SIMT_ASAN
  __sanitizer_finish_switch_fiber(from.fake_stack, nullptr, nullptr);
#endif
}

/* ---- Launches and blocks -------------------------------------------------------------------- */
struct Launch {
  const Registered *kernel;
  void **args;
  dim3 grid, block;
  unsigned long long blocks;
  std::atomic<unsigned long long> next{0}, done{0};
  std::atomic<unsigned> users{0};  // pool threads holding it (the pool's)
  std::mutex failed_lock;
  std::string failure;
  std::vector<char> tokens;  // ThreadSanitizer's sync addresses: a block's barrier, each of its warps'

  void fail(const std::string &why) {
    std::lock_guard<std::mutex> hold(failed_lock);
    if (failure.empty()) failure = why;
  }
  const void *token(unsigned long long b, unsigned k) const {  // k: 0 the block's barrier, 1 + w warp w's
    return reinterpret_cast<const void *>(reinterpret_cast<uintptr_t>(tokens.data()) + b * kTokens + k);
  }
  static constexpr unsigned kTokens = 1 + kMaxThreads / kWarp;
  const void *start_token() const { return &grid; }  // the launch's inputs, before any block
  const void *done_token() const { return &block; }  // every block's writes, before the launch returns
};

enum class State : int { kReady, kBarrier, kShuffle, kDone };

struct Block;

struct Thread {
  Lane lane;
  Fiber fiber;
  Block *block = nullptr;
  std::atomic<State> state{State::kReady};  // atomics: fibers and the scheduler share these
  std::atomic<unsigned> mask{0};             // of the shuffle it waits in
};

struct Warp {
  std::atomic<unsigned long long> generation{0};
  std::atomic<unsigned long long> slots[2][kWarp];  // a shuffle's values, by its generation's parity
};

thread_local std::atomic<Thread *> running{nullptr};  // the fiber running on this host thread

/* One block at a time on one host thread: its threads' fibers and the scheduler's own. */
struct Block {
  Launch *launch = nullptr;
  unsigned long long index = 0;
  unsigned count = 0;
  std::vector<Thread> threads{kMaxThreads};
  Warp warps[kMaxThreads / kWarp];
  Fiber scheduler;
  std::string failure;

  void run(Launch &l, unsigned long long b);

 private:
  void release_warps(bool &progressed);
  void release_barrier(bool &progressed);
  std::string stuck() const;
};

void fiber_main(void *arg) {
  Thread &t = *static_cast<Thread *>(arg);
#if HVD_SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &t.block->scheduler.bottom, &t.block->scheduler.bottom_size);
#endif
  running.store(&t, std::memory_order_relaxed);
  Launch &l = *t.block->launch;
  acquired(l.start_token());
  l.kernel->entry(l.kernel->kernel, l.args);
  released(l.done_token());
  t.state.store(State::kDone, std::memory_order_relaxed);
  swap(t.fiber, t.block->scheduler, true, t.block);  // the block's bookkeeping: its scheduler frees it
  __builtin_trap();  // a finished fiber is never resumed
}

/* The running fiber waits (its state set) until the scheduler releases it. */
void wait_here(Thread &t, State state) {
  t.state.store(state, std::memory_order_relaxed);
  swap(t.fiber, t.block->scheduler, false, t.block);
  running.store(&t, std::memory_order_relaxed);
}

Thread &me() {
  Thread *t = running.load(std::memory_order_relaxed);
  if (!t) {
    fprintf(stderr, "hvd_simt: device code called outside a launch\n");
    abort();
  }
  return *t;
}

void Block::run(Launch &l, unsigned long long b) {
  launch = &l;
  index = b;
  count = l.block.x * l.block.y * l.block.z;
  failure.clear();
  const uint3 block_idx = {(unsigned)(b % l.grid.x), (unsigned)(b / l.grid.x % l.grid.y),
                           (unsigned)(b / ((unsigned long long)l.grid.x * l.grid.y))};
  for (unsigned w = 0; w < (count + kWarp - 1) / kWarp; ++w) warps[w].generation.store(0, std::memory_order_relaxed);
#if HVD_SIMT_TSAN
  scheduler.tsan = __tsan_get_current_fiber();
#endif
  for (unsigned i = 0; i < count; ++i) {
    Thread &t = threads[i];
    t.block = this;
    t.lane = {{i % l.block.x, i / l.block.x % l.block.y, i / (l.block.x * l.block.y)}, block_idx, l.block, l.grid};
    t.state.store(State::kReady, std::memory_order_relaxed);
    t.fiber.start(&fiber_main, &t);
#if HVD_SIMT_TSAN
    t.fiber.tsan = __tsan_create_fiber(0);  // made after its fields are set: it sees them
#endif
  }
  for (unsigned done = 0; done < count && failure.empty();) {
    bool progressed = false;
    for (unsigned i = 0; i < count; ++i) {
      Thread &t = threads[i];
      if (t.state.load(std::memory_order_relaxed) != State::kReady) continue;
      swap(scheduler, t.fiber, false);
      running.store(nullptr, std::memory_order_relaxed);
      progressed = true;
      done += t.state.load(std::memory_order_relaxed) == State::kDone;
    }
    if (done == count) break;
    release_warps(progressed);
    release_barrier(progressed);
    if (!progressed) failure = stuck();
  }
#if HVD_SIMT_TSAN
  acquired(this);
  for (unsigned i = 0; i < count; ++i) __tsan_destroy_fiber(threads[i].fiber.tsan);
#endif
  if (!failure.empty()) l.fail(failure);
}

/* Lanes waiting in a shuffle go on once every lane their mask names waits in it too. */
void Block::release_warps(bool &progressed) {
  for (unsigned w = 0; w < (count + kWarp - 1) / kWarp; ++w) {
    const unsigned first = w * kWarp, lanes = std::min(kWarp, count - first);
    unsigned waiting = 0, mask = 0;
    bool agreed = true;
    for (unsigned k = 0; k < lanes; ++k) {
      const Thread &t = threads[first + k];
      if (t.state.load(std::memory_order_relaxed) != State::kShuffle) continue;
      const unsigned m = t.mask.load(std::memory_order_relaxed);
      agreed &= waiting == 0 || m == mask;
      waiting |= 1u << k;
      mask = m;
    }
    if (!waiting) continue;
    if (!agreed) {
      failure = "lanes of warp " + std::to_string(w) + " shuffle with different masks";
      return;
    }
    if (lanes < kWarp && (mask >> lanes)) {
      failure = "a shuffle's mask names lanes warp " + std::to_string(w) + " does not have (" +
                std::to_string(lanes) + " lanes)";
      return;
    }
    if ((waiting & mask) != mask) continue;  // some named lanes still run: they may get here yet
    if (waiting != mask) {
      failure = "a lane of warp " + std::to_string(w) + " shuffles without being named in the mask";
      return;
    }
    warps[w].generation.fetch_add(1, std::memory_order_relaxed);
    for (unsigned k = 0; k < lanes; ++k)
      if (mask >> k & 1) threads[first + k].state.store(State::kReady, std::memory_order_relaxed);
    progressed = true;
  }
}

/* Threads waiting at __syncthreads() go on once all the block's threads wait there. */
void Block::release_barrier(bool &progressed) {
  for (unsigned i = 0; i < count; ++i)
    if (threads[i].state.load(std::memory_order_relaxed) != State::kBarrier) return;
  for (unsigned i = 0; i < count; ++i) threads[i].state.store(State::kReady, std::memory_order_relaxed);
  progressed = true;
}

/* Why no thread of the block can go on (on a device: a hang). */
std::string Block::stuck() const {
  unsigned at_barrier = 0, exited = 0;
  for (unsigned i = 0; i < count; ++i) {
    const State s = threads[i].state.load(std::memory_order_relaxed);
    if (s == State::kShuffle) {
      const unsigned first = i / kWarp * kWarp, mask = threads[i].mask.load(std::memory_order_relaxed);
      for (unsigned k = 0; k < kWarp && first + k < count; ++k)
        if ((mask >> k & 1) && threads[first + k].state.load(std::memory_order_relaxed) != State::kShuffle)
          return "block " + std::to_string(index) + ": thread " + std::to_string(i) + " shuffles with lane " +
                 std::to_string(k) + " of its warp, which " +
                 (threads[first + k].state.load(std::memory_order_relaxed) == State::kDone ? "exited"
                                                                                           : "waits at __syncthreads()");
    }
    at_barrier += s == State::kBarrier;
    exited += s == State::kDone;
  }
  return "block " + std::to_string(index) + ": " + std::to_string(at_barrier) + " of " + std::to_string(count) +
         " threads wait at __syncthreads(), which " + std::to_string(exited) + " exited without reaching";
}

/* Run blocks of `l` until none is left to take. */
void take_blocks(Launch &l, Block &block) {
  for (unsigned long long b; (b = l.next.fetch_add(1, std::memory_order_relaxed)) < l.blocks;) {
    block.run(l, b);
    l.done.fetch_add(1, std::memory_order_release);
  }
}

#if !defined(HVD_SIMT_CHECKED)
/* ---- The persistent pool: host threads that run blocks of whichever launch is waiting --------- */
unsigned pool_size() {
  const char *env = getenv("HVD_SIMT_THREADS");
  const int n = env ? atoi(env) : 4;  // beside the launching thread; several at once even on 2 cores
  return (unsigned)std::max(0, std::min(n, 64));
}

struct Pool {
  std::mutex lock;
  std::condition_variable work, finished;
  std::deque<Launch *> waiting;

  explicit Pool(unsigned n) {
    for (unsigned i = 0; i < n; ++i) std::thread([this] { serve(); }).detach();
  }

  void serve() {
    Block &block = *new Block;  // kept for the process: its fiber stacks are reused
    for (;;) {
      Launch *l;
      {
        std::unique_lock<std::mutex> hold(lock);
        work.wait(hold, [this] { return !waiting.empty(); });
        l = waiting.front();
        if (l->next.load(std::memory_order_relaxed) >= l->blocks) {
          waiting.pop_front();
          continue;
        }
        l->users.fetch_add(1, std::memory_order_relaxed);  // its launcher waits for it to let go
      }
      take_blocks(*l, block);
      std::lock_guard<std::mutex> hold(lock);
      l->users.fetch_sub(1, std::memory_order_relaxed);
      finished.notify_all();
    }
  }

  void run(Launch &l) {
    static thread_local std::unique_ptr<Block> mine(new Block);  // the launching thread's own
    {
      std::lock_guard<std::mutex> hold(lock);
      waiting.push_back(&l);
    }
    work.notify_all();
    take_blocks(l, *mine);
    std::unique_lock<std::mutex> hold(lock);
    finished.wait(hold, [&l] {
      return l.done.load(std::memory_order_acquire) == l.blocks && !l.users.load(std::memory_order_relaxed);
    });
    waiting.erase(std::remove(waiting.begin(), waiting.end(), &l), waiting.end());
  }
};

void run_launch(Launch &l) {
  static Pool *pool = new Pool(pool_size());  // never destroyed: its threads outlive static destructors
  pool->run(l);
}
#else
/* ---- Checked builds: a host thread and fibers of its own for every block ----------------------- */
constexpr unsigned kAtOnce = 4;  // blocks running at once

void run_launch(Launch &l) {
  std::atomic<unsigned> running_blocks{0};
  for (unsigned long long b = 0; b < l.blocks; ++b) {
    while (running_blocks.load(std::memory_order_relaxed) >= kAtOnce) std::this_thread::yield();
    running_blocks.fetch_add(1, std::memory_order_relaxed);
    // detached and waited for through relaxed atomics: no block is ordered after another by the pool
    std::thread([&l, &running_blocks, b] {
      std::make_unique<Block>()->run(l, b);  // on the heap: its address a fresh sync token for the sanitizer
      l.done.fetch_add(1, std::memory_order_relaxed);
      running_blocks.fetch_sub(1, std::memory_order_release);
    }).detach();
  }
  while (l.done.load(std::memory_order_relaxed) < l.blocks || running_blocks.load(std::memory_order_relaxed))
    std::this_thread::yield();
  running_blocks.load(std::memory_order_acquire);  // every block's last touch of the launch, before it ends
}
#endif

}  // namespace

/* ---- What device code calls ------------------------------------------------------------------- */
const Lane &lane() { return me().lane; }

void sync_block() {
  Thread &t = me();
  const void *token = t.block->launch->token(t.block->index, 0);
  released(token);
  wait_here(t, State::kBarrier);
  acquired(token);
}

unsigned long long shuffle_down(unsigned int mask, unsigned long long bits, unsigned int delta, int width) {
  Thread &t = me();
  Block &b = *t.block;
  const unsigned index = (unsigned)(&t - b.threads.data()), w = index / kWarp, k = index % kWarp;
  Warp &warp = b.warps[w];
  const unsigned long long generation = warp.generation.load(std::memory_order_relaxed);
  warp.slots[generation & 1][k].store(bits, std::memory_order_relaxed);
  t.mask.store(mask, std::memory_order_relaxed);
  const void *token = b.launch->token(b.index, 1 + w);
  released(token);
  wait_here(t, State::kShuffle);
  acquired(token);
  const unsigned segment = (unsigned)width, source = k + delta;
  if (k % segment + delta >= segment) return bits;  // past its segment: a lane keeps its own value
  return warp.slots[generation & 1][source].load(std::memory_order_relaxed);
}

}  // namespace hvd_simt

extern "C" __attribute__((visibility("default"))) const char *hvd_simt_launch(const char *kernel,
                                                                             const unsigned grid[3],
                                                                             const unsigned block[3], void **args) {
  using namespace hvd_simt;
  static thread_local std::string why;
  const Registered *found = nullptr;
  for (int k = 0; k < hvd_simt_kernel_count; ++k)
    if (strcmp(hvd_simt_kernels[k].name, kernel) == 0) found = &hvd_simt_kernels[k];
  if (!found) return (why = std::string("no kernel ") + kernel + " in kernels.cu").c_str();
  const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
  if (threads == 0 || threads > kMaxThreads || !grid[0] || !grid[1] || !grid[2])
    return (why = "a launch needs 1 to 1024 threads a block and a grid of at least one block").c_str();
  Launch l;
  l.kernel = found;
  l.args = args;
  l.grid = {grid[0], grid[1], grid[2]};
  l.block = {block[0], block[1], block[2]};
  l.blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
#if HVD_SIMT_TSAN
  l.tokens.resize(l.blocks * Launch::kTokens);
#endif
  released(l.start_token());
  run_launch(l);
  acquired(l.done_token());
  if (l.failure.empty()) return nullptr;
  return (why = kernel + std::string(": ") + l.failure).c_str();
}
