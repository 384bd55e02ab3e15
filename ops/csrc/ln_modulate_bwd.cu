// Backward kernels of the fused LayerNorm-Modulate op (see ln_modulate.h for the contract).
//
// With z = xhat * w + b (w = 1, b = 0 without affine) and y = z * (1 + scale) + shift:
//   dshift = dy, dscale = dy * z, dz = dy * (1 + scale), dw = dz * xhat, db = dz, g = dz * w,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// Reduced gradients (scale/shift of shape [D] or [B,1,D], weight, bias) are deterministic: a persistent
// grid of C CTAs per sample, each thread owning fixed columns, accumulates its rows in registers and
// writes fp32 partial sums workspace[q][b][c][D]; reduce_kernel sums them in a fixed order. No atomics.
#include "ln_modulate_common.cuh"

namespace lnmod {

namespace {
constexpr int kQ = 4;  // partial-sum quantities: dscale, dshift, dweight, dbias
struct Parts { float* q[kQ]; };

// Workspace layout: quantity q at ws + q * B * C * D, then [b][c][D].
__device__ __forceinline__ float* part_row(const BwdParams& p, int q, int64_t b, int c) {
  const int64_t C = p.ctas_per_sample;
  return p.workspace + (int64_t(q) * p.B * C + b * C + c) * p.D;
}

// Shared memory of the vectorized kernel: 6 * rpc * wpr floats of reduction slots, then (rpc > 1) a
// 16-byte aligned rpc x D buffer that combines the row groups' partial sums.
__host__ __device__ __forceinline__ int smem_buf_offset(int rpc, int wpr) { return (6 * rpc * wpr + 3) & ~3; }

template <int VPT>
__device__ __forceinline__ void flush_partial(const float (&acc)[VPT][8], float* out, float* buf, int D, int rpc,
                                              int group, int tid, int tpr, int nvec) {
  if (rpc == 1) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = tid + i * tpr;
      if (c < nvec) store8(out + c * 8, acc[i]);
    }
    return;
  }
  __syncthreads();  // buf may still be read by the previous flush
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = tid + i * tpr;
    if (c < nvec) store8(buf + group * D + c * 8, acc[i]);
  }
  __syncthreads();
  for (int col = threadIdx.x; col < D; col += blockDim.x) {
    float s = 0.f;
    for (int r = 0; r < rpc; ++r) s += buf[r * D + col];
    out[col] = s;
  }
}
}  // namespace

