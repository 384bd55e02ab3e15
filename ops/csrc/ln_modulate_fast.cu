// Fast paths of the fused LayerNorm-Modulate op for the common case: a model width D that splits into full
// tiles of 8-element vectors (D = 256 * VPT * WPR), per-sample or global fp32 modulation, no affine, saved
// statistics, y / dy in x's dtype. Everything that shapes the row is a compile-time constant, so the kernels
// carry no bounds checks, no run-time loops over warps and no per-vector address arithmetic; Nsight Compute
// showed the general kernels spending ~25 (forward) and ~42 (backward) instructions per element on exactly
// that, issue-bound at low occupancy. Inputs outside this case go to the general kernels (ln_modulate_fwd.cu,
// ln_modulate_bwd.cu).
#include <array>
#include <vector>
#include "ln_modulate_common.cuh"

namespace lnmod {
namespace {

// Fixed-order sum of N values (any N): identical in every thread.
template <int N>
__device__ __forceinline__ float sumn(const float* f) {
  float s = f[0];
#pragma unroll
  for (int i = 1; i < N; ++i) s += f[i];
  return s;
}

// dst[c] = add + src[c] for c < D, by NT threads: a compile-time trip count, so the loop unrolls and every
// thread's loads are in flight together (one L2 round trip, not D / NT of them).
template <int D, int NT>
__device__ __forceinline__ void stage_mod(float* dst, const float* src, float add) {
#pragma unroll
  for (int j = 0; j < (D + NT - 1) / NT; ++j) {
    const int c = int(threadIdx.x) + j * NT;
    if (D % NT == 0 || c < D) dst[c] = add + src[c];
  }
}

// Rows per CTA of the forward: about 256 threads, at most 8 row groups (named barriers 1..8). The backward
// takes one row group per CTA (its tiles are >= 192 threads), so its partial sums need no combining.
__host__ __device__ constexpr int fast_rpc(int tpr) { return tpr >= 256 ? 1 : (256 / tpr > 8 ? 8 : 256 / tpr); }
// Resident CTAs per SM asked of the compiler (__launch_bounds__' second argument): `threads` warps' worth.
constexpr int min_ctas(int cta_threads, int threads) { return threads / cta_threads > 1 ? threads / cta_threads : 1; }

// Sum over the WPR warps of a row group of each warp's value v (lane 0's is used): through shared memory
// `slot` (WPR entries), after the row barrier. Few warps: every thread adds the slots in order; many: lane w
// takes slot w and a butterfly adds them (commutative steps, so every lane and warp gets the same bits).
template <int WPR, int TPR>
__device__ __forceinline__ float2 rows_sum2(float2 v, float2* slot, int group, int warp, int lane) {
  if (WPR == 1) return v;
  if (lane == 0) slot[warp] = v;
  group_barrier(group, TPR);
  if constexpr (WPR <= 6) {
    float2 s = slot[0];
#pragma unroll
    for (int w = 1; w < WPR; ++w) { const float2 t = slot[w]; s.x += t.x; s.y += t.y; }
    return s;
  } else {
    return warp_sum2(lane < WPR ? slot[lane] : make_float2(0.f, 0.f));
  }
}


// Threads per SM asked of the compiler: 24 warps, 16 when a thread holds 10+ bytes of a row or 16+ bytes of
// rows ahead (register caps that hold them unspilled).
constexpr int fwd_sm_threads(int vpt_bytes, int pf) { return vpt_bytes >= 10 || vpt_bytes * pf >= 16 ? 512 : 768; }
// PF rows in flight per row group (the next PF rows are loaded while one is reduced and written): bf16 rows
// carry half the bytes of fp32 ones for the same work, so one row ahead may not cover the memory latency.
template <typename TX, int VPT, int WPR, int PF>
__global__ void __launch_bounds__(32 * WPR * fast_rpc(32 * WPR),
    min_ctas(32 * WPR * fast_rpc(32 * WPR), fwd_sm_threads(VPT * sizeof(TX), PF))) fwd_fast_kernel(FwdParams p) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;
  constexpr float kInvD = 1.f / D, kWarpN = 8.f * VPT * 32;
  extern __shared__ float smem[];
  float* mod_a = smem;      // [D] 1 + scale
  float* mod_t = smem + D;  // [D] shift
  float2* slots = reinterpret_cast<float2*>(smem + 2 * D);  // [2 parities][rpc][WPR] (warp mean, warp M2)
  constexpr int rpc = fast_rpc(TPR), NT = TPR * rpc;  // NT == blockDim.x
  const int group = threadIdx.x / TPR, tid = threadIdx.x % TPR, warp = tid / 32, lane = tid % 32;
  const int64_t b = blockIdx.y;
  // This thread's vectors of a row are at tid * 8 + i * TPR * 8: one base pointer, immediate offsets.
  const TX* x = static_cast<const TX*>(p.x) + b * p.S * D + tid * 8;
  TX* y = static_cast<TX*>(p.y) + b * p.S * D + tid * 8;
  const int64_t step = int64_t(gridDim.x) * rpc;
  int64_t si = int64_t(blockIdx.x) * rpc + group;
  Pack8<TX> nxt[PF][VPT];  // ring of the next PF rows, indexed statically (the loop below is unrolled by PF)
  auto load_row = [&](int r, int64_t row) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) nxt[r][i].load(x + row * D + i * TPR * 8);
  };
  // The modulation's staging is one L2 round trip (unrolled), and the first rows are requested before the
  // barrier that waits for it.
  stage_mod<D, NT>(mod_a, static_cast<const float*>(p.scale) + b * p.sc_sb, 1.f);
  stage_mod<D, NT>(mod_t, static_cast<const float*>(p.shift) + b * p.sh_sb, 0.f);
