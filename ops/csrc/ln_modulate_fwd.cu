// Forward kernels of the fused LayerNorm-Modulate op (see ln_modulate.h for the contract).
#include "ln_modulate_common.cuh"

namespace lnmod {

// Vectorized path (D % 8 == 0, 16-byte aligned rows): the row lives in registers, so x is read once
// and y written once (the byte floor); mean and variance are two passes over registers (stable).
// Persistent grid (C, B): a CTA stays in one sample, so per-sample / global modulation is staged once in
// shared memory as (1 + scale, shift) instead of being re-read from L1/L2 for every row.
// Row stream, two variants:
//  - PIPE (opt-in, stages >= 2; measured slower on H200, see docs/kernel.md): each thread cp.async-copies
//    its vectors of the next `nst` rows of its row group into a shared-memory ring (nst * rpc rows), so nst rows per row group are in flight without using registers;
//    a stage is refilled right after its data has been read into registers and reduced.
//  - !PIPE (default): the next row is prefetched into registers (two rows per thread in flight).
// PIPE register caps: 72 at vpt 2 (three 288-320-thread CTAs per SM), 96 at vpt 4 (two 320-thread CTAs).
// !PIPE: the caps its launch bounds imply (the __maxnreg__ only makes PIPE and !PIPE share one declaration).
template <typename TX, typename TM, typename TY, int VPT, bool PIPE>
__global__ void __launch_bounds__(PIPE ? 512 : fwd_max_threads(VPT))
__maxnreg__(PIPE ? (VPT == 1 ? 64 : VPT == 2 ? 72 : VPT == 4 ? 96 : 168) : (VPT <= 1 ? 64 : VPT == 2 ? 128 : 255)) fwd_vec_kernel(FwdParams p, int wpr, bool stage, int nst) {
  extern __shared__ float smem[];
  const int tpr = wpr * 32;
  const int rpc = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, tid = threadIdx.x % tpr;
  float* slot_a = smem + group * wpr;
  float* slot_b = smem + (rpc + group) * wpr;
  float* mod_a = smem + ((2 * rpc * wpr + 3) & ~3);  // [D] 1 + scale (when staged)
  float* mod_t = mod_a + p.D;                         // [D] shift
  TX* ring = reinterpret_cast<TX*>(mod_a + (stage ? 2 * p.D : 0));  // [nst][rpc][D] (PIPE), 16-byte aligned
  const int nvec = p.D / 8;
  const float inv_d = 1.f / p.D;
  const bool affine = p.weight != nullptr || p.bias != nullptr;
  const int64_t b = blockIdx.y;
  const int64_t step = int64_t(gridDim.x) * rpc;
  const TX* x = static_cast<const TX*>(p.x);
  const TM* sc = static_cast<const TM*>(p.scale);
  const TM* sh = static_cast<const TM*>(p.shift);
  TY* y = static_cast<TY*>(p.y);
  if (stage) {
    for (int col = threadIdx.x; col < p.D; col += blockDim.x) {
      mod_a[col] = 1.f + to_f(sc[b * p.sc_sb + col]);
      mod_t[col] = to_f(sh[b * p.sh_sb + col]);
    }
    __syncthreads();
  }
  // PIPE: copy this thread's vectors of row si into ring stage st; always one commit (uniform group count).
  auto issue = [&](int64_t si, int st) {
    if (si < p.S) {
      const TX* src = x + (b * p.S + si) * p.D;
      TX* dst = ring + (int64_t(st) * rpc + group) * p.D;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (c < nvec) cp_async8(dst + c * 8, src + int64_t(c) * 8);
      }
    }
    cp_async_commit();
  };

