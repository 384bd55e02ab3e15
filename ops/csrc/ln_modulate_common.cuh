// Device helpers shared by the forward and backward kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include "ln_modulate.h"

namespace lnmod {

// --- 8-element vectors: one 16-byte access for 2-byte types, two for fp32 ---------------------------
__device__ __forceinline__ void load8(const float* p, float* f) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
// Unpacking by shifts and intrinsics on register values (no address taken: the vectors stay in registers).
__device__ __forceinline__ void cvt2(unsigned w, const __nv_bfloat16*, float* f) {
  f[0] = __uint_as_float(w << 16);
  f[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void cvt2(unsigned w, const __half*, float* f) {
  f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
template <typename T>
__device__ __forceinline__ void cvt8(const uint4& u, const T* tag, float* f) {
  cvt2(u.x, tag, f); cvt2(u.y, tag, f + 2); cvt2(u.z, tag, f + 4); cvt2(u.w, tag, f + 6);
}
__device__ __forceinline__ void load8(const __half* p, float* f) {
  cvt8(__ldg(reinterpret_cast<const uint4*>(p)), p, f);
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* f) {
  cvt8(__ldg(reinterpret_cast<const uint4*>(p)), p, f);
}
__device__ __forceinline__ void store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void store8(__half* p, const float* f) {
  uint4 u;
  __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* f) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Raw 8-element vector kept in registers in its storage type (4 registers for 2-byte types instead of
// 8 floats): rows are held packed and converted on use, which halves register use for bf16/fp16 and so
// doubles the rows in flight per SM.
template <typename T> struct Pack8 {
  uint4 u;
  __device__ __forceinline__ void load(const T* p) { u = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void get(float* f) const { cvt8(u, static_cast<const T*>(nullptr), f); }
  __device__ __forceinline__ void zero() { u = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void lds(const T* p) { u = *reinterpret_cast<const uint4*>(p); }
};
template <> struct Pack8<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const float* p) {
    a = __ldg(reinterpret_cast<const float4*>(p));
    b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ void get(float* f) const {
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
  __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void lds(const float* p) {
    a = reinterpret_cast<const float4*>(p)[0];
    b = reinterpret_cast<const float4*>(p)[1];
  }
};

// --- cp.async (sm_80+): global -> shared copies that do not occupy registers while in flight ----------
// Staging `nst` rows ahead in shared memory keeps several times more bytes in flight per SM than a
// register-held prefetch (4-8 registers per 16 bytes). Measured on H200 (2026-11-29) it did not make the
// kernels faster (docs/kernel.md), so it is opt-in (set_stages) and kept for further tuning.
// Each thread copies and later reads only its own 16-byte vectors, so no barrier is needed between the
// copy and the read: the thread's own cp.async.wait_group suffices.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
template <typename T>
__device__ __forceinline__ void cp_async8(T* dst, const T* src) {  // 8 elements
#pragma unroll
  for (int k = 0; k < int(sizeof(T)) / 2; ++k) cp_async16(reinterpret_cast<uint4*>(dst) + k, reinterpret_cast<const uint4*>(src) + k);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most n of this thread's committed groups are pending (n is an immediate in PTX).
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
  }
}
constexpr int kMaxStages = 6;
// Shared memory per CTA of the staged kernels: at most this, so two CTAs share one SM (228 KB).
constexpr size_t kPipeSmemCap = 112 * 1024;

// --- host-side caches: these queries cost microseconds per launch, which small shapes feel -----------
inline int cached_num_sms() {
  static int n[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) { int v = 0; cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev); return v; }
  if (n[dev] == 0) cudaDeviceGetAttribute(&n[dev], cudaDevAttrMultiProcessorCount, dev);
  return n[dev];
}
// Raises the kernel's dynamic shared-memory limit when needed (once per device, kernel and size).
inline cudaError_t ensure_smem(const void* k, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> done;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = done[{dev, k}];
  if (have >= smem) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess) have = smem;
  return e;
}
// Resident CTAs per SM (>= 1), cached per (device, kernel, threads, smem).
inline int cached_occupancy(const void* k, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(dev, k, threads, smem);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int per_sm = 0;
  if (ensure_smem(k, smem) == cudaSuccess) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem);
  if (per_sm < 1) per_sm = 1;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = per_sm;
  return per_sm;
}

// CTAs per sample of a persistent grid (C, B): one wave of resident CTAs (per_sm per SM) shared among the B
// samples, at least one each, no more than the sample's rows need (rpc rows per CTA), within gridDim.x's cap.
inline int64_t persistent_ctas(int per_sm, int64_t B, int64_t S, int rpc) {
  int64_t c = int64_t(cached_num_sms()) * per_sm / (B > 0 ? B : 1);
  const int64_t most = (S + rpc - 1) / rpc;
  if (c > most) c = most;
  if (c < 1) c = 1;
  return c > 65535 ? 65535 : c;
}

// Launches `kernel` (a forward: its own rows per CTA `rpc`) on the persistent grid (persistent_ctas, B),
// raising its dynamic shared-memory limit first when `smem` needs it.
inline cudaError_t launch_persistent(const void* kernel, int threads, size_t smem, int rpc, int64_t B, int64_t S,
                                     void** args, cudaStream_t stream) {
  const cudaError_t e = ensure_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const int64_t c = persistent_ctas(cached_occupancy(kernel, threads, smem), B, S, rpc);
  return cudaLaunchKernel(kernel, dim3(unsigned(c), unsigned(B)), dim3(threads), args, smem, stream);
}

// --- scalar conversions (generic path) -------------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ void lds8(const float* p, float* f) {  // shared memory, 16-byte aligned
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float2 warp_sum2(float2 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  return v;
}

// Sum over the `wpr` warps that share one row. `slot` is this row group's wpr floats of shared memory.
// Every thread of the CTA must call it (it may __syncthreads); the caller alternates two slot buffers
// so that one barrier per reduction is enough (the next write to a buffer comes after the next barrier).
__device__ __forceinline__ float group_sum(float v, float* slot, int wpr) {
  v = warp_sum(v);
  if (wpr == 1) return v;
  const int lane = threadIdx.x & 31, warp_in_group = (threadIdx.x >> 5) % wpr;
  if (lane == 0) slot[warp_in_group] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += slot[i];  // same order in every thread: identical results
  return s;
}
__device__ __forceinline__ float2 group_sum2(float2 v, float2* slot, int wpr) {
  v = warp_sum2(v);
  if (wpr == 1) return v;
  const int lane = threadIdx.x & 31, warp_in_group = (threadIdx.x >> 5) % wpr;
  if (lane == 0) slot[warp_in_group] = v;
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int i = 0; i < wpr; ++i) { s.x += slot[i].x; s.y += slot[i].y; }
  return s;
}

// --- helpers of the forward variants 1 and 2 (fwd_v1_kernel) -----------------------------------------
// Barrier over the `nthreads` threads of one row group only: named barrier 1 + group (0 is __syncthreads,
// used once for the shared-memory staging). Row groups of a CTA then do not wait for each other. ids 1..15,
// nthreads a multiple of 32; "memory": no shared-memory access may be moved across it.
__device__ __forceinline__ void group_barrier(int group, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "r"(nthreads) : "memory");
}
// Sums as trees, not as dependent chains: the compiler may not reassociate float adds, and a chain of 8-32
// FADDs per thread sits on the per-row critical path (its latency, not its issue cost, is what the row waits on).
__device__ __forceinline__ float sum8(const float* f) {
  return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}
// sum_k (f[k] - m)^2 over 8 elements with four independent accumulators (depth 4 instead of 8).
__device__ __forceinline__ float sqdev8(const float* f, float m) {
  float d[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) d[k] = f[k] - m;
  float a0 = d[0] * d[0], a1 = d[1] * d[1], a2 = d[2] * d[2], a3 = d[3] * d[3];
  a0 = fmaf(d[4], d[4], a0); a1 = fmaf(d[5], d[5], a1); a2 = fmaf(d[6], d[6], a2); a3 = fmaf(d[7], d[7], a3);
  return (a0 + a1) + (a2 + a3);
}
// Pairwise sum of N (a power of two) values; v is overwritten.
template <int N>
__device__ __forceinline__ float tree_sum(float* v) {
#pragma unroll
  for (int h = N / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int i = 0; i < h; ++i) v[i] += v[i + h];
  }
  return v[0];
}

