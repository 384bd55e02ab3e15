// Pieces of the compile-time-tiled kernels shared by the per-sample grid (ln_modulate_fast.cu) and the flat
// row space for B >= 2 (ln_modulate_batch.cu): the tile tables, the launch conditions, and the per-row bodies.
#pragma once
#include <type_traits>
#include "ln_modulate_common.cuh"

namespace lnmod {
namespace tiles {

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
// Threads per SM asked of the compiler: 24 warps, 16 when a thread holds 10+ bytes of a row or 16+ bytes of
// rows ahead (register caps that hold them unspilled).
constexpr int fwd_sm_threads(int vpt_bytes, int pf) { return vpt_bytes >= 10 || vpt_bytes * pf >= 16 ? 512 : 768; }

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

// One forward row of a row group: statistics, then y = (x - mean) * rstd * a + t, with mod(i, c, a, t) giving
// 1 + scale and shift of this thread's vector i (element c of the row). xf is the row (this thread's VPT vectors)
// in fp32; `slots` this group's [2 parities][rpc][WPR] merge buffer; y this thread's base in the row; mean /
// rstd where the statistics go (null: not saved).
template <typename TX, int VPT, int WPR, typename Mod>
__device__ __forceinline__ void fwd_row_mod(const float (&xf)[VPT][8], Mod&& mod, float2* slots, int& parity,
                                            int rpc, int group, int tid, float eps, TX* y, float* mean_out,
                                            float* rstd_out) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;
  constexpr float kInvD = 1.f / D, kWarpN = 8.f * VPT * 32;
  const int warp = tid / 32, lane = tid % 32;
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
  const float rstd = rsqrtf(m2 * kInvD + eps);
  if (tid == 0 && mean_out != nullptr) {
    *mean_out = mean;
    *rstd_out = rstd;
  }
  // (x - mean) * rstd, not one FFMA with -mean * rstd: exact also when |mean| >> std.
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = tid * 8 + i * TPR * 8;
    float a[8], t[8], o[8];
    mod(i, c, a, t);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = fmaf((xf[i][k] - mean) * rstd, a[k], t[k]);
    store8(y + i * TPR * 8, o);
  }
}

// The same with the modulation staged in shared memory (mod_a = 1 + scale, mod_t = shift, [D] each).
template <typename TX, int VPT, int WPR>
__device__ __forceinline__ void fwd_row(const float (&xf)[VPT][8], const float* mod_a, const float* mod_t,
                                        float2* slots, int& parity, int rpc, int group, int tid, float eps, TX* y,
                                        float* mean_out, float* rstd_out) {
  fwd_row_mod<TX, VPT, WPR>(xf, [&](int, int c, float* a, float* t) { lds8(mod_a + c, a); lds8(mod_t + c, t); },
                            slots, parity, rpc, group, tid, eps, y, mean_out, rstd_out);
}

// One backward row of a one-group CTA: dz = dy * (1 + scale), dx = rstd * (dz - mean(dz) - xhat * mean(dz *
// xhat)); mod_a(i, a) gives 1 + scale of this thread's vector i, grads(i, dy, xhat) takes dscale = dy * xhat and
// dshift = dy of it (accumulated per column, or stored per token). dz is recomputed in the second pass from the
// packed dy (fewer registers than keeping it). xhat stays in registers for it in bf16; in fp16 it is recomputed
// from the packed x as well: the 8 fp32 xhat per vector made the fp16 kernels of 2 vectors per thread spill (ptxas
// -v: 40-56 bytes at 96 registers, bf16 0-8), and recomputing them is the same arithmetic, so the same bits.
// refill() runs once xr / gr are consumed (the caller's prefetch slot is free then), before the row barrier.
template <typename TX, int VPT, int WPR, typename ModA, typename Grads, typename Refill>
__device__ __forceinline__ void bwd_row_mod(const Pack8<TX> (&xr)[VPT], const Pack8<TX> (&gr)[VPT], float mean,
                                            float rstd, ModA&& mod_a, Grads&& grads, float2* slots, int& parity,
                                            int tid, TX* dx, Refill&& refill) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;
  constexpr float kInvD = 1.f / D;
  constexpr bool kPackedX = std::is_same_v<TX, __half>;  // xhat recomputed from the packed x in pass 2
  const int warp = tid / 32, lane = tid % 32;
  float xh[kPackedX ? 1 : VPT][8], s1[VPT], s2[VPT];
  Pack8<TX> gc[VPT], xc[kPackedX ? VPT : 1];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float xf[8], g[8], a[8];
    float* xhi = xh[kPackedX ? 0 : i];
    if constexpr (kPackedX) xc[i] = xr[i];
    xr[i].get(xf);
    gc[i] = gr[i];
    gc[i].get(g);
    mod_a(i, a);
    float u = 0.f, v = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) xhi[k] = (xf[k] - mean) * rstd;  // exact also when |mean| >> std
    grads(i, g, xhi);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float dz = g[k] * a[k];
      u += dz;
      v = fmaf(dz, xhi[k], v);
    }
    s1[i] = u;
    s2[i] = v;
  }
  refill();
  const float2 sums = rows_sum2<WPR, TPR>(warp_sum2(make_float2(sumn<VPT>(s1), sumn<VPT>(s2))),
                                          slots + parity * WPR, 0, warp, lane);
  parity ^= 1;
  const float c1 = -rstd * sums.x * kInvD, c2 = -rstd * sums.y * kInvD;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float g[8], a[8], o[8];
    float* xhi = xh[kPackedX ? 0 : i];
    if constexpr (kPackedX) {
      float xf[8];
      xc[i].get(xf);
#pragma unroll
      for (int k = 0; k < 8; ++k) xhi[k] = (xf[k] - mean) * rstd;
    }
    gc[i].get(g);
    mod_a(i, a);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = fmaf(g[k] * a[k], rstd, fmaf(xhi[k], c2, c1));
    store8(dx + i * TPR * 8, o);
  }
}

