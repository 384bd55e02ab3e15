// The compile-time tiles over the flat row space r = b * S + s, the default for B >= 2 (per-sample or global
// fp32 modulation). The per-sample grid (C, B) of ln_modulate_fast.cu gives each sample floor(wave / B) CTAs:
// at B comparable to the wave (B = 300 images against 528-1320 resident CTAs of the D = 1536 tiles) a third to
// a half of the slots stay idle, and past it (B = 600) a second, mostly empty wave doubles the time. Here one
// wave of CTAs splits all B * S rows into contiguous shares that differ by at most one row; where a share
// crosses a sample boundary the CTA restages the modulation (one barrier and one L2 round trip per boundary,
// at most ceil(share / S) + 1 per CTA). The backward flushes its dscale / dshift partial sums per (CTA, sample)
// and a second small kernel sums each sample's partials in a fixed order: deterministic, no atomics.
#include <algorithm>
#include <array>
#include <vector>
#include "ln_modulate_tiles.cuh"

namespace lnmod {
namespace {
using namespace tiles;

// Rows [start(c), start(c + 1)) of CTA c of C over R rows; C <= R, so no share is empty.
__host__ __device__ __forceinline__ int64_t share_start(int64_t c, int64_t R, int64_t C) { return c * R / C; }
// The CTA whose share holds row r: the largest c with start(c) <= r.
__device__ __forceinline__ int64_t share_of(int64_t r, int64_t R, int64_t C) { return ((r + 1) * C + R - 1) / R - 1; }

// TOK: per-token scale / shift rows (read per row, held PF rows ahead in registers like x: 640 threads per SM
// asked of the compiler, a cap that holds them) instead of the sample's modulation staged in shared memory.
template <typename TX, int VPT, int WPR, int PF, bool TOK>
__global__ void __launch_bounds__(32 * WPR * fast_rpc(32 * WPR), min_ctas(32 * WPR * fast_rpc(32 * WPR),
    TOK ? 640 : fwd_sm_threads(VPT * sizeof(TX), PF))) fwd_flat_kernel(FwdParams p) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;
  constexpr int rpc = fast_rpc(TPR), NT = TPR * rpc;  // NT == blockDim.x
  extern __shared__ float smem[];
  float* mod_a = smem;      // [D] 1 + scale of the current sample (!TOK)
  float* mod_t = smem + D;  // [D] shift
  float2* slots = reinterpret_cast<float2*>(smem + (TOK ? 0 : 2 * D));  // [2 parities][rpc][WPR]
  const int group = threadIdx.x / TPR, tid = threadIdx.x % TPR;
  const TX* x = static_cast<const TX*>(p.x) + tid * 8;
  TX* y = static_cast<TX*>(p.y) + tid * 8;
  const int64_t R = p.B * p.S, r0 = share_start(blockIdx.x, R, gridDim.x), r1 = share_start(blockIdx.x + 1, R, gridDim.x);
  Pack8<TX> nxt[PF][VPT];  // ring of the next PF rows of this row group (static indices: unrolled by PF)
  float ma[TOK ? PF : 1][VPT][8], mt[TOK ? PF : 1][VPT][8];  // TOK: their scale and shift rows
  int64_t b = 0;
  auto load_x = [&](int r, int64_t row) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) nxt[r][i].load(x + row * D + i * TPR * 8);
  };
  auto load_mod = [&](int r, int64_t row) {
    if constexpr (TOK) {
      const int64_t s = row - b * p.S;
      const float* sc = static_cast<const float*>(p.scale) + b * p.sc_sb + s * p.sc_ss + tid * 8;
      const float* sh = static_cast<const float*>(p.shift) + b * p.sh_sb + s * p.sh_ss + tid * 8;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        load8(sc + i * TPR * 8, ma[r][i]);
        load8(sh + i * TPR * 8, mt[r][i]);
      }
    }
  };
  int parity = 0;
  for (int64_t a = r0; a < r1;) {  // one segment: this share's rows of sample b
    b = a / p.S;
    const int64_t e = r1 < (b + 1) * p.S ? r1 : (b + 1) * p.S;
    // The segment's first rows go out before the restage and its barriers (registers only: the ring is empty
    // here), so their DRAM round trip overlaps the modulation's.
    int64_t row = a + group;
#pragma unroll
    for (int r = 0; r < PF; ++r)
      if (row + r * rpc < e) { load_x(r, row + r * rpc); load_mod(r, row + r * rpc); }
    if constexpr (!TOK) {
      if (a != r0) __syncthreads();  // every row group is done with the previous sample's modulation
      stage_mod<D, NT>(mod_a, static_cast<const float*>(p.scale) + b * p.sc_sb, 1.f);
      stage_mod<D, NT>(mod_t, static_cast<const float*>(p.shift) + b * p.sh_sb, 0.f);
      __syncthreads();
    }
    while (row < e) {
#pragma unroll
      for (int r = 0; r < PF; ++r, row += rpc) {
        if (row >= e) break;
        float xf[VPT][8];
#pragma unroll
        for (int i = 0; i < VPT; ++i) nxt[r][i].get(xf[i]);
        if (row + PF * rpc < e) load_x(r, row + PF * rpc);
        float* mean = p.mean ? p.mean + row : nullptr;
        float* rstd = p.rstd ? p.rstd + row : nullptr;
        if constexpr (TOK) {
          auto mod = [&](int i, int, float* av, float* tv) {
#pragma unroll
            for (int k = 0; k < 8; ++k) { av[k] = 1.f + ma[r][i][k]; tv[k] = mt[r][i][k]; }
          };
          fwd_row_mod<TX, VPT, WPR>(xf, mod, slots, parity, rpc, group, tid, p.eps, y + row * D, mean, rstd);
          if (row + PF * rpc < e) load_mod(r, row + PF * rpc);  // the slot's modulation is consumed only now
        } else {
          fwd_row<TX, VPT, WPR>(xf, mod_a, mod_t, slots, parity, rpc, group, tid, p.eps, y + row * D, mean, rstd);
        }
      }
    }
    if constexpr (!TOK && WPR > 1) {
      // A group with one row fewer than group 0 in this segment ((len - 1) % rpc < group) passes its named
      // barrier once more, so every warp reaches the next restage's __syncthreads after as many barriers.
      // The restage is fenced by __syncthreads on every path (SASS checked), but compute-sanitizer racecheck
      // reported it racing with the previous segment's lds8 reads exactly where the groups' barrier counts
      // differed (S < rows per CTA); the extra barrier costs one per segment at most.
      if (group > 0 && (e - a - 1) % rpc < group) group_barrier(group, TPR);
    }
    a = e;
  }
}