// Row stream as in the forward: PIPE (opt-in, stages >= 2; measured no faster on H200) stages the next
// `nst` rows of x and dy of each row group in a shared-memory ring by cp.async (nst rows in flight per row group, no registers held); !PIPE loads each
// row into registers when it is needed (one row in flight). With PIPE the saved mean/rstd of the next row
// are loaded one row ahead, so their latency is hidden too.
template <typename TX, typename TM, typename TY, int VPT, bool AFF, bool PIPE>
// 96 registers at vpt 2: two 320-thread CTAs (D = 5120) fit one SM's register file (104 would not).
__global__ void __launch_bounds__(bwd_max_threads(VPT)) __maxnreg__(VPT == 1 ? 64 : VPT == 2 ? 96 : 128) bwd_vec_kernel(BwdParams p, int wpr, int nst) {
  extern __shared__ float smem[];
  const int tpr = wpr * 32;
  const int rpc = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, tid = threadIdx.x % tpr;
  // Reduction slots: stats (2 buffers) + dx sums (2 buffers by iteration parity, float2).
  float* slot_a = smem + group * wpr;
  float* slot_b = smem + (rpc + group) * wpr;
  float2* slot_c = reinterpret_cast<float2*>(smem + 2 * rpc * wpr) + group * wpr;  // + parity * rpc * wpr
  const int nvec = p.D / 8;
  const float inv_d = 1.f / p.D;
  const int64_t b = blockIdx.y;
  const int C = gridDim.x;
  const TX* x = static_cast<const TX*>(p.x);
  const TY* dy = static_cast<const TY*>(p.dy);
  const TM* sc = static_cast<const TM*>(p.scale);
  TX* dx = static_cast<TX*>(p.dx);
  // AFF is false for the common no-affine case: the compiler then drops the dweight/dbias accumulators.
  const bool affine_w = AFF && p.weight != nullptr, affine_b = AFF && p.bias != nullptr;
  const bool red_sc = p.sc_mode == kGlobal || p.sc_mode == kPerSample;
  const bool red_sh = p.sh_mode == kGlobal || p.sh_mode == kPerSample;
  // Per-sample / global scale: stage 1 + scale once in shared memory (the CTA stays in sample b) instead
  // of re-reading it from L1/L2 twice per row.
  const bool stage = p.sc_ss == 0;
  float* mod_a = smem + smem_buf_offset(rpc, wpr) + (rpc > 1 ? rpc * p.D : 0);
  TX* ring_x = reinterpret_cast<TX*>(mod_a + p.D);                  // [nst][rpc][D] (PIPE)
  TY* ring_g = reinterpret_cast<TY*>(ring_x + int64_t(nst) * rpc * p.D);  // [nst][rpc][D] (PIPE)
  const int64_t step = int64_t(C) * rpc;
  if (stage) {
    for (int col = threadIdx.x; col < p.D; col += blockDim.x) mod_a[col] = 1.f + to_f(sc[b * p.sc_sb + col]);
    __syncthreads();
  }
  auto one_plus_scale = [&](const TM* scr, int c, float* a) {
    if (stage) {
      lds8(mod_a + c * 8, a);
    } else {
      load8(scr + c * 8, a);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += 1.f;
    }
  };

  float acc_sc[VPT][8], acc_sh[VPT][8], acc_w[VPT][8], acc_b[VPT][8];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc_sc[i][k] = acc_sh[i][k] = acc_w[i][k] = acc_b[i][k] = 0.f;

  // PIPE: copy this thread's vectors of row si of x and dy into ring stage st; always one commit.
  auto issue = [&](int64_t si, int st) {
    if (si < p.S) {
      const int64_t off = (b * p.S + si) * p.D;
      const int64_t so = (int64_t(st) * rpc + group) * p.D;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = tid + i * tpr;
        if (c < nvec) {
          cp_async8(ring_x + so + c * 8, x + off + int64_t(c) * 8);
          cp_async8(ring_g + so + c * 8, dy + off + int64_t(c) * 8);
        }
      }
    }
    cp_async_commit();
  };
  float mean_n = 0.f, rstd_n = 0.f;  // PIPE with saved stats: the next row's, loaded one row ahead
  if (PIPE) {
    const int64_t first = int64_t(blockIdx.x) * rpc + group;
    for (int k = 0; k < nst; ++k) issue(first + k * step, k);
    if (!p.recompute && first < p.S) { mean_n = p.mean[b * p.S + first]; rstd_n = p.rstd[b * p.S + first]; }
  }

  int parity = 0, st = 0;
  for (int64_t s0 = int64_t(blockIdx.x) * rpc; s0 < p.S;
       s0 += step, parity ^= 1, st = (st + 1 == nst ? 0 : st + 1)) {
    const int64_t si = s0 + group;
    const bool valid = si < p.S;
    const int64_t row = b * p.S + si;
    // x and dy stay packed in registers; they are converted again where needed (cheap ALU, half the
    // registers for 2-byte types).
    Pack8<TX> xv[VPT];
    Pack8<TY> gv[VPT];
    if (PIPE) cp_async_wait(nst - 1);  // this thread's copies of row si have landed
    const int64_t so = (int64_t(st) * rpc + group) * p.D;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = tid + i * tpr;
      if (valid && c < nvec) {
        if (PIPE) {
          xv[i].lds(ring_x + so + c * 8);
          gv[i].lds(ring_g + so + c * 8);
        } else {
          xv[i].load(x + row * p.D + int64_t(c) * 8);
          gv[i].load(dy + row * p.D + int64_t(c) * 8);
        }
      } else {
        xv[i].zero();
        gv[i].zero();
      }
    }
    float mean, rstd;
    if (PIPE && !p.recompute) {
      mean = mean_n;
      rstd = rstd_n;
      if (si + step < p.S) { mean_n = p.mean[row + step]; rstd_n = p.rstd[row + step]; }
    } else if (p.recompute) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        float f[8];
        xv[i].get(f);