#pragma unroll
  for (int r = 0; r < PF; ++r)
    if (si + r * step < p.S) load_row(r, si + r * step);
  __syncthreads();
  int parity = 0;
  while (si < p.S) {
#pragma unroll
    for (int r = 0; r < PF; ++r, si += step) {
      if (si >= p.S) break;
      float xf[VPT][8];
#pragma unroll
      for (int i = 0; i < VPT; ++i) nxt[r][i].get(xf[i]);
      if (si + PF * step < p.S) load_row(r, si + PF * step);  // refill the slot while this row is reduced and written
      // Exact two-pass statistics per warp, then one barrier to merge the warps (equal counts: Chan's formula
      // reduces to the mean of the warp means plus the spread of the warp means).
      float part[VPT];
#pragma unroll
      for (int i = 0; i < VPT; ++i) part[i] = sum8(xf[i]);
      const float wmean = warp_sum(sumn<VPT>(part)) * (1.f / kWarpN);
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float d = xf[i][k] - wmean;
          q = fmaf(d, d, q);
        }
        part[i] = q;
      }
      const float wm2 = warp_sum(sumn<VPT>(part));
      float mean = wmean, m2 = wm2;
      if (WPR > 1) {
        float2* slot = slots + (parity * rpc + group) * WPR;
        const float2 tot = rows_sum2<WPR, TPR>(make_float2(wmean, wm2), slot, group, warp, lane);
        mean = tot.x * (1.f / WPR);
        float spread = 0.f;  // the warp means' spread about the row mean (read back after the barrier)
        if constexpr (WPR <= 6) {
#pragma unroll
          for (int w = 0; w < WPR; ++w) { const float d = slot[w].x - mean; spread = fmaf(d, d, spread); }
        } else {
          const float d = lane < WPR ? slot[lane].x - mean : 0.f;
          spread = warp_sum(d * d);
        }
        m2 = fmaf(kWarpN, spread, tot.y);
        parity ^= 1;  // the next row writes the other buffer: one barrier per row suffices
      }
      const float rstd = rsqrtf(m2 * kInvD + p.eps);
      if (tid == 0 && p.mean != nullptr) {
        p.mean[b * p.S + si] = mean;
        p.rstd[b * p.S + si] = rstd;
      }
      // (x - mean) * rstd, not one FFMA with -mean * rstd: exact also when |mean| >> std.
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid * 8 + i * TPR * 8;
        float a[8], t[8], o[8];
        lds8(mod_a + c, a);
        lds8(mod_t + c, t);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = fmaf((xf[i][k] - mean) * rstd, a[k], t[k]);
        store8(y + si * D + i * TPR * 8, o);
      }
    }
  }
}