// Backward over the same shares, one row group per CTA. !TOK: the accumulators are flushed at the end of each
// segment to workspace[q][c * maxseg + k] (k: the segment's index within the CTA) and zeroed. TOK: the scale rows
// come PF rows ahead with x and dy, and dscale / dshift are stored per token.
template <typename TX, int VPT, int WPR, int PF, bool TOK>
__global__ void __launch_bounds__(32 * WPR, min_ctas(32 * WPR, 640)) bwd_flat_kernel(BwdParams p) {
  constexpr int TPR = 32 * WPR, D = 8 * VPT * TPR;  // blockDim.x == TPR
  extern __shared__ float smem[];
  float* mod_a = smem;                                  // [D] 1 + scale of the current sample (!TOK)
  float2* slots = reinterpret_cast<float2*>(smem + (TOK ? 0 : D));  // [2][WPR]
  const int tid = threadIdx.x;
  const TX* x = static_cast<const TX*>(p.x) + tid * 8;
  const TX* dy = static_cast<const TX*>(p.dy) + tid * 8;
  TX* dx = static_cast<TX*>(p.dx) + tid * 8;
  const int64_t R = p.B * p.S, r0 = share_start(blockIdx.x, R, gridDim.x);
  Pack8<TX> xn[PF][VPT], gn[PF][VPT];
  float mean_n[PF], rstd_n[PF], mn[TOK ? PF : 1][VPT][8];  // TOK: scale rows ahead
  int64_t b = 0;
  auto load_row = [&](int r, int64_t row) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      xn[r][i].load(x + row * D + i * TPR * 8);
      gn[r][i].load(dy + row * D + i * TPR * 8);
    }
    mean_n[r] = p.mean[row];
    rstd_n[r] = p.rstd[row];
  };
  auto load_mod = [&](int r, int64_t row) {
    if constexpr (TOK) {
      const float* sc = static_cast<const float*>(p.scale) + b * p.sc_sb + (row - b * p.S) * p.sc_ss + tid * 8;
#pragma unroll
      for (int i = 0; i < VPT; ++i) load8(sc + i * TPR * 8, mn[r][i]);
    }
  };
  int parity = 0;
  // Few registers live across the row loop (the cap is 96): the share's end and the flush address are
  // recomputed per segment from the parameters.
  for (int64_t a = r0, k = 0; a < share_start(blockIdx.x + 1, R, gridDim.x); ++k) {  // ptxas: 8-12 bytes spill
    const int64_t r1 = share_start(blockIdx.x + 1, R, gridDim.x);
    b = a / p.S;
    const int64_t e = r1 < (b + 1) * p.S ? r1 : (b + 1) * p.S;
    // The segment's first rows go out before the restage and its barriers (the ring is empty here).
    int64_t row = a;
#pragma unroll
    for (int r = 0; r < PF; ++r)
      if (row + r < e) { load_row(r, row + r); load_mod(r, row + r); }
    if constexpr (!TOK) {
      if (a != r0) __syncthreads();  // every thread is done with the previous sample's modulation
      stage_mod<D, TPR>(mod_a, static_cast<const float*>(p.scale) + b * p.sc_sb, 1.f);
      __syncthreads();
    }
    float acc_sc[TOK ? 1 : VPT][8], acc_sh[TOK ? 1 : VPT][8];
#pragma unroll
    for (int i = 0; i < (TOK ? 1 : VPT); ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc_sc[i][j] = acc_sh[i][j] = 0.f;
    while (row < e) {
#pragma unroll
      for (int r = 0; r < PF; ++r, ++row) {
        if (row >= e) break;
        auto refill = [&] { if (row + PF < e) load_row(r, row + PF); };
        if constexpr (TOK) {
          auto mod = [&](int i, float* av) {
#pragma unroll
            for (int j = 0; j < 8; ++j) av[j] = 1.f + mn[r][i][j];
          };
          auto grads = [&](int i, const float* g, const float* xh) {
            const int64_t off = row * D + i * TPR * 8 + tid * 8;
            float d[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) d[j] = g[j] * xh[j];
            if (p.dscale_tok != nullptr) store8(static_cast<float*>(p.dscale_tok) + off, d);
            if (p.dshift_tok != nullptr) store8(static_cast<float*>(p.dshift_tok) + off, g);
          };
          bwd_row_mod<TX, VPT, WPR>(xn[r], gn[r], mean_n[r], rstd_n[r], mod, grads, slots, parity, tid, dx + row * D,
                                    refill);
          if (row + PF < e) load_mod(r, row + PF);  // the slot's scale is consumed only now
        } else {
          bwd_row<TX, VPT, WPR>(xn[r], gn[r], mean_n[r], rstd_n[r], mod_a, acc_sc, acc_sh, slots, parity, tid,
                                dx + row * D, refill);
        }
      }
    }
    if constexpr (!TOK) {
      float* part = p.workspace + (int64_t(blockIdx.x) * p.maxseg + k) * D + tid * 8;
      const int64_t q_stride = int64_t(gridDim.x) * p.maxseg * D;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        if (p.sc_mode == kGlobal || p.sc_mode == kPerSample) store8(part + i * TPR * 8, acc_sc[i]);
        if (p.sh_mode == kGlobal || p.sh_mode == kPerSample) store8(part + q_stride + i * TPR * 8, acc_sh[i]);
      }
    }
    a = e;
  }
}