#pragma unroll
        for (int k = 0; k < 8; ++k) s += f[k];
      }
      mean = group_sum(s, slot_a, wpr) * inv_d;
      float q = 0.f;
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if (valid && tid + i * tpr < nvec) {
          float f[8];
          xv[i].get(f);
#pragma unroll
          for (int k = 0; k < 8; ++k) { const float d = f[k] - mean; q += d * d; }
        }
      rstd = rsqrtf(group_sum(q, slot_b, wpr) * inv_d + p.eps);
    } else {
      mean = valid ? p.mean[row] : 0.f;
      rstd = valid ? p.rstd[row] : 0.f;
    }
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    float2 sums = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = tid + i * tpr;
      if (valid && c < nvec) {
        float a[8], w[8], bb[8], xf[8], gy[8], dsc[8];
        xv[i].get(xf);
        gv[i].get(gy);
        one_plus_scale(scr, c, a);
        if (affine_w) load8(p.weight + c * 8, w);
        if (affine_b) load8(p.bias + c * 8, bb);
        if (p.sh_mode == kPerToken && p.dshift_tok != nullptr)
          store8(static_cast<TM*>(p.dshift_tok) + row * p.D + int64_t(c) * 8, gy);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float xh = (xf[k] - mean) * rstd;
          float z = affine_w ? xh * w[k] : xh;
          if (affine_b) z += bb[k];
          dsc[k] = gy[k] * z;
          acc_sh[i][k] += gy[k];
          acc_sc[i][k] += dsc[k];
          const float dz = gy[k] * a[k];
          if (AFF) {
            acc_w[i][k] += dz * xh;
            acc_b[i][k] += dz;
          }
          const float gg = affine_w ? dz * w[k] : dz;
          sums.x += gg;
          sums.y += gg * xh;
        }
        if (p.sc_mode == kPerToken && p.dscale_tok != nullptr)
          store8(static_cast<TM*>(p.dscale_tok) + row * p.D + int64_t(c) * 8, dsc);
      }
    }
    sums = group_sum2(sums, slot_c + parity * rpc * wpr, wpr);
    // The stage's values were consumed by the sums above: refill it with the row nst steps ahead.
    if (PIPE) issue(si + nst * step, st);
    if (!valid) continue;
    const float m1 = sums.x * inv_d, m2 = sums.y * inv_d;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = tid + i * tpr;
      if (c < nvec) {
        float a[8], w[8], xf[8], gy[8], o[8];
        xv[i].get(xf);
        gv[i].get(gy);
        one_plus_scale(scr, c, a);
        if (affine_w) load8(p.weight + c * 8, w);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float xh = (xf[k] - mean) * rstd;
          const float dz = gy[k] * a[k];
          const float gg = affine_w ? dz * w[k] : dz;
          o[k] = rstd * (gg - m1 - xh * m2);
        }
        if (p.dres != nullptr) {
          float r[8];
          load8(static_cast<const TX*>(p.dres) + row * p.D + int64_t(c) * 8, r);
#pragma unroll
          for (int k = 0; k < 8; ++k) o[k] += r[k];
        }
        store8(dx + row * p.D + int64_t(c) * 8, o);
      }
    }
  }

  if (PIPE) cp_async_wait(0);  // no copy may still target this CTA's shared memory when it exits
  // Partial sums of this CTA: its rpc row groups are combined in shared memory (fixed order), then one
  // row per quantity goes to the workspace. Explicit calls keep the accumulators in registers.
  float* buf = smem + smem_buf_offset(rpc, wpr);
  if (red_sc) flush_partial<VPT>(acc_sc, part_row(p, 0, b, blockIdx.x), buf, p.D, rpc, group, tid, tpr, nvec);
  if (red_sh) flush_partial<VPT>(acc_sh, part_row(p, 1, b, blockIdx.x), buf, p.D, rpc, group, tid, tpr, nvec);
  if (AFF && p.dweight) flush_partial<VPT>(acc_w, part_row(p, 2, b, blockIdx.x), buf, p.D, rpc, group, tid, tpr, nvec);
  if (AFF && p.dbias) flush_partial<VPT>(acc_b, part_row(p, 3, b, blockIdx.x), buf, p.D, rpc, group, tid, tpr, nvec);
}