  Pack8<TX> cur[VPT], nxt[VPT];
  int64_t si = int64_t(blockIdx.x) * rpc + group;
  if (PIPE) {
    for (int k = 0; k < nst; ++k) issue(si + k * step, k);
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = tid + i * tpr;
      if (si < p.S && c < nvec) cur[i].load(x + (b * p.S + si) * p.D + int64_t(c) * 8);
      else cur[i].zero();
    }
  }
  int st = 0;
  for (int64_t s0 = int64_t(blockIdx.x) * rpc; s0 < p.S; s0 += step, st = (st + 1 == nst ? 0 : st + 1)) {
    si = s0 + group;
    const bool valid = si < p.S;
    const int64_t row = b * p.S + si;
    const int64_t sn = si + step;
    if (PIPE) {
      cp_async_wait(nst - 1);  // this thread's copies of row si have landed
      const TX* src = ring + (int64_t(st) * rpc + group) * p.D;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (valid && c < nvec) cur[i].lds(src + c * 8);
        else cur[i].zero();
      }
    } else {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {  // prefetch the next row
        const int c = tid + i * tpr;
        if (sn < p.S && c < nvec) nxt[i].load(x + (row + step) * p.D + int64_t(c) * 8);
        else nxt[i].zero();
      }
    }
    // Unpack the row once (the sum, the variance and the output all read it): the packed -> fp32 shifts
    // were a third of the per-element instructions when done per pass.
    float xf[VPT][8];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      cur[i].get(xf[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) s += xf[i][k];
    }
    const float mean = group_sum(s, slot_a, wpr) * inv_d;
    // The stage's values were consumed by the sum above: refill it with the row nst steps ahead.
    if (PIPE) issue(si + nst * step, st);
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (valid && tid + i * tpr < nvec) {
#pragma unroll
        for (int k = 0; k < 8; ++k) { const float d = xf[i][k] - mean; q += d * d; }
      }
    }
    const float rstd = rsqrtf(group_sum(q, slot_b, wpr) * inv_d + p.eps);
    if (valid) {
      if (tid == 0 && p.mean != nullptr) { p.mean[row] = mean; p.rstd[row] = rstd; }
      const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
      const TM* shr = sh + b * p.sh_sb + si * p.sh_ss;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (c < nvec) {
          float a[8], t[8], o[8];
          if (stage) {
            lds8(mod_a + c * 8, a);
            lds8(mod_t + c * 8, t);
          } else {
            load8(scr + c * 8, a);
            load8(shr + c * 8, t);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] += 1.f;
          }
          if (affine) {  // uniform branch: the plain LN path does not multiply by 1 and add 0 per element
            float w[8], bb[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) { w[k] = 1.f; bb[k] = 0.f; }
            if (p.weight != nullptr) load8(p.weight + c * 8, w);
            if (p.bias != nullptr) load8(p.bias + c * 8, bb);
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = ((xf[i][k] - mean) * rstd * w[k] + bb[k]) * a[k] + t[k];
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = (xf[i][k] - mean) * rstd * a[k] + t[k];
          }
          store8(y + row * p.D + int64_t(c) * 8, o);
        }
      }
    }
    if (!PIPE) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) cur[i] = nxt[i];
    }
  }
  if (PIPE) cp_async_wait(0);  // no copy may still target this CTA's shared memory when it exits
}

// --- General 2-byte forward (fwd_v1_kernel): the default for bf16 / fp16 x where the compile-time tiles of
// ln_modulate_fast.cu do not apply (per-token modulation, affine, other widths); fwd_vec_kernel above stays
// the fp32 path (it measured faster there) and the set_variant(2) baseline. Measured on H200 (2026-11-30,
// docs/kernel.md): 87% of copy bandwidth at (1, 75600, 5120) bf16 against fwd_vec_kernel's 74%.
// Same row-in-registers scheme as fwd_vec_kernel (row unpacked once to fp32, next row prefetched into packed
// registers, persistent grid (C, B)), aimed at the per-row latency that the H200 measurements point to
// (docs/kernel.md, "Where the time goes") rather than at bytes in flight:
//  - ONE barrier per row instead of two: each warp computes exact two-pass statistics of its own elements
//    (warp sum -> warp mean, then M2 = sum (x - warp mean)^2, both by shuffles), lane 0 publishes
//    (sum, mean, M2, count) of its warp, one barrier, then every thread merges the wpr warp results in the
//    same fixed order: mean = (sum of the warp sums) / D, M2 = sum_w [M2_w + n_w (mean_w - mean)^2] (the
//    k-way form of Chan et al.'s pairwise merge, evaluated in one pass over the slots, see below; no
//    division per warp, and no sum of squares of raw x, so a large common offset of x does not cancel
//    catastrophically). Identical order in every thread -> identical mean/rstd in all of them.
//  - That barrier is a named barrier of the row group (bar.sync 1 + group, tpr threads) when rpc <= 15, so
//    the row groups of a CTA do not wait for each other; the slots alternate between two buffers so that one
//    barrier per row suffices (a buffer is rewritten only after the next row's barrier, which every reader
//    of it has passed).
//  - Sums as trees / independent accumulators (sum8, sqdev8, tree_sum) instead of dependent FADD chains.
//  - Modulation, by MOD (a template flag, so the register demand of one path does not lower the occupancy of
//    the other; affine weight/bias are folded in once per CTA where the modulation is staged:
//    A = (1 + scale) * w, T = (1 + scale) * b + shift, so y = xhat * A + T):
//      kModSmem: per-sample / global modulation staged in shared memory once per CTA;
//      kModRow: per-token modulation read from global per row; for VPT <= 4 the reads are issued at the
//        start of the row (packed registers) so their latency hides behind the reduction.
// Tried and measured no faster (2026-11-30), so not kept: staged modulation held in registers (VPT <= 2) and
// an 80-register cap at VPT 4 (5 CTAs per SM, small spill). The cp.async row stream (set_stages) is not
// implemented here: with stages > 0 the forward takes fwd_vec_kernel.
enum FwdMod : int { kModSmem = 0, kModRow = 1 };