// out[g][d] = the sum of sample g's partials (per_sample), or of all partials (g = 0), in the order of the
// CTAs: 32 columns x 8 lanes per CTA, lane l takes CTAs l, l + 8, ..., then the 8 lanes add in order.
__global__ void __launch_bounds__(256) reduce_flat_kernel(const float* part, float* out, int64_t B, int64_t S, int64_t C,
                                                          int maxseg, int D, bool per_sample) {
  __shared__ float red[8][33];
  const int col = blockIdx.x * 32 + (threadIdx.x & 31), lane = threadIdx.x >> 5;
  const int64_t g = blockIdx.y, R = B * S;
  float s = 0.f;
  if (col < D) {
    if (per_sample) {
      const int64_t c1 = share_of((g + 1) * S - 1, R, C);
      for (int64_t c = share_of(g * S, R, C) + lane; c <= c1; c += 8)
        s += part[(c * maxseg + g - share_start(c, R, C) / S) * D + col];
    } else {
      for (int64_t c = lane; c < C; c += 8) {
        const int64_t nseg = (share_start(c + 1, R, C) - 1) / S - share_start(c, R, C) / S + 1;
        for (int64_t k = 0; k < nseg; ++k) s += part[(c * maxseg + k) * D + col];
      }
    }
  }
  add_lanes8(red, s, out + g * D + col, col < D);
}

template <bool TOK>
struct FlatKernels {  // TOK: only tiles of at most kTokMaxVpt vectors per thread are instantiated
  template <typename TX, int VPT, int WPR, int PF>
  static const void* fwd() {
    if constexpr (TOK && VPT > kTokMaxVpt) return nullptr;
    else return reinterpret_cast<const void*>(fwd_flat_kernel<TX, VPT, WPR, PF, TOK>);
  }
  template <typename TX, int VPT, int WPR, int PF>
  static const void* bwd() {
    if constexpr (TOK && VPT > kTokMaxVpt) return nullptr;
    else return reinterpret_cast<const void*>(bwd_flat_kernel<TX, VPT, WPR, PF, TOK>);
  }
};