// Generic path: one row per CTA iteration; the CTA's partial sums live in its own workspace rows
// (read-modify-write by the thread that owns the column, so no races and no atomics).
template <typename TX, typename TM, typename TY>
__global__ void __launch_bounds__(256) bwd_generic_kernel(BwdParams p) {
  __shared__ float red[32];
  const int64_t b = blockIdx.y;
  const int C = gridDim.x;
  const TX* x = static_cast<const TX*>(p.x);
  const TY* dy = static_cast<const TY*>(p.dy);
  const TM* sc = static_cast<const TM*>(p.scale);
  TX* dx = static_cast<TX*>(p.dx);
  const float inv_d = 1.f / p.D;
  const bool want[kQ] = {p.sc_mode == kGlobal || p.sc_mode == kPerSample,
                         p.sh_mode == kGlobal || p.sh_mode == kPerSample, p.dweight != nullptr,
                         p.dbias != nullptr};
  float* part[kQ];
  for (int q = 0; q < kQ; ++q) {
    part[q] = part_row(p, q, b, blockIdx.x);
    if (want[q])
      for (int col = threadIdx.x; col < p.D; col += blockDim.x) part[q][col] = 0.f;
  }
  for (int64_t si = blockIdx.x; si < p.S; si += C) {
    const int64_t row = b * p.S + si;
    const TX* xr = x + row * p.D;
    const TY* gr = dy + row * p.D;
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    float mean, rstd;
    if (p.recompute) {
      float s = 0.f;
      for (int c = threadIdx.x; c < p.D; c += blockDim.x) s += to_f(xr[c]);
      mean = block_sum(s, red) * inv_d;
      float q = 0.f;
      for (int c = threadIdx.x; c < p.D; c += blockDim.x) { const float d = to_f(xr[c]) - mean; q += d * d; }
      rstd = rsqrtf(block_sum(q, red) * inv_d + p.eps);
    } else {
      mean = p.mean[row];
      rstd = p.rstd[row];
    }
    float s1 = 0.f, s2 = 0.f;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) {
      const float xh = (to_f(xr[c]) - mean) * rstd;
      const float w = p.weight ? p.weight[c] : 1.f;
      const float z = xh * w + (p.bias ? p.bias[c] : 0.f);
      const float gy = to_f(gr[c]);
      const float dz = gy * (1.f + to_f(scr[c]));
      if (want[0]) part[0][c] += gy * z;
      else if (p.sc_mode == kPerToken && p.dscale_tok) static_cast<TM*>(p.dscale_tok)[row * p.D + c] = from_f<TM>(gy * z);
      if (want[1]) part[1][c] += gy;
      else if (p.sh_mode == kPerToken && p.dshift_tok) static_cast<TM*>(p.dshift_tok)[row * p.D + c] = from_f<TM>(gy);
      if (want[2]) part[2][c] += dz * xh;
      if (want[3]) part[3][c] += dz;
      const float gg = dz * w;
      s1 += gg;
      s2 += gg * xh;
    }
    const float m1 = block_sum(s1, red) * inv_d, m2 = block_sum(s2, red) * inv_d;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) {
      const float xh = (to_f(xr[c]) - mean) * rstd;
      const float w = p.weight ? p.weight[c] : 1.f;
      const float gg = to_f(gr[c]) * (1.f + to_f(scr[c])) * w;
      const float res = p.dres != nullptr ? to_f(static_cast<const TX*>(p.dres)[row * p.D + c]) : 0.f;
      dx[row * p.D + c] = from_f<TX>(rstd * (gg - m1 - xh * m2) + res);
    }
  }
}

// out[g][d] = sum_c part[g][c][d], c in a fixed order: 32 columns x 8 c-lanes per CTA, each lane sums
// c = lane, lane + 8, ... sequentially, then the 8 lanes are combined in order.
__global__ void __launch_bounds__(256) reduce_kernel(const float* part, float* out, int64_t G, int64_t Cg, int D) {
  __shared__ float red[8][33];
  const int col = blockIdx.x * 32 + (threadIdx.x & 31);
  const int lane = threadIdx.x >> 5;
  const int64_t g = blockIdx.y;
  float s = 0.f;
  if (col < D) {
    const float* base = part + g * Cg * D + col;
    for (int64_t c = lane; c < Cg; c += 8) s += base[c * D];
  }
  add_lanes8(red, s, out + g * D + col, col < D);
}

cudaError_t reduce_parts(const float* part, float* out, int64_t G, int64_t Cg, int D, cudaStream_t stream) {
  reduce_kernel<<<dim3(unsigned((D + 31) / 32), unsigned(G)), 256, 0, stream>>>(part, out, G, Cg, D);
  return cudaGetLastError();
}

