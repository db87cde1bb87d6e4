// Fiber scheduler and runtime API of the CUDA emulator (see include/emu_core.h).
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__) || !defined(__x86_64__)
#define EMU_UCONTEXT 1  // AddressSanitizer understands ucontext fiber switches, not the hand-written one
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <vector>

#include "emu_core.h"

#ifndef EMU_UCONTEXT
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the
// stack pointer in *save and continues on `next` (which was saved the same way, or made by
// fiber_stack()). Unlike swapcontext it makes no system call, which makes the emulator ~20x faster.
extern "C" void emu_switch(void** save, void* next);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch,.-emu_switch
.section .note.GNU-stack,"",@progbits
)");
#endif

namespace emu {

thread_local Thread* t_cur = nullptr;
thread_local Block* t_blk = nullptr;

namespace {

enum class State : uint8_t { Ready, AtBlock, AtWarp, Done };

struct Fiber : Thread {
#ifdef EMU_UCONTEXT
  ucontext_t ctx;
#else
  void* sp = nullptr;
#endif
  State state = State::Ready;
  int op = 0, arg = 0, width = 32;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
};

struct BlockRun : Block {
  std::vector<Fiber> fibers;
#ifdef EMU_UCONTEXT
  ucontext_t sched;
#else
  void* sched_sp = nullptr;
#endif
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;
  int nwarps = 0;
};

constexpr size_t kStack = 256 * 1024;

struct Stacks {  // reused across launches; one per thread of the largest block seen
  std::vector<char*> stacks;
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("cuda emulator: cannot map a fiber stack");
      stacks.push_back(static_cast<char*>(p));
    }
    return stacks[i];
  }
};
thread_local Stacks t_stacks;

cudaError_t g_last = cudaSuccess;
std::atomic<unsigned long long> g_launches{0};
std::string g_last_msg;
std::mutex g_attr_mu;
std::map<const void*, int> g_func_smem;

thread_local BlockRun* t_run = nullptr;

Fiber& me() { return *static_cast<Fiber*>(t_cur); }

void yield_to_scheduler() {
  Fiber& f = me();
#ifdef EMU_UCONTEXT
  swapcontext(&f.ctx, &t_run->sched);
#else
  emu_switch(&f.sp, t_run->sched_sp);
#endif
}

void fiber_main() {
  BlockRun* b = t_run;
  try {
    (*b->body)();
  } catch (...) {
    if (!b->error) b->error = std::current_exception();
  }
  me().state = State::Done;
#ifndef EMU_UCONTEXT
  yield_to_scheduler();  // never resumed
  std::abort();
#endif
  // (ucontext: returns through uc_link to the scheduler)
}

#ifndef EMU_UCONTEXT
// A fresh stack that emu_switch "returns" into fiber_main from: six zero registers and the current
// MXCSR / x87 control word below fiber_main's address, which sits 16-byte aligned (so that at
// fiber_main's first instruction rsp % 16 == 8, as after a call).
void* fiber_stack(char* base, size_t size) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15);
  uint64_t* slot = reinterpret_cast<uint64_t*>(top - 16);
  slot[1] = 0;                                              // fiber_main's (never used) return address
  slot[0] = reinterpret_cast<uint64_t>(&fiber_main);
  uint64_t* regs = slot - 6;
  for (int i = 0; i < 6; ++i) regs[i] = 0;
  uint32_t* csr = reinterpret_cast<uint32_t*>(regs - 1);
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  uint16_t cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  csr[1] = cw;
  return regs - 1;
}
#endif

std::string where(const BlockRun& b) {
  std::ostringstream o;
  o << "block (" << b.bid.x << "," << b.bid.y << "," << b.bid.z << ")";
  return o.str();
}