// Register caps. Without them ptxas hoists the output pass's loads (modulation, weight) above the
// reduction when the launch bound allows 255 registers (VPT 4: ~110 registers where ~85 suffice), which
// costs resident CTAs. VPT 4 with staged modulation (D = 2048..8192): 88 registers are spill-free for
// 2-byte x (fp32 x: 96); at D = 5120 (160 threads, 40 KB of staged modulation per CTA) that is 4 CTAs per SM.
__host__ __device__ constexpr int fwd_v1_maxreg(int vpt, int mod, int xbytes) {
  return vpt <= 1   ? 64
         : vpt == 2 ? (mod == kModSmem ? 64 : 128)
         : vpt == 4 ? (mod == kModSmem ? (xbytes == 4 ? 96 : 88) : 168)
                    : 255;
}

template <typename TX, typename TM, typename TY, int VPT, int MOD>
__global__ void __launch_bounds__(fwd_max_threads(VPT)) __maxnreg__(fwd_v1_maxreg(VPT, MOD, int(sizeof(TX))))
fwd_v1_kernel(FwdParams p, int wpr) {
  extern __shared__ float4 smem_v1[];
  const int tpr = wpr * 32;
  const int rpc = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, tid = threadIdx.x % tpr;
  const int lane = tid & 31, wig = tid >> 5;  // warp in its row group
  // Per-warp statistics (sum, mean, M2, count), two buffers [2][rpc][wpr]; then (kModSmem) A[D], T[D].
  float4* slot0 = smem_v1 + group * wpr;
  float4* slot1 = smem_v1 + (rpc + group) * wpr;
  float* mod_a = reinterpret_cast<float*>(smem_v1 + 2 * rpc * wpr);
  float* mod_t = mod_a + p.D;
  const bool named = rpc <= 15;  // named barrier ids 1..15; else __syncthreads (same effect, all groups)
  const int nvec = p.D / 8;
  const float inv_d = 1.f / p.D;
  const int64_t b = blockIdx.y;
  const int64_t step = int64_t(gridDim.x) * rpc;
  const TX* x = static_cast<const TX*>(p.x);
  const TM* sc = static_cast<const TM*>(p.scale);
  const TM* sh = static_cast<const TM*>(p.shift);
  TY* y = static_cast<TY*>(p.y);
  const bool affine = p.weight != nullptr || p.bias != nullptr;
  constexpr bool kSmem = MOD == kModSmem;

  // Elements of this thread's warp (row-invariant): vectors c = tid + i * tpr < nvec over the warp's lanes.
  int wvec = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) wvec += min(max(nvec - i * tpr - 32 * wig, 0), 32);
  const float n_w = 8.f * wvec;
  const float inv_nw = wvec > 0 ? 1.f / n_w : 0.f;  // a warp without elements publishes (0, 0, 0, 0)

  // Folded modulation A = (1 + scale) [* w], T = shift [+ (1 + scale) * b] of column col (staged modes).
  auto folded = [&](int col, float& A, float& T) {
    const float a = 1.f + to_f(sc[b * p.sc_sb + col]);
    A = p.weight != nullptr ? a * p.weight[col] : a;
    T = p.bias != nullptr ? fmaf(a, p.bias[col], to_f(sh[b * p.sh_sb + col])) : to_f(sh[b * p.sh_sb + col]);
  };
  if constexpr (kSmem) {
    for (int col = threadIdx.x; col < p.D; col += blockDim.x) folded(col, mod_a[col], mod_t[col]);
    __syncthreads();
  }
  // kModRow: this row's scale / shift vectors, read at the start of the row (packed).
  constexpr bool kEarlyMod = MOD == kModRow && VPT <= 4;
  Pack8<TM> psc[kEarlyMod ? VPT : 1], psh[kEarlyMod ? VPT : 1];

  // This thread's first element of its group's current row in x and y, advanced by whole rows (64-bit
  // offsets; pointers rather than row indices keep the loop's integer registers few).
  const int64_t rstep = step * p.D;
  const int vs = tpr * 8;  // elements between a thread's vectors
  int64_t si = int64_t(blockIdx.x) * rpc + group;
  const TX* xr = x + (b * p.S + si) * p.D + tid * 8;
  TY* yr = y + (b * p.S + si) * p.D + tid * 8;
  Pack8<TX> cur[VPT], nxt[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (si < p.S && tid + i * tpr < nvec) cur[i].load(xr + i * vs);
    else cur[i].zero();
  }
  int buf = 0;
  for (int64_t s0 = int64_t(blockIdx.x) * rpc; s0 < p.S; s0 += step, buf ^= 1, xr += rstep, yr += rstep) {
    si = s0 + group;
    const bool valid = si < p.S;
    const bool next_valid = si + step < p.S;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {  // prefetch the next row
      if (next_valid && tid + i * tpr < nvec) nxt[i].load(xr + rstep + i * vs);
      else nxt[i].zero();
    }
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    const TM* shr = sh + b * p.sh_sb + si * p.sh_ss;
    if constexpr (kEarlyMod) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (valid && c < nvec) { psc[i].load(scr + c * 8); psh[i].load(shr + c * 8); }
        else { psc[i].zero(); psh[i].zero(); }
      }
    }
    // Row unpacked once; zeros where c >= nvec or the row is past S.
    float xf[VPT][8], part[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      cur[i].get(xf[i]);
      part[i] = sum8(xf[i]);
    }
    const float s_w = warp_sum(tree_sum<VPT>(part));
    const float mean_w = s_w * inv_nw;