static size_t vec_smem(const Shape& sh, int D) {  // see smem_buf_offset
  return sizeof(float) * (smem_buf_offset(sh.rpc, sh.wpr) + (sh.rpc > 1 ? size_t(sh.rpc) * D : 0) + D);
}

static Shape bwd_shape(const BwdParams& p) {
  Shape sh = choose_shape(p.D, p.vpt, p.rpc, true);
  while (sh.rpc > 1 && size_t(sh.rpc) * p.D > 12288) --sh.rpc;  // combine buffer within 48 KB
  return sh;
}

// Launch configuration of the backward; bwd_plan and bwd_launch must agree on it (rows per CTA).
struct BwdCfg {
  Shape sh;
  int nst;       // ring depth (PIPE) or 0
  size_t smem;
  const void* k; // vectorized kernel, or null for the generic one
  int threads;
};

template <typename TX, typename TM, typename TY, int VPT>
static const void* vec_kernel_ptr(bool aff, bool pipe) {
  if (pipe) return aff ? reinterpret_cast<const void*>(bwd_vec_kernel<TX, TM, TY, VPT, true, true>)
                       : reinterpret_cast<const void*>(bwd_vec_kernel<TX, TM, TY, VPT, false, true>);
  return aff ? reinterpret_cast<const void*>(bwd_vec_kernel<TX, TM, TY, VPT, true, false>)
             : reinterpret_cast<const void*>(bwd_vec_kernel<TX, TM, TY, VPT, false, false>);
}

// Staged (PIPE) only when asked for (stages > 0) and unless even one row, two stages do not fit
// kPipeSmemCap; rows per CTA shrink first, then the depth.
template <typename TX, typename TM, typename TY>
static BwdCfg bwd_config(const BwdParams& p) {
  BwdCfg cfg{};
  if (!p.vectorized) { cfg.threads = 256; return cfg; }
  cfg.sh = bwd_shape(p);
  bool pipe = p.stages > 0;
  if (pipe) {
    cfg.nst = p.stages > kMaxStages ? kMaxStages : p.stages;
    if (cfg.nst < 2) cfg.nst = 2;
    for (;;) {
      cfg.smem = vec_smem(cfg.sh, p.D) + size_t(cfg.nst) * cfg.sh.rpc * p.D * (sizeof(TX) + sizeof(TY));
      if (cfg.smem <= kPipeSmemCap) break;
      if (cfg.sh.rpc > 1) --cfg.sh.rpc;
      else if (cfg.nst > 2) --cfg.nst;
      else { pipe = false; break; }
    }
  }
  if (!pipe) {
    cfg.sh = bwd_shape(p);
    cfg.nst = 0;
    cfg.smem = vec_smem(cfg.sh, p.D);
  }
  const bool aff = p.weight != nullptr || p.bias != nullptr;
  switch (cfg.sh.vpt) {
    case 1: cfg.k = vec_kernel_ptr<TX, TM, TY, 1>(aff, pipe); break;
    case 2: cfg.k = vec_kernel_ptr<TX, TM, TY, 2>(aff, pipe); break;
    default: cfg.k = vec_kernel_ptr<TX, TM, TY, 4>(aff, pipe); break;
  }
  cfg.threads = cfg.sh.wpr * 32 * cfg.sh.rpc;
  return cfg;
}