[[noreturn]] void deadlock(const BlockRun& b, const char* name) {
  std::ostringstream o;
  o << "cuda emulator: kernel " << name << " " << where(b) << " cannot make progress:";
  int shown = 0;
  for (const Fiber& f : b.fibers) {
    if (f.state == State::Done) continue;
    if (shown++ == 6) { o << " ..."; break; }
    o << " thread " << f.linear << (f.state == State::AtBlock ? " at __syncthreads" : " at a warp collective");
    if (f.state == State::AtWarp) o << " (op " << f.op << ", mask 0x" << std::hex << f.mask << std::dec << ")";
    o << ";";
  }
  o << " (a barrier some threads of the block, or some lanes of a warp's mask, never reach)";
  throw std::runtime_error(o.str());
}

// Resolves the warp collectives whose lanes have all arrived; returns whether any was released.
bool resolve_warps(BlockRun& b, const char* name) {
  bool released = false;
  const int n = (int)b.fibers.size();
  for (int w = 0; w < b.nwarps; ++w) {
    const int base = w * 32;
    for (int l = 0; l < 32 && base + l < n; ++l) {
      Fiber& first = b.fibers[base + l];
      if (first.state != State::AtWarp) continue;
      const unsigned mask = first.mask;
      if (!(mask >> l & 1u))
        throw std::runtime_error("cuda emulator: kernel " + std::string(name) + ": a lane calls a warp collective "
                                 "whose mask leaves itself out");
      bool all = true;
      for (int k = 0; k < 32; ++k) {
        if (!(mask >> k & 1u)) continue;
        if (base + k >= n || b.fibers[base + k].state == State::Done)
          throw std::runtime_error("cuda emulator: kernel " + std::string(name) + " " + where(b) +
                                   ": warp collective mask names a lane that has exited or does not exist");
        const Fiber& f = b.fibers[base + k];
        if (f.state != State::AtWarp) { all = false; break; }
        if (f.op != first.op || f.mask != mask)
          throw std::runtime_error("cuda emulator: kernel " + std::string(name) + " " + where(b) +
                                   ": lanes of one warp wait at different warp collectives (op " +
                                   std::to_string(f.op) + " vs " + std::to_string(first.op) + ")");
      }
      if (!all) continue;
      uint64_t ballot = 0;
      for (int k = 0; k < 32; ++k)
        if (mask >> k & 1u) ballot |= (uint64_t)(b.fibers[base + k].value != 0) << k;
      for (int k = 0; k < 32; ++k) {
        if (!(mask >> k & 1u)) continue;
        Fiber& f = b.fibers[base + k];
        const int width = f.width, seg = k & ~(width - 1);
        int src = k;
        switch (f.op) {
          case OP_SHFL_IDX: src = seg + (f.arg & (width - 1)); break;
          case OP_SHFL_XOR: src = k ^ f.arg; if (src >= seg + width) src = k; break;
          case OP_SHFL_DOWN: src = k + f.arg; if (src >= seg + width) src = k; break;
          case OP_SHFL_UP: src = k - f.arg; if (src < seg) src = k; break;
          default: break;
        }
        if (f.op == OP_BALLOT) {
          f.result = ballot;
        } else if (f.op >= OP_SHFL_IDX && f.op <= OP_SHFL_UP) {
          if (!(mask >> src & 1u))
            throw std::runtime_error("cuda emulator: kernel " + std::string(name) +
                                     ": a shuffle reads a lane outside its mask");
          f.result = b.fibers[base + src].value;
        }
      }
      for (int k = 0; k < 32; ++k)
        if (mask >> k & 1u) b.fibers[base + k].state = State::Ready;
      released = true;
    }
  }
  return released;
}

std::atomic<uint64_t> g_seed_value{[] {
  const char* e = std::getenv("TEMPOKERN_EMU_SEED");
  return e ? std::strtoull(e, nullptr, 10) : 0ull;
}()};
uint64_t g_seed() { return g_seed_value.load(); }