#pragma unroll
    for (int i = 0; i < VPT; ++i) part[i] = tid + i * tpr < nvec ? sqdev8(xf[i], mean_w) : 0.f;
    const float m2_w = warp_sum(tree_sum<VPT>(part));
    float mean = mean_w, m2 = m2_w;  // wpr == 1: the warp is the row
    if (wpr > 1) {
      float4* slot = buf ? slot1 : slot0;
      if (lane == 0) slot[wig] = make_float4(s_w, mean_w, m2_w, n_w);
      if (named) group_barrier(group, tpr);
      else __syncthreads();
      // One pass over the wpr slots (mean is not known before the pass): deviations of the warp means are
      // taken from K = warp 0's mean and re-centred at the end,
      //   sum_w n_w (mean_w - mean)^2 = sum_w n_w (mean_w - K)^2 - D (mean - K)^2,
      // exact algebra; K is within a few sigma / sqrt(n_w) of the mean, so both terms are small next to
      // sum_w M2_w and the subtraction loses nothing (a large common offset of x cancels in mean_w - K).
      const float K = slot[0].y;
      float sum = 0.f, dev = 0.f, m2w = 0.f;
#pragma unroll 1
      for (int w = 0; w < wpr; ++w) {  // fixed order in every thread
        const float4 v = slot[w];
        const float d = v.y - K;
        sum += v.x;
        dev = fmaf(v.w * d, d, dev);
        m2w += v.z;
      }
      mean = sum * inv_d;
      const float e = mean - K;
      m2 = m2w + fmaxf(dev - p.D * e * e, 0.f);
    }
    const float rstd = rsqrtf(m2 * inv_d + p.eps);
    if (valid) {
      if (tid == 0 && p.mean != nullptr) { p.mean[b * p.S + si] = mean; p.rstd[b * p.S + si] = rstd; }
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (c < nvec) {
          float A[8], T[8], o[8];
          if constexpr (kSmem) {
            lds8(mod_a + c * 8, A);
            lds8(mod_t + c * 8, T);
          } else {
            if constexpr (kEarlyMod) { psc[i].get(A); psh[i].get(T); }
            else { load8(scr + c * 8, A); load8(shr + c * 8, T); }
#pragma unroll
            for (int k = 0; k < 8; ++k) A[k] += 1.f;
            if (affine) {  // uniform branch; per-token modulation cannot be folded once per CTA
              float w[8], bb[8];
#pragma unroll
              for (int k = 0; k < 8; ++k) { w[k] = 1.f; bb[k] = 0.f; }
              if (p.weight != nullptr) load8(p.weight + c * 8, w);
              if (p.bias != nullptr) load8(p.bias + c * 8, bb);
#pragma unroll
              for (int k = 0; k < 8; ++k) { T[k] = fmaf(A[k], bb[k], T[k]); A[k] *= w[k]; }
            }
          }
#pragma unroll
          for (int k = 0; k < 8; ++k) o[k] = fmaf((xf[i][k] - mean) * rstd, A[k], T[k]);
          store8(yr + i * vs, o);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) cur[i] = nxt[i];
  }
}