// The backward at B >= 2 in auto mode takes the per-sample grid (ln_modulate_fast.cu) instead, where its (C, B)
// CTAs fill the wave:
// its busiest row group's rows within 3% of the flat space's even share (idle slots and the rounding of S to
// C * rpc both count). There it skips the restaging at sample boundaries: at (4, 18900, 5120) bf16 on H200
// (2026-12-01) the grid took 93.5 / 96.8% of the byte floor (fwd / fwd+bwd), the flat space 80.9 / 82.2%.
// The flat kernel's occupancy stands in for the grid's (same launch bounds, threads and shared memory).
bool grid_fills_wave(const FastCfg& c, int64_t B, int64_t S) {
  const int per_sm = cached_occupancy(c.k, c.threads, c.smem);
  const int64_t wave = int64_t(cached_num_sms()) * per_sm, C = persistent_ctas(per_sm, B, S, c.rpc);
  const int64_t busiest = (S + C * c.rpc - 1) / (C * c.rpc);  // rows of the grid's busiest row group
  return double(B) * double(S) >= 0.97 * double(busiest) * double(wave) * c.rpc;
}

// Backward: per-token modulation takes the flat space at every B (there is nothing to stage per sample), unless
// the tuning module asks for the grid (then the general kernels, as before); per-sample / global ones from B = 2
// where the grid would leave the wave underfilled (forced by the tuning module: batch_path 1 / 2).
FastCfg flat_bwd_cfg(const BwdParams& p) {
  if (p.batch_path == 1 || p.B * p.S == 0) return FastCfg{};
  const FastCfg tok = bwd_tile_cfg<FlatKernels<true>>(p, true);
  if (tok.k || !flat_rows(p)) return tok;
  const FastCfg c = bwd_tile_cfg<FlatKernels<false>>(p, false);
  return c.k && p.batch_path == 0 && grid_fills_wave(c, p.B, p.S) ? FastCfg{} : c;
}
// The forward takes the flat row space at every B, B = 1 included, unless the tuning module asks for the grid: with
// its grid in several waves (fwd_ctas) it ran ahead of the one-wave grid at every measured shape (tile sweep on
// the H100, 2026-12-05: D = 1536 small shapes 87 -> 92-94% of the forward's byte floor; docs/kernel.md).
FastCfg fwd_cfg(const FwdParams& p) {
  if (p.batch_path == 1 || p.B * p.S == 0) return FastCfg{};
  const FastCfg tok = fwd_tile_cfg<FlatKernels<true>>(p, true);
  return tok.k ? tok : fwd_tile_cfg<FlatKernels<false>>(p, false);
}
// On the flat row space the backward at D = 1536 takes [1 vector, 6 warps, 3 rows ahead] unless a tile is picked.
// Tile sweep in a stream on the H200 (2026-12-05), per-sample modulation, % of the backward's byte floor at
// 32x1560 / 300x1560: bf16 80.5 / 85.0 against 75.0 / 81.0 for the first tile [2, 3, 1]; fp16 81.3 / 86.2 against
// 80.4 / 87.2. On the grid (B = 2, 8 at 16380 / 4680 rows) [2, 3, 1] stays ahead, 79-81 against 69-73. The choice
// of grid or flat rows is made with the first tile's occupancy, as before.
constexpr int kFlatBwdTile1536 = 2;
static_assert(kBwdTiles[kFlatBwdTile1536].D == 1536 && kBwdTiles[kFlatBwdTile1536].vpt == 1 &&
              kBwdTiles[kFlatBwdTile1536].wpr == 6 && kBwdTiles[kFlatBwdTile1536].pf == 3, "flat backward tile");
FastCfg bwd_cfg(const BwdParams& p) {
  const FastCfg c = flat_bwd_cfg(p);
  if (c.k == nullptr || p.tile >= 0 || p.D != 1536 || !bwd_tiles_apply(p, false)) return c;
  BwdParams q = p;  // per-sample / global modulation on the flat rows: the tile above
  q.tile = kFlatBwdTile1536;
  return bwd_tile_cfg<FlatKernels<false>>(q, false);
}

// One wave: resident CTAs per SM (occupancy of the kernel) x SMs, at most `most`.
int64_t wave_ctas(const FastCfg& c, int64_t most) {
  const int64_t wave = int64_t(cached_num_sms()) * cached_occupancy(c.k, c.threads, c.smem);
  return wave < most ? wave : (most > 0 ? most : 1);
}