// Warp-serial scheduling (TEMPOKERN_EMU_WARP_SERIAL=1 or emu_set_warp_serial(true)): between two __syncthreads each
// warp runs alone, through all its warp collectives, until every lane is at the next __syncthreads (or has exited),
// then the next warp: the last warp first (the reverse of the default schedule's index order), or a seeded random
// order with TEMPOKERN_EMU_SEED. Shared-memory writes a warp makes after a point where a barrier is missing then land
// before the reads the warps that run after it make in the same interval.
std::atomic<bool> g_warp_serial_value{[] {
  const char* e = std::getenv("TEMPOKERN_EMU_WARP_SERIAL");
  return e && *e && std::strcmp(e, "0") != 0;
}()};

void run_block(BlockRun& b, const char* name) {
  const int n = (int)b.fibers.size();
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::mt19937_64 rng(g_seed() * 1000003u + b.bid.x * 7919u + b.bid.y * 104729u + b.bid.z);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
#ifdef EMU_UCONTEXT
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = t_stacks.get(i);
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, fiber_main, 0);
#else
    f.sp = fiber_stack(t_stacks.get(i), kStack);
#endif
  }
  auto step = [&](Fiber& f) {  // runs f to its next barrier
    t_cur = &f;
#ifdef EMU_UCONTEXT
    swapcontext(&b.sched, &f.ctx);
#else
    emu_switch(&b.sched_sp, f.sp);
#endif
    t_cur = nullptr;
    if (b.error) std::rethrow_exception(b.error);
  };
  const bool serial = g_warp_serial_value.load();
  std::vector<int> worder(b.nwarps);
  for (int w = 0; w < b.nwarps; ++w) worder[w] = b.nwarps - 1 - w;
  for (;;) {
    // Run every ready fiber to its next barrier (in a seeded random order when TEMPOKERN_EMU_SEED is set,
    // so results that depend on the order threads reach a barrier, that is races, change between seeds).
    if (g_seed()) std::shuffle(order.begin(), order.end(), rng);
    if (serial) {  // one warp at a time up to the next __syncthreads (its collectives resolved as it goes)
      if (g_seed()) std::shuffle(worder.begin(), worder.end(), rng);
      for (int w : worder) {
        do {
          for (int i : order)
            if (i / 32 == w && b.fibers[i].state == State::Ready) step(b.fibers[i]);
        } while (resolve_warps(b, name));
      }
    } else {
      for (int i : order)
        if (b.fibers[i].state == State::Ready) step(b.fibers[i]);
      if (resolve_warps(b, name)) continue;
    }
    int done = 0, at_block = 0;
    for (const Fiber& f : b.fibers) {
      done += f.state == State::Done;
      at_block += f.state == State::AtBlock;
    }
    if (done == n) return;
    if (at_block + done == n) {
      for (Fiber& f : b.fibers)
        if (f.state == State::AtBlock) f.state = State::Ready;
      continue;
    }
    deadlock(b, name);
  }
}

}  // namespace

void sync_block() {
  me().state = State::AtBlock;
  yield_to_scheduler();
}

uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)))
    device_error("warp shuffle width must be a power of two <= 32");
  Fiber& f = me();
  f.state = State::AtWarp;
  f.op = op;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  yield_to_scheduler();
  return f.result;
}

void device_error(const std::string& what) {
  std::ostringstream o;
  o << "cuda emulator: device fault in " << where(*t_run) << " thread " << t_cur->linear << ": " << what;
  throw std::runtime_error(o.str());
}

unsigned long long launch_count() { return g_launches.load(); }
void set_seed(unsigned long long seed) { g_seed_value = seed; }
void set_warp_serial(bool on) { g_warp_serial_value = on; }

void set_last_error(cudaError_t e, const std::string& msg) {
  g_last = e;
  g_last_msg = msg;
}

void set_func_smem(const void* fn, int bytes) {
  std::lock_guard<std::mutex> g(g_attr_mu);
  g_func_smem[fn] = bytes;
}