// plan_only: fills per_sm_out (resident CTAs per SM) and rpc_out (rows per CTA) for bwd_plan.
template <typename TX, typename TM, typename TY>
static cudaError_t launch_typed(const BwdParams& p, cudaStream_t stream, bool plan_only, int* per_sm_out, int* rpc_out) {
  const BwdCfg cfg = bwd_config<TX, TM, TY>(p);
  if (plan_only) {
    *per_sm_out = cfg.k ? cached_occupancy(cfg.k, cfg.threads, cfg.smem)
                        : cached_occupancy(reinterpret_cast<const void*>(bwd_generic_kernel<TX, TM, TY>), 256, 0);
    *rpc_out = cfg.k ? cfg.sh.rpc : 1;
    return cudaSuccess;
  }
  const dim3 grid(p.ctas_per_sample, unsigned(p.B));
  if (cfg.k) {
    const cudaError_t e = ensure_smem(cfg.k, cfg.smem);
    if (e != cudaSuccess) return e;
    int wpr = cfg.sh.wpr, nst = cfg.nst;
    void* args[] = {const_cast<BwdParams*>(&p), &wpr, &nst};
    return cudaLaunchKernel(cfg.k, grid, dim3(cfg.threads), args, cfg.smem, stream);
  }
  bwd_generic_kernel<TX, TM, TY><<<grid, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

static cudaError_t dispatch(const BwdParams& p, cudaStream_t stream, bool plan_only, int* per_sm, int* rpc) {
  const bool mf = p.m_dtype == kF32, yf = p.y_dtype == kF32;
  switch (p.x_dtype) {
    case kF32: return launch_typed<float, float, float>(p, stream, plan_only, per_sm, rpc);
    case kF16:
      if (mf) return yf ? launch_typed<__half, float, float>(p, stream, plan_only, per_sm, rpc)
                        : launch_typed<__half, float, __half>(p, stream, plan_only, per_sm, rpc);
      return yf ? launch_typed<__half, __half, float>(p, stream, plan_only, per_sm, rpc)
                : launch_typed<__half, __half, __half>(p, stream, plan_only, per_sm, rpc);
    case kBF16:
      if (mf) return yf ? launch_typed<__nv_bfloat16, float, float>(p, stream, plan_only, per_sm, rpc)
                        : launch_typed<__nv_bfloat16, float, __nv_bfloat16>(p, stream, plan_only, per_sm, rpc);
      return yf ? launch_typed<__nv_bfloat16, __nv_bfloat16, float>(p, stream, plan_only, per_sm, rpc)
                : launch_typed<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>(p, stream, plan_only, per_sm, rpc);
    default: return cudaErrorInvalidValue;
  }
}

int64_t bwd_plan(BwdParams& p) {
  p.maxseg = 0;
  const int64_t flat_ws = batch_bwd_plan(p);  // B >= 2 on the tiles: the flat row space
  if (flat_ws >= 0) return flat_ws;
  int per_sm = 1, rpc = 1;
  // The compile-time tiles (ln_modulate_fast.cu) where they apply; they size the grid then.
  if (!fast_bwd_occupancy(p, &per_sm, &rpc)) dispatch(p, nullptr, true, &per_sm, &rpc);
  const int64_t c = persistent_ctas(per_sm, p.B, p.S, rpc);
  p.ctas_per_sample = int(c);
  return int64_t(kQ) * p.B * c * p.D;
}

const char* bwd_launch(const BwdParams& p, cudaStream_t stream) {
  if (p.B * p.S == 0) return nullptr;
  if (p.m_dtype != kF32 && p.m_dtype != p.x_dtype) return "ln_modulate: scale dtype must be fp32 or x's dtype";
  if (p.y_dtype != kF32 && p.y_dtype != p.x_dtype) return "ln_modulate: grad dtype must be fp32 or x's dtype";
  if (p.B > 65535) return "ln_modulate: batch over 65535";
  cudaError_t e = cudaSuccess;
  if (batch_bwd_launch(p, stream, &e)) return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  if (!fast_bwd_launch(p, stream, &e)) e = dispatch(p, stream, false, nullptr, nullptr);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const int64_t C = p.ctas_per_sample;
  // (quantity, output, per-sample?) -> reduce over c (per sample) or over (b, c) (global).
  struct R { int q; float* out; bool per_sample; };
  const R rs[kQ] = {{0, p.dscale_red, p.sc_mode == kPerSample}, {1, p.dshift_red, p.sh_mode == kPerSample},
                    {2, p.dweight, false}, {3, p.dbias, false}};
  for (const R& r : rs) {
    if (r.out == nullptr) continue;
    if (r.q == 0 && !(p.sc_mode == kGlobal || p.sc_mode == kPerSample)) continue;
    if (r.q == 1 && !(p.sh_mode == kGlobal || p.sh_mode == kPerSample)) continue;
    const float* part = p.workspace + int64_t(r.q) * p.B * C * p.D;
    const int64_t G = r.per_sample ? p.B : 1, Cg = r.per_sample ? C : p.B * C;
    e = reduce_parts(part, r.out, G, Cg, p.D, stream);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  return nullptr;
}

}  // namespace lnmod