// The forward's grid: many short shares rather than one wave of long ones. The hardware hands each SM a new CTA
// as one finishes, so SMs that get less of the DRAM bandwidth simply run fewer CTAs, as a copy kernel's blocks
// do; with one wave the slowest SM's share sets the end (the small shapes' missing 5%). Each CTA restages the
// modulation (2 * D fp32 from L2) and refills its rows-ahead ring, so a share keeps kFwdRowsPerGroup rows per
// row group; at most kFwdMaxWaves waves, at least one. Tile sweeps on the H100 (2026-12-05): 3 rows per group
// beat 1.5 and 5 at 32,760-49,920 rows; at 75,600 x 5120 and 468,000 x 1536 more waves kept gaining up to the
// 64 timed (per-sample, % of the byte floor: 95.8 / 94.4 at 16 waves, 97.5 / 96.0 at 32, 98.2 / 98.4 at 64).
// waves >= 1 (tuning) fixes the grid at that many waves instead.
constexpr int64_t kFwdRowsPerGroup = 3, kFwdMaxWaves = 64;
int64_t fwd_ctas(const FastCfg& c, int64_t R, int waves) {
  const int64_t groups = (R + c.rpc - 1) / c.rpc, wave = wave_ctas(c, groups);
  const int64_t per_rows = (R + c.rpc * kFwdRowsPerGroup - 1) / (c.rpc * kFwdRowsPerGroup);
  const int64_t C = waves >= 1 ? wave * waves : std::clamp(per_rows, wave, kFwdMaxWaves * wave);
  return std::min(C, groups);
}

}  // namespace

bool batch_fwd_launch(const FwdParams& p, cudaStream_t stream, cudaError_t* err) {
  const FastCfg c = fwd_cfg(p);
  if (c.k == nullptr) return false;
  *err = ensure_smem(c.k, c.smem);
  if (*err != cudaSuccess) return true;
  const int64_t C = fwd_ctas(c, p.B * p.S, p.waves);
  void* args[] = {const_cast<FwdParams*>(&p)};
  *err = cudaLaunchKernel(c.k, dim3(unsigned(C)), dim3(c.threads), args, c.smem, stream);
  return true;
}

int64_t batch_bwd_plan(BwdParams& p) {
  const FastCfg c = bwd_cfg(p);
  if (c.k == nullptr) return -1;
  const int64_t R = p.B * p.S, C = wave_ctas(c, R), share = (R + C - 1) / C;
  // A share of L rows starting anywhere in a sample spans at most (L - 1) / S + 2 samples.
  const int64_t segs = (share - 1) / p.S + 2;
  p.ctas_per_sample = int(C);
  p.maxseg = int(segs < p.B ? segs : p.B);
  const bool reduced = p.sc_mode == kGlobal || p.sc_mode == kPerSample || p.sh_mode == kGlobal || p.sh_mode == kPerSample;
  return reduced ? 2 * C * p.maxseg * p.D : 0;  // per-token gradients are written directly
}

bool batch_bwd_launch(const BwdParams& p, cudaStream_t stream, cudaError_t* err) {
  if (p.maxseg <= 0) return false;
  const FastCfg c = bwd_cfg(p);
  if (c.k == nullptr) { *err = cudaErrorInvalidValue; return true; }  // planned flat, so it must apply
  *err = ensure_smem(c.k, c.smem);
  if (*err != cudaSuccess) return true;
  void* args[] = {const_cast<BwdParams*>(&p)};
  *err = cudaLaunchKernel(c.k, dim3(unsigned(p.ctas_per_sample)), dim3(c.threads), args, c.smem, stream);
  const int64_t q_stride = int64_t(p.ctas_per_sample) * p.maxseg * p.D;
  const int modes[2] = {p.sc_mode, p.sh_mode};
  float* outs[2] = {p.dscale_red, p.dshift_red};
  for (int q = 0; q < 2 && *err == cudaSuccess; ++q) {
    if (outs[q] == nullptr || (modes[q] != kGlobal && modes[q] != kPerSample)) continue;
    const bool per_sample = modes[q] == kPerSample;
    const dim3 grid(unsigned((p.D + 31) / 32), unsigned(per_sample ? p.B : 1));
    reduce_flat_kernel<<<grid, 256, 0, stream>>>(p.workspace + q * q_stride, outs[q], p.B, p.S, p.ctas_per_sample,
                                                 p.maxseg, p.D, per_sample);
    *err = cudaGetLastError();
  }
  return true;
}

}  // namespace lnmod