// Generic path (any D, any alignment): one row per CTA, x re-read from L1/L2 for each pass.
template <typename TX, typename TM, typename TY>
__global__ void __launch_bounds__(256) fwd_generic_kernel(FwdParams p) {
  __shared__ float red[32];
  const int64_t rows = p.B * p.S;
  const TX* x = static_cast<const TX*>(p.x);
  const TM* sc = static_cast<const TM*>(p.scale);
  const TM* sh = static_cast<const TM*>(p.shift);
  TY* y = static_cast<TY*>(p.y);
  const float inv_d = 1.f / p.D;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const TX* xr = x + row * p.D;
    float s = 0.f;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) s += to_f(xr[c]);
    const float mean = block_sum(s, red) * inv_d;
    float q = 0.f;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) { const float d = to_f(xr[c]) - mean; q += d * d; }
    const float rstd = rsqrtf(block_sum(q, red) * inv_d + p.eps);
    if (threadIdx.x == 0 && p.mean != nullptr) { p.mean[row] = mean; p.rstd[row] = rstd; }
    const int64_t b = row / p.S, si = row - b * p.S;
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    const TM* shr = sh + b * p.sh_sb + si * p.sh_ss;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) {
      float z = (to_f(xr[c]) - mean) * rstd;
      if (p.weight != nullptr) z *= p.weight[c];
      if (p.bias != nullptr) z += p.bias[c];
      y[row * p.D + c] = from_f<TY>(z * (1.f + to_f(scr[c])) + to_f(shr[c]));
    }
  }
}

// Staged (cp.async) forward shape: ~320 threads per CTA, nst rows ahead; rows per CTA, then depth, shrink
// until the CTA fits kPipeSmemCap (two CTAs per SM). Returns false when even one row, two stages do not fit.
static bool fwd_pipe_shape(const FwdParams& p, Shape& sh, int& nst, size_t& smem, size_t esize, bool stage) {
  nst = p.stages > kMaxStages ? kMaxStages : p.stages;
  if (nst < 2) nst = 2;
  if (p.rpc <= 0) {
    sh.rpc = 320 / (sh.wpr * 32);
    if (sh.rpc < 1) sh.rpc = 1;
  }
  while (sh.rpc > 1 && sh.rpc * sh.wpr * 32 > 512) --sh.rpc;
  if (sh.wpr * 32 > 512) return false;
  for (;;) {
    smem = sizeof(float) * (((2 * sh.rpc * sh.wpr + 3) & ~3) + (stage ? 2 * size_t(p.D) : 0)) +
           size_t(nst) * sh.rpc * p.D * esize;
    if (smem <= kPipeSmemCap) return true;
    if (sh.rpc > 1) --sh.rpc;
    else if (nst > 2) --nst;
    else return false;
  }
}

template <typename TX, typename TM, typename TY, int VPT>
static cudaError_t launch_vec(const FwdParams& p, Shape sh, cudaStream_t stream) {
  const bool stage = p.sc_ss == 0 && p.sh_ss == 0;  // per-sample or global modulation
  int nst = 0;
  size_t smem = 0;
  const bool pipe = p.stages > 0 && fwd_pipe_shape(p, sh, nst, smem, sizeof(TX), stage);
  if (!pipe) {
    nst = 1;
    smem = sizeof(float) * (((2 * sh.rpc * sh.wpr + 3) & ~3) + (stage ? 2 * size_t(p.D) : 0));
  }
  const void* kernel = pipe ? reinterpret_cast<const void*>(fwd_vec_kernel<TX, TM, TY, VPT, true>)
                            : reinterpret_cast<const void*>(fwd_vec_kernel<TX, TM, TY, VPT, false>);
  int wpr = sh.wpr;
  void* args[] = {const_cast<FwdParams*>(&p), &wpr, const_cast<bool*>(&stage), &nst};
  return launch_persistent(kernel, sh.wpr * 32 * sh.rpc, smem, sh.rpc, p.B, p.S, args, stream);
}