// The same with 1 + scale staged in shared memory (mod_a, [D]) and dscale / dshift accumulated per column.
template <typename TX, int VPT, int WPR, typename Refill>
__device__ __forceinline__ void bwd_row(const Pack8<TX> (&xr)[VPT], const Pack8<TX> (&gr)[VPT], float mean,
                                        float rstd, const float* mod_a, float (&acc_sc)[VPT][8],
                                        float (&acc_sh)[VPT][8], float2* slots, int& parity, int tid, TX* dx,
                                        Refill&& refill) {
  constexpr int TPR = 32 * WPR;
  bwd_row_mod<TX, VPT, WPR>(
      xr, gr, mean, rstd, [&](int i, float* a) { lds8(mod_a + tid * 8 + i * TPR * 8, a); },
      [&](int i, const float* g, const float* xh) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          acc_sc[i][k] = fmaf(g[k], xh[k], acc_sc[i][k]);
          acc_sh[i][k] += g[k];
        }
      },
      slots, parity, tid, dx, refill);
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
// no forward tile. The tuning module (bench/kernel/ln_tuning.set_tile) picks an entry by its index (tests, benchmark).
// Since 2026-12-05 the forward runs on the flat row space in several waves (ln_modulate_batch.cu's fwd_ctas), where
// [3, 2, 1] beat the former D = 1536 default [2, 3, 1] by 1.5-2 points at 8 waves (H100 tile sweep, both dtypes).
constexpr Tile kTiles[] = {{1536, 3, 2, 1}, {1536, 2, 3, 1}, {1536, 6, 1, 1}, {1536, 2, 3, 2}, {1536, 3, 2, 2},
                           {2048, 4, 2, 2}, {2048, 4, 2, 1}, {2048, 2, 4, 1}, {5120, 4, 5, 2}, {5120, 4, 5, 1},
                           {5120, 5, 4, 1}, {5120, 2, 10, 1}, {5120, 4, 5, 3}, {5120, 5, 4, 2}, {5120, 2, 10, 2},
                           {8192, 4, 8, 2}, {8192, 4, 8, 1}, {8192, 8, 4, 1}};
constexpr Tile kBwdTiles[] = {{1536, 2, 3, 1}, {1536, 1, 6, 1}, {1536, 1, 6, 3}, {2048, 2, 4, 1}, {2048, 1, 8, 1},
                              {3072, 1, 12, 1}, {3072, 2, 6, 1}, {4096, 2, 8, 1}, {4096, 1, 16, 1},
                              {5120, 2, 10, 1}, {5120, 1, 20, 1}, {5120, 1, 20, 2}, {8192, 2, 16, 1}};
constexpr int kNumTiles = int(sizeof(kTiles) / sizeof(Tile)), kNumBwdTiles = int(sizeof(kBwdTiles) / sizeof(Tile));

// Index of the tile to run: `pick` when it is an entry for D, the first entry for D when pick < 0, else -1.
template <size_t N>
inline int find_tile(const Tile (&t)[N], int D, int pick) {
  if (pick >= 0) return pick < int(N) && t[pick].D == D ? pick : -1;
  for (int i = 0; i < int(N); ++i)
    if (t[i].D == D) return i;
  return -1;
}

