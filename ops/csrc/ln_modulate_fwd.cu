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
  const int threads = sh.wpr * 32 * sh.rpc;
  cudaError_t e = ensure_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const int per_sm = cached_occupancy(kernel, threads, smem);
  // One wave of resident CTAs shared among the samples (at least one each).
  int64_t c = int64_t(cached_num_sms()) * per_sm / p.B;
  const int64_t most = (p.S + sh.rpc - 1) / sh.rpc;
  if (c > most) c = most;
  if (c < 1) c = 1;
  if (c > 65535) c = 65535;
  int wpr = sh.wpr;
  void* args[] = {const_cast<FwdParams*>(&p), &wpr, const_cast<bool*>(&stage), &nst};
  return cudaLaunchKernel(kernel, dim3(unsigned(c), unsigned(p.B)), dim3(threads), args, smem, stream);
}

template <typename TX, typename TM, typename TY>
static cudaError_t launch_typed(const FwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.S;
  if (rows == 0) return cudaSuccess;
  if (p.vectorized) {
    const Shape sh = choose_shape(p.D, p.vpt, p.rpc, false);
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