template <typename TX, typename TM, typename TY, int VPT>
static cudaError_t launch_v1(const FwdParams& p, const Shape& sh, cudaStream_t stream) {
  const bool stage = p.sc_ss == 0 && p.sh_ss == 0;  // per-sample or global modulation: staged
  const void* kernel = stage ? reinterpret_cast<const void*>(fwd_v1_kernel<TX, TM, TY, VPT, kModSmem>)
                             : reinterpret_cast<const void*>(fwd_v1_kernel<TX, TM, TY, VPT, kModRow>);
  const size_t smem = sizeof(float4) * 2 * sh.rpc * sh.wpr + (stage ? 2 * sizeof(float) * p.D : 0);
  int wpr = sh.wpr;
  void* args[] = {const_cast<FwdParams*>(&p), &wpr};
  return launch_persistent(kernel, sh.wpr * 32 * sh.rpc, smem, sh.rpc, p.B, p.S, args, stream);
}

template <typename TX, typename TM, typename TY>
static cudaError_t launch_typed(const FwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.S;
  if (rows == 0) return cudaSuccess;
  if (p.vectorized) {
    const Shape sh = choose_shape(p.D, p.vpt, p.rpc, false);
    // 2-byte x: fwd_v1_kernel, unless the baseline kernels are asked for (set_variant(2)) or the cp.async
    // row stream (set_stages), which only fwd_vec_kernel has.
    if (sizeof(TX) == 2 && p.variant != 2 && p.stages <= 0) {
      switch (sh.vpt) {
        case 1: return launch_v1<TX, TM, TY, 1>(p, sh, stream);
        case 2: return launch_v1<TX, TM, TY, 2>(p, sh, stream);
        case 4: return launch_v1<TX, TM, TY, 4>(p, sh, stream);
        case 8: return launch_v1<TX, TM, TY, 8>(p, sh, stream);
        default: return cudaErrorInvalidValue;
      }
    }
    switch (sh.vpt) {
      case 1: return launch_vec<TX, TM, TY, 1>(p, sh, stream);
      case 2: return launch_vec<TX, TM, TY, 2>(p, sh, stream);
      case 4: return launch_vec<TX, TM, TY, 4>(p, sh, stream);
      case 8: return launch_vec<TX, TM, TY, 8>(p, sh, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const int64_t cap = int64_t(cached_num_sms()) * 64;
  fwd_generic_kernel<TX, TM, TY><<<int(rows < cap ? rows : cap), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

// (x, modulation, output) dtype combinations: modulation is fp32 or x's dtype; output is x's dtype or
// fp32 (the front end converts for any other out_dtype).
const char* fwd_launch(const FwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  const bool mf = p.m_dtype == kF32, yf = p.y_dtype == kF32;
  if (!mf && p.m_dtype != p.x_dtype) return "ln_modulate: scale/shift dtype must be fp32 or x's dtype";
  if (!yf && p.y_dtype != p.x_dtype) return "ln_modulate: output dtype must be fp32 or x's dtype";
  if (p.vectorized && (p.D % 8 != 0 || p.D > 16384)) return "ln_modulate: bad vectorized D";
  if (p.B > 65535) return "ln_modulate: batch over 65535";
  if (p.B * p.S == 0) return nullptr;
  if (batch_fwd_launch(p, stream, &e) || fast_fwd_launch(p, stream, &e))
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  switch (p.x_dtype) {
    case kF32: e = launch_typed<float, float, float>(p, stream); break;
    case kF16:
      if (mf) e = yf ? launch_typed<__half, float, float>(p, stream) : launch_typed<__half, float, __half>(p, stream);
      else e = yf ? launch_typed<__half, __half, float>(p, stream) : launch_typed<__half, __half, __half>(p, stream);
      break;
    case kBF16:
      if (mf) e = yf ? launch_typed<__nv_bfloat16, float, float>(p, stream)
                     : launch_typed<__nv_bfloat16, float, __nv_bfloat16>(p, stream);
      else e = yf ? launch_typed<__nv_bfloat16, __nv_bfloat16, float>(p, stream)
                  : launch_typed<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>(p, stream);
      break;
    default: return "ln_modulate: unsupported x dtype";
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lnmod