// Backward: dshift = dy, dscale = dy * xhat, dz = dy * (1 + scale), dx = rstd * (dz - mean(dz) - xhat *
// mean(dz * xhat)). Each thread owns fixed columns and accumulates dscale / dshift over its rows in registers
// (2 * 8 * VPT of them, which is why the backward prefers few vectors per thread); the next row's x, dy and
// statistics are loaded PF rows ahead; one barrier per row merges the two row sums. Partial sums go to the workspace
// exactly as the general kernel writes them (the same reduce kernel finishes them).
// At least 20 warps per SM: the register cap this implies (e.g. 102 at 320 threads).
template <typename TX, int VPT, int WPR, int PF>
__global__ void __launch_bounds__(32 * WPR, min_ctas(32 * WPR, 640)) bwd_fast_kernel(BwdParams p) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;  // one row group per CTA: blockDim.x == TPR
  constexpr float kInvD = 1.f / D;
  extern __shared__ float smem[];
  float* mod_a = smem;                                      // [D] 1 + scale
  float2* slots = reinterpret_cast<float2*>(smem + D);      // [2][WPR]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t b = blockIdx.y;
  const float* sc = static_cast<const float*>(p.scale) + b * p.sc_sb;
  for (int c = tid; c < D; c += TPR) mod_a[c] = 1.f + sc[c];
  __syncthreads();
  const int64_t off = b * p.S * D + tid * 8;
  const TX* x = static_cast<const TX*>(p.x) + off;
  const TX* dy = static_cast<const TX*>(p.dy) + off;
  TX* dx = static_cast<TX*>(p.dx) + off;
  const float* mean_p = p.mean + b * p.S;
  const float* rstd_p = p.rstd + b * p.S;
  float acc_sc[VPT][8], acc_sh[VPT][8];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc_sc[i][k] = acc_sh[i][k] = 0.f;
  const int64_t step = gridDim.x;
  int64_t si = blockIdx.x;
  Pack8<TX> xn[PF][VPT], gn[PF][VPT];  // ring of the next PF rows of x and dy (static indices: unrolled by PF)
  float mean_n[PF], rstd_n[PF];
  auto load_row = [&](int r, int64_t row) {  // slot r <- x, dy and statistics of `row` (r a constant)
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      xn[r][i].load(x + row * D + i * TPR * 8);
      gn[r][i].load(dy + row * D + i * TPR * 8);
    }
    mean_n[r] = mean_p[row];
    rstd_n[r] = rstd_p[row];
  };
#pragma unroll
  for (int r = 0; r < PF; ++r)
    if (si + r * step < p.S) load_row(r, si + r * step);
  int parity = 0;
  while (si < p.S) {
#pragma unroll
    for (int r = 0; r < PF; ++r, si += step) {
      if (si >= p.S) break;
      // xhat stays in registers for the second pass; dz is recomputed there from the packed dy (fewer
      // registers than keeping it: the row, the rows ahead and the accumulators must fit without spills).
      float xh[VPT][8], s1[VPT], s2[VPT];
      Pack8<TX> gc[VPT];
      const float rstd = rstd_n[r], mean = mean_n[r];
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        float xf[8], g[8], a[8];
        xn[r][i].get(xf);
        gc[i] = gn[r][i];
        gc[i].get(g);
        lds8(mod_a + tid * 8 + i * TPR * 8, a);
        float u = 0.f, v = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          xh[i][k] = (xf[k] - mean) * rstd;  // exact also when |mean| >> std
          acc_sc[i][k] = fmaf(g[k], xh[i][k], acc_sc[i][k]);
          acc_sh[i][k] += g[k];
          const float dz = g[k] * a[k];
          u += dz;
          v = fmaf(dz, xh[i][k], v);
        }
        s1[i] = u;
        s2[i] = v;
      }
      if (si + PF * step < p.S) load_row(r, si + PF * step);  // refill the slot with the row PF steps ahead
      const float2 sums = rows_sum2<WPR, TPR>(warp_sum2(make_float2(sumn<VPT>(s1), sumn<VPT>(s2))),
                                              slots + parity * WPR, 0, warp, lane);
      parity ^= 1;
      const float c1 = -rstd * sums.x * kInvD, c2 = -rstd * sums.y * kInvD;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        float g[8], a[8], o[8];
        gc[i].get(g);
        lds8(mod_a + tid * 8 + i * TPR * 8, a);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = fmaf(g[k] * a[k], rstd, fmaf(xh[i][k], c2, c1));
        store8(dx + si * D + i * TPR * 8, o);
      }
    }
  }
  // This CTA's partial sums: one row per quantity in the workspace (the layout the reduce kernel reads).
  float* part = p.workspace + (b * gridDim.x + blockIdx.x) * int64_t(D);
  const int64_t q_stride = p.B * int64_t(gridDim.x) * D;
  if (p.sc_mode == kGlobal || p.sc_mode == kPerSample) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) store8(part + tid * 8 + i * TPR * 8, acc_sc[i]);
  }
  if (p.sh_mode == kGlobal || p.sh_mode == kPerSample) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) store8(part + q_stride + tid * 8 + i * TPR * 8, acc_sh[i]);
  }
}