// What the tiles take, forward and backward alike: the default kernel choice, aligned bf16 / fp16 x with
// y / dy in its dtype, fp32 scale staged per sample or globally, no affine, no cp.async row stream, no
// launch-shape override (vpt / rpc overrides tune the general kernels).
template <typename P>
inline bool tiles_apply(const P& p) {
  return p.variant == 0 && p.vectorized && p.x_dtype != kF32 && p.m_dtype == kF32 && p.y_dtype == p.x_dtype &&
         p.weight == nullptr && p.bias == nullptr && p.stages <= 0 && p.vpt <= 0 && p.rpc <= 0;
}
// tok: per-token scale and shift (both read per row; the flat row space only), else per-sample / global ones
// (staged in shared memory).
inline bool fwd_tiles_apply(const FwdParams& p, bool tok) {
  return tiles_apply(p) && (tok ? p.sc_ss != 0 && p.sh_ss != 0 : p.sc_ss == 0 && p.sh_ss == 0);
}
inline bool bwd_tiles_apply(const BwdParams& p, bool tok) {
  const bool modes = tok ? p.sc_ss != 0 && p.sc_mode != kGlobal && p.sc_mode != kPerSample &&
                               p.sh_mode != kGlobal && p.sh_mode != kPerSample
                         : p.sc_ss == 0 && p.sc_mode != kPerToken && p.sh_mode != kPerToken;
  // dres (the residual op's added gradient) is taken by the general kernels only.
  return tiles_apply(p) && modes && !p.recompute && p.mean != nullptr && p.dweight == nullptr && p.dbias == nullptr &&
         p.dres == nullptr;
}
// The flat row space (ln_modulate_batch.cu) may take the backward instead of the per-sample grid: auto (0) for
// B >= 2 where the grid would underfill the wave (batch.cu's grid_fills_wave); the tuning module forces the grid
// (1) or the flat space (2, also at B = 1) for A-B comparison. The forward takes it at every B unless forced (1).
template <typename P>
inline bool flat_rows(const P& p) { return p.batch_path == 2 || (p.batch_path == 0 && p.B >= 2); }

// Kernel pointer of tile index t from family K (K::fwd / K::bwd<TX, VPT, WPR, PF>): a compile-time table walk,
// one instantiation per tile and dtype.
template <typename K, typename TX, bool BWD, int I = 0>
const void* tile_kernel(int t) {
  if constexpr (I >= (BWD ? kNumBwdTiles : kNumTiles)) {
    return nullptr;
  } else {
    constexpr Tile tl = BWD ? kBwdTiles[I] : kTiles[I];
    if (t == I) {
      if constexpr (BWD) return K::template bwd<TX, tl.vpt, tl.wpr, tl.pf>();
      else return K::template fwd<TX, tl.vpt, tl.wpr, tl.pf>();
    }
    return tile_kernel<K, TX, BWD, I + 1>(t);
  }
}

template <typename K, bool BWD>
const void* kernel_for(int x_dtype, int t) {
  switch (x_dtype) {
    case kBF16: return tile_kernel<K, __nv_bfloat16, BWD>(t);
    case kF16: return tile_kernel<K, __half, BWD>(t);
    default: return nullptr;  // fp32 x: the general kernels measured faster (docs/kernel.md)
  }
}

// Launch configuration of a tile kernel; k == nullptr when no tile applies.
struct FastCfg { const void* k; int threads, rpc; size_t smem; };

// Per-token tiles hold the modulation rows ahead in registers (16 fp32 per vector), so only tiles of at most 2
// vectors per thread have them (kTokMaxVpt): the first such tile for D, unless one is picked; -1 if none.
constexpr int kTokMaxVpt = 2;
template <size_t N>
inline int find_tok_tile(const Tile (&t)[N], int D, int pick) {
  if (pick >= 0) return find_tile(t, D, pick) >= 0 && t[pick].vpt <= kTokMaxVpt ? pick : -1;
  for (int i = 0; i < int(N); ++i)
    if (t[i].D == D && t[i].vpt <= kTokMaxVpt) return i;
  return -1;
}

// tok: the per-token kernels (no staged modulation in shared memory).
template <typename K>
FastCfg fwd_tile_cfg(const FwdParams& p, bool tok) {
  FastCfg c{};
  const int t = !fwd_tiles_apply(p, tok) ? -1 : tok ? find_tok_tile(kTiles, p.D, p.tile) : find_tile(kTiles, p.D, p.tile);
  if (t < 0) return c;
  const int tpr = 32 * kTiles[t].wpr;
  c.rpc = fast_rpc(tpr);
  c.threads = tpr * c.rpc;
  c.smem = sizeof(float) * ((tok ? 0 : 2 * size_t(p.D)) + 4 * size_t(c.rpc) * kTiles[t].wpr);
  c.k = kernel_for<K, false>(p.x_dtype, t);
  return c;
}

template <typename K>
FastCfg bwd_tile_cfg(const BwdParams& p, bool tok) {
  FastCfg c{};
  // Per-sample / global: the default tile for D in both dtypes. (Until 2026-12-03 fp16 took a 1-vector tile: its
  // 2-vector kernels spilled 44-56 bytes, at 81-82% of the byte floor where bf16 ran at 96%. They recompute xhat
  // from the packed x now (bwd_row_mod) and spill 0-4 bytes, as bf16's 0-12.)
  const int t = !bwd_tiles_apply(p, tok) ? -1 : tok ? find_tok_tile(kBwdTiles, p.D, p.tile)
                                                    : find_tile(kBwdTiles, p.D, p.tile);
  if (t < 0) return c;
  c.rpc = 1;
  c.threads = 32 * kBwdTiles[t].wpr;
  c.smem = sizeof(float) * ((tok ? 0 : size_t(p.D)) + 4 * size_t(kBwdTiles[t].wpr));
  c.k = kernel_for<K, true>(p.x_dtype, t);
  return c;
}

}  // namespace tiles
}  // namespace lnmod