void launch(const char* name, dim3 grid, dim3 block, size_t smem, const void* fn, const std::function<void()>& body) {
  const uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
  if (nthreads == 0 || nthreads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
    set_last_error(cudaErrorInvalidConfiguration, std::string("invalid launch configuration for ") + name);
    return;
  }
  int limit = 48 * 1024;
  {
    std::lock_guard<std::mutex> g(g_attr_mu);
    auto it = g_func_smem.find(fn);
    if (it != g_func_smem.end()) limit = std::max(limit, it->second);
  }
  if (smem > (size_t)limit) {
    set_last_error(cudaErrorInvalidValue, std::string(name) + " asks for " + std::to_string(smem) +
                                              " bytes of dynamic shared memory, above the " + std::to_string(limit) +
                                              " it was allowed (cudaFuncSetAttribute)");
    return;
  }
  ++g_launches;
  std::vector<unsigned char> dyn(smem + 256);
  unsigned char* dyn_base = dyn.data() + ((256 - reinterpret_cast<uintptr_t>(dyn.data()) % 256) % 256);
  BlockRun b;
  b.bdim = {block.x, block.y, block.z};
  b.gdim = {grid.x, grid.y, grid.z};
  b.dyn_smem = dyn_base;
  b.body = &body;
  b.fibers.resize(nthreads);
  b.nwarps = (int)((nthreads + 31) / 32);
  for (uint64_t i = 0; i < nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = (int)i;
    f.tid = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / block.x / block.y)};
    f.lane = (int)(i % 32);
  }
  struct Current {  // this launch's block is the current one until launch() returns or throws
    BlockRun* run = t_run;
    Block* blk = t_blk;
    explicit Current(BlockRun* b) { t_run = b; t_blk = b; }
    ~Current() { t_run = run; t_blk = blk; }
  } current(&b);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.bid = {x, y, z};
        b.error = nullptr;
        std::memset(dyn_base, 0xff, smem);  // NaN: reading shared memory before writing it shows
        for (Fiber& f : b.fibers) f.state = State::Ready;
        run_block(b, name);
      }
}

}  // namespace emu

cudaError_t cudaGetLastError() {
  cudaError_t e = emu::g_last;
  emu::g_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::g_last; }
const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaSuccess) return "no error";
  thread_local std::string s;
  s = "emulated CUDA error " + std::to_string((int)e) + ": " + emu::g_last_msg;
  return s.c_str();
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
namespace {
// The emulated device's compute capability (10 major + minor): TEMPOKERN_EMU_ARCH=75|80|86|89|90 (default 90, the
// H100), read at each query so that tests can change it.
int emu_arch() {
  const char* e = std::getenv("TEMPOKERN_EMU_ARCH");
  const int a = e && *e ? std::atoi(e) : 90;
  return a >= 50 && a < 200 ? a : 90;
}
// Opt-in shared memory per block of that arch: sm_75 64 KB, sm_80 (A100) 163 KB, sm_86 / sm_89 99 KB, sm_90 227 KB.
int arch_smem_optin(int arch) {
  switch (arch) {
    case 75: return 65536;
    case 80: case 87: return 166912;
    case 86: case 89: return 101376;
    default: return arch < 80 ? 65536 : 232448;
  }
}
}  // namespace

cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  switch (a) {
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 48 * 1024; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *v = emu_arch() / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *v = emu_arch() % 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: {
      // TEMPOKERN_EMU_SMEM_OPTIN (bytes) where set, else the limit of TEMPOKERN_EMU_ARCH (the H100's 227 KB by default).
      const char* e = std::getenv("TEMPOKERN_EMU_SMEM_OPTIN");
      *v = e && *e ? std::atoi(e) : arch_smem_optin(emu_arch());
      break;
    }
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t) {
  std::memset(p, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, int, cudaStream_t) {
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