// (VPT, WPR, rows ahead) tilings per D, the first being the default.
struct Tile { int D, vpt, wpr, pf; };
// The forward holds a row as 8 * VPT fp32 registers plus the PF rows ahead packed; the backward holds
// 3 * 8 * VPT fp32 registers (xhat and the two accumulators) plus 2 * PF packed rows, so it takes VPT <= 2,
// one row group per CTA. The defaults are the fastest measured on H200 (2026-11-30, docs/kernel.md; S = 75,600
// at D = 5120, 32,760 elsewhere): in the backward 2 vectors per thread (twice the bytes in flight per warp)
// took 10-22% less time than 1 at D = 1536, 2048, 4096 and 5120, 1% more at 3072; in the forward a second
// row ahead took 1.5-4% less at 2048, 5120 and 8192, not less at 1536 and 3072. At D = 3072 and 4096 the
// general forward (fwd_v1_kernel) beat every tile (84-85% of copy bandwidth against 82-83%), so they have
// no forward tile. op.set_tile(f, b) picks an entry by its index (tuning, tests).
constexpr Tile kTiles[] = {{1536, 2, 3, 1}, {1536, 3, 2, 1}, {1536, 6, 1, 1}, {1536, 2, 3, 2}, {1536, 3, 2, 2},
                           {2048, 4, 2, 2}, {2048, 4, 2, 1}, {2048, 2, 4, 1}, {5120, 4, 5, 2}, {5120, 4, 5, 1},
                           {5120, 5, 4, 1}, {5120, 2, 10, 1}, {5120, 4, 5, 3}, {5120, 5, 4, 2}, {5120, 2, 10, 2},
                           {8192, 4, 8, 2}, {8192, 4, 8, 1}, {8192, 8, 4, 1}};
constexpr Tile kBwdTiles[] = {{1536, 2, 3, 1}, {1536, 1, 6, 1}, {1536, 1, 6, 3}, {2048, 2, 4, 1}, {2048, 1, 8, 1},
                              {3072, 1, 12, 1}, {3072, 2, 6, 1}, {4096, 2, 8, 1}, {4096, 1, 16, 1},
                              {5120, 2, 10, 1}, {5120, 1, 20, 1}, {5120, 1, 20, 2}, {8192, 2, 16, 1}};

// Index of the tile to run: `pick` when it is an entry for D, the first entry for D when pick < 0, else -1.
template <size_t N>
int find_tile(const Tile (&tiles)[N], int D, int pick) {
  if (pick >= 0) return pick < int(N) && tiles[pick].D == D ? pick : -1;
  for (int i = 0; i < int(N); ++i)
    if (tiles[i].D == D) return i;
  return -1;
}

// Kernel pointer for tile index t (a compile-time table walk: one instantiation per tile and dtype).
template <typename TX, bool BWD, int I = 0>
const void* tile_kernel(int t) {
  constexpr int n = BWD ? int(sizeof(kBwdTiles) / sizeof(Tile)) : int(sizeof(kTiles) / sizeof(Tile));
  if constexpr (I >= n) {
    return nullptr;
  } else {
    constexpr Tile tl = BWD ? kBwdTiles[I] : kTiles[I];
    if (t == I) {
      if constexpr (BWD) return reinterpret_cast<const void*>(bwd_fast_kernel<TX, tl.vpt, tl.wpr, tl.pf>);
      else return reinterpret_cast<const void*>(fwd_fast_kernel<TX, tl.vpt, tl.wpr, tl.pf>);
    }
    return tile_kernel<TX, BWD, I + 1>(t);
  }
}