// Last step of the deterministic partial-sum reductions (256 threads = 32 columns x 8 lanes): the 8 lanes' sums s
// of one column are added in lane order by lane 0, which writes *out when `valid`. Every thread must call it.
__device__ __forceinline__ void add_lanes8(float (*red)[33], float s, float* out, bool valid) {
  const int lane = threadIdx.x >> 5, c = threadIdx.x & 31;
  red[lane][c] = s;
  __syncthreads();
  if (lane == 0 && valid) {
    float t = 0.f;
    for (int i = 0; i < 8; ++i) t += red[i][c];
    *out = t;
  }
}

// Block-wide sum for the generic (one row per CTA) kernels; blockDim.x is a multiple of 32, <= 1024.
__device__ __forceinline__ float block_sum(float v, float* red /* 32 floats */) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // red may still be read from the previous call
  if (lane == 0) red[w] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < nw; ++i) s += red[i];
  return s;
}

// Launch shape for the vectorized kernels: each row is handled by `wpr` warps, each thread holding
// `vpt` 8-element vectors of it in registers; `rpc` rows (row groups) per CTA. The CTA size is capped
// per vpt (the kernels' __launch_bounds__) so the register cap it implies holds the row without spills.
struct Shape { int vpt, wpr, rpc; };

__host__ __device__ constexpr int fwd_max_threads(int vpt) { return vpt <= 1 ? 1024 : vpt == 2 ? 512 : 256; }
__host__ __device__ constexpr int bwd_max_threads(int vpt) { return vpt <= 1 ? 1024 : 512; }

inline Shape choose_shape(int D, int vpt_override, int rpc_override, bool backward) {
  const int nvec = D / 8;
  const int max_vpt = backward ? 4 : 8;
  // Forward: 4 vectors per thread from D = 2048 (more bytes in flight per thread; measured faster at D = 5120).
  int vpt = vpt_override > 0 ? vpt_override : (nvec <= 32 ? 1 : (!backward && nvec >= 256) ? 4 : 2);
  if (vpt > max_vpt) vpt = max_vpt;
  auto cap = [&](int v) { return backward ? bwd_max_threads(v) : fwd_max_threads(v); };
  int wpr = (nvec + 32 * vpt - 1) / (32 * vpt);
  while (wpr * 32 > cap(vpt) && vpt < max_vpt) { vpt *= 2; wpr = (nvec + 32 * vpt - 1) / (32 * vpt); }
  int rpc = rpc_override > 0 ? rpc_override : (wpr >= 8 ? 1 : 8 / wpr);  // ~256 threads per CTA
  while (rpc > 1 && rpc * wpr * 32 > cap(vpt)) --rpc;
  return Shape{vpt, wpr, rpc};
}

}  // namespace lnmod