template <bool BWD>
const void* kernel_for(int x_dtype, int t) {
  switch (x_dtype) {
    case kBF16: return tile_kernel<__nv_bfloat16, BWD>(t);
    case kF16: return tile_kernel<__half, BWD>(t);
    default: return nullptr;  // fp32 x: the general kernels measured faster (docs/kernel.md)
  }
}

struct FastCfg { const void* k; int threads, rpc; size_t smem; };

// What the tiles take, forward and backward alike: the default kernel choice, aligned bf16 / fp16 x with
// y / dy in its dtype, fp32 scale staged per sample or globally, no affine, no cp.async row stream, no
// launch-shape override (vpt / rpc overrides tune the general kernels).
template <typename P>
bool tiles_apply(const P& p) {
  return p.variant == 0 && p.vectorized && p.x_dtype != kF32 && p.m_dtype == kF32 && p.y_dtype == p.x_dtype &&
         p.weight == nullptr && p.bias == nullptr && p.sc_ss == 0 && p.stages <= 0 && p.vpt <= 0 && p.rpc <= 0;
}

FastCfg fwd_cfg(const FwdParams& p) {
  FastCfg c{};
  const bool ok = tiles_apply(p) && p.sh_ss == 0;
  const int t = ok ? find_tile(kTiles, p.D, p.tile) : -1;
  if (t < 0) return c;
  const int tpr = 32 * kTiles[t].wpr;
  c.rpc = fast_rpc(tpr);
  c.threads = tpr * c.rpc;
  c.smem = sizeof(float) * (2 * size_t(p.D) + 4 * size_t(c.rpc) * kTiles[t].wpr);
  c.k = kernel_for<false>(p.x_dtype, t);
  return c;
}

FastCfg bwd_cfg(const BwdParams& p) {
  FastCfg c{};
  const bool ok = tiles_apply(p) && !p.recompute && p.mean != nullptr && p.sc_mode != kPerToken &&
                  p.sh_mode != kPerToken && p.dweight == nullptr && p.dbias == nullptr;
  const int t = ok ? find_tile(kBwdTiles, p.D, p.tile) : -1;
  if (t < 0) return c;
  c.rpc = 1;
  c.threads = 32 * kBwdTiles[t].wpr;
  c.smem = sizeof(float) * (size_t(p.D) + 4 * size_t(kBwdTiles[t].wpr));
  c.k = kernel_for<true>(p.x_dtype, t);
  return c;
}

}  // namespace

bool fast_fwd_launch(const FwdParams& p, cudaStream_t stream, cudaError_t* err) {
  const FastCfg c = fwd_cfg(p);
  if (c.k == nullptr) return false;
  void* args[] = {const_cast<FwdParams*>(&p)};
  *err = launch_persistent(c.k, c.threads, c.smem, c.rpc, p.B, p.S, args, stream);
  return true;
}

std::vector<std::array<int, 4>> fast_tiles(bool backward) {
  std::vector<std::array<int, 4>> out;
  if (backward) for (const Tile& t : kBwdTiles) out.push_back({t.D, t.vpt, t.wpr, t.pf});
  else for (const Tile& t : kTiles) out.push_back({t.D, t.vpt, t.wpr, t.pf});
  return out;
}

bool fast_bwd_occupancy(const BwdParams& p, int* per_sm, int* rpc) {
  const FastCfg c = bwd_cfg(p);
  if (c.k == nullptr) return false;
  *per_sm = cached_occupancy(c.k, c.threads, c.smem);
  *rpc = c.rpc;
  return true;
}

bool fast_bwd_launch(const BwdParams& p, cudaStream_t stream, cudaError_t* err) {
  const FastCfg c = bwd_cfg(p);
  if (c.k == nullptr) return false;
  *err = ensure_smem(c.k, c.smem);
  if (*err != cudaSuccess) return true;
  void* args[] = {const_cast<BwdParams*>(&p)};
  *err = cudaLaunchKernel(c.k, dim3(unsigned(p.ctas_per_sample), unsigned(p.B)), dim3(c.threads), args, c.smem, stream);
  return true;
}

}  // namespace lnmod
