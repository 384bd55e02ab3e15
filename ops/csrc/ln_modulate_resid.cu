// Gated residual fused with LayerNorm-Modulate (see ResidParams in ln_modulate.h): the forward kernels, and the
// backward's last step (dbranch, dgate) after bwd_launch has produced the full gradient of x_new.
#include "ln_modulate_common.cuh"

namespace lnmod {

namespace {

// One row per CTA (grid-stride): each thread holds VPT 8-element vectors of x_new in registers, so x, branch
// and gate are read once, x_new and the output written once. The statistics are those of the ROUNDED x_new
// (what is stored, and what the next block reads), so the op equals the unfused chain.
template <typename TX, typename TM, int VPT>
__global__ void __launch_bounds__(512) resid_fwd_vec_kernel(FwdParams p, ResidParams r) {
  __shared__ float red[32];
  const int nvec = p.D / 8;
  const float inv_d = 1.f / p.D;
  const TX* x = static_cast<const TX*>(p.x);
  const TX* br = static_cast<const TX*>(r.branch);
  const TM* gt = static_cast<const TM*>(r.gate);
  const TM* sc = static_cast<const TM*>(p.scale);
  const TM* sh = static_cast<const TM*>(p.shift);
  TX* xn = static_cast<TX*>(r.x_new);
  TX* out = static_cast<TX*>(p.y);
  for (int64_t row = blockIdx.x; row < p.B * p.S; row += gridDim.x) {
    const int64_t b = row / p.S, si = row - b * p.S, base = row * p.D;
    const TM* gr = gt + b * r.g_sb + si * r.g_ss;
    float v[VPT][8];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < nvec) {
        float g[8], u[8];
        load8(x + base + c * 8, v[i]);
        load8(br + base + c * 8, u);
        load8(gr + c * 8, g);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[i][k] = to_f(from_f<TX>(fmaf(g[k], u[k], v[i][k])));
        store8(xn + base + c * 8, v[i]);
        s += sum8(v[i]);
      }
    }
    const float mean = block_sum(s, red) * inv_d;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (threadIdx.x + i * blockDim.x < nvec) q += sqdev8(v[i], mean);
    const float rstd = rsqrtf(block_sum(q, red) * inv_d + p.eps);
    if (threadIdx.x == 0 && p.mean != nullptr) { p.mean[row] = mean; p.rstd[row] = rstd; }
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    const TM* shr = sh + b * p.sh_sb + si * p.sh_ss;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < nvec) {
        float a[8], t[8], o[8];
        load8(scr + c * 8, a);
        load8(shr + c * 8, t);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = fmaf((v[i][k] - mean) * rstd, 1.f + a[k], t[k]);
        store8(out + base + c * 8, o);
      }
    }
  }
}

// Any D and alignment: x_new is written in the first pass and re-read (by the thread that wrote it) in the others.
template <typename TX, typename TM>
__global__ void __launch_bounds__(256) resid_fwd_generic_kernel(FwdParams p, ResidParams r) {
  __shared__ float red[32];
  const float inv_d = 1.f / p.D;
  const TX* x = static_cast<const TX*>(p.x);
  const TX* br = static_cast<const TX*>(r.branch);
  const TM* gt = static_cast<const TM*>(r.gate);
  const TM* sc = static_cast<const TM*>(p.scale);
  const TM* sh = static_cast<const TM*>(p.shift);
  TX* xn = static_cast<TX*>(r.x_new);
  TX* out = static_cast<TX*>(p.y);
  for (int64_t row = blockIdx.x; row < p.B * p.S; row += gridDim.x) {
    const int64_t b = row / p.S, si = row - b * p.S, base = row * p.D;
    const TM* gr = gt + b * r.g_sb + si * r.g_ss;
    float s = 0.f;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) {
      const TX v = from_f<TX>(fmaf(to_f(gr[c]), to_f(br[base + c]), to_f(x[base + c])));
      xn[base + c] = v;
      s += to_f(v);
    }
    const float mean = block_sum(s, red) * inv_d;
    float q = 0.f;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x) { const float d = to_f(xn[base + c]) - mean; q += d * d; }
    const float rstd = rsqrtf(block_sum(q, red) * inv_d + p.eps);
    if (threadIdx.x == 0 && p.mean != nullptr) { p.mean[row] = mean; p.rstd[row] = rstd; }
    const TM* scr = sc + b * p.sc_sb + si * p.sc_ss;
    const TM* shr = sh + b * p.sh_sb + si * p.sh_ss;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x)
      out[base + c] = from_f<TX>((to_f(xn[base + c]) - mean) * rstd * (1.f + to_f(scr[c])) + to_f(shr[c]));
  }
}

template <typename TX, typename TM>
cudaError_t fwd_typed(const FwdParams& p, const ResidParams& r, cudaStream_t stream) {
  const int64_t rows = p.B * p.S;
  const void* k = reinterpret_cast<const void*>(resid_fwd_generic_kernel<TX, TM>);
  int threads = 256;
  if (p.vectorized) {
    const int nvec = p.D / 8;
    const int vpt = nvec <= 256 ? 1 : nvec <= 512 ? 2 : nvec <= 1024 ? 4 : 8;  // <= 256 threads per row
    threads = ((nvec + vpt - 1) / vpt + 31) / 32 * 32;
    k = vpt == 1 ? reinterpret_cast<const void*>(resid_fwd_vec_kernel<TX, TM, 1>)
        : vpt == 2 ? reinterpret_cast<const void*>(resid_fwd_vec_kernel<TX, TM, 2>)
        : vpt == 4 ? reinterpret_cast<const void*>(resid_fwd_vec_kernel<TX, TM, 4>)
                   : reinterpret_cast<const void*>(resid_fwd_vec_kernel<TX, TM, 8>);
  }
  const int64_t wave = int64_t(cached_num_sms()) * cached_occupancy(k, threads, 0);
  const int64_t ctas = rows < wave ? rows : wave;
  void* args[] = {const_cast<FwdParams*>(&p), const_cast<ResidParams*>(&r)};
  return cudaLaunchKernel(k, dim3(unsigned(ctas)), dim3(threads), args, 0, stream);
}

// dbranch = gate * dx and dgate = branch * dx (reduced over the sample's rows unless per token). Block: 32
// columns x 8 row lanes; grid (column blocks, B, K row chunks). Each lane sums its chunk's rows lane, lane + 8, ...
// in order, add_lanes8 combines the lanes in order, and reduce_parts sums the K chunks in order: deterministic.
template <typename TX, typename TM>
__global__ void __launch_bounds__(256) resid_bwd_kernel(int64_t S, int D, int64_t chunk, ResidParams r, float* part) {
  __shared__ float red[8][33];
  const int col = blockIdx.x * 32 + (threadIdx.x & 31), lane = threadIdx.x >> 5;
  const int64_t b = blockIdx.y, s0 = blockIdx.z * chunk;
  const int64_t s1 = s0 + chunk < S ? s0 + chunk : S;
  const TX* dx = static_cast<const TX*>(r.dx);
  const TX* br = static_cast<const TX*>(r.branch);
  const TM* gt = static_cast<const TM*>(r.gate);
  float acc = 0.f;
  if (col < D) {
    for (int64_t si = s0 + lane; si < s1; si += 8) {
      const int64_t e = (b * S + si) * D + col;
      const float g = to_f(dx[e]), u = to_f(br[e]);
      static_cast<TX*>(r.dbranch)[e] = from_f<TX>(to_f(gt[b * r.g_sb + si * r.g_ss + col]) * g);
      if (r.g_mode == kPerToken) static_cast<TM*>(r.dgate_tok)[e] = from_f<TM>(u * g);
      else acc += u * g;
    }
  }
  if (r.g_mode != kPerToken) add_lanes8(red, acc, part + (b * gridDim.z + blockIdx.z) * int64_t(D) + col, col < D);
}

// Row chunks per sample: enough CTAs for about eight per SM, each chunk at least 64 rows.
int64_t bwd_chunks(int64_t B, int64_t S, int D) {
  const int64_t cols = (D + 31) / 32, want = (int64_t(cached_num_sms()) * 8 + cols * B - 1) / (cols * B);
  const int64_t most = (S + 63) / 64;
  const int64_t k = want < most ? want : most;
  return k < 1 ? 1 : k > 65535 ? 65535 : k;
}

}  // namespace

const char* resid_fwd_launch(const FwdParams& p, const ResidParams& r, cudaStream_t stream) {
  if (p.m_dtype != kF32 && p.m_dtype != p.x_dtype) return "ln_modulate_residual: gate/scale/shift dtype must be fp32 or x's";
  if (p.y_dtype != p.x_dtype) return "ln_modulate_residual: the output is in x's dtype";
  if (p.B * p.S == 0) return nullptr;
  cudaError_t e = cudaErrorInvalidValue;
  const bool mf = p.m_dtype == kF32;
  switch (p.x_dtype) {
    case kF32: e = fwd_typed<float, float>(p, r, stream); break;
    case kF16: e = mf ? fwd_typed<__half, float>(p, r, stream) : fwd_typed<__half, __half>(p, r, stream); break;
    case kBF16:
      e = mf ? fwd_typed<__nv_bfloat16, float>(p, r, stream) : fwd_typed<__nv_bfloat16, __nv_bfloat16>(p, r, stream);
      break;
    default: return "ln_modulate_residual: unsupported x dtype";
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

int64_t resid_bwd_workspace(int64_t B, int64_t S, int D, int g_mode) {
  return g_mode == kPerToken ? 0 : B * bwd_chunks(B, S, D) * D;
}

const char* resid_bwd_launch(int64_t B, int64_t S, int D, int x_dtype, int m_dtype, const ResidParams& r,
                             float* workspace, cudaStream_t stream) {
  if (B * S == 0) return nullptr;
  if (m_dtype != kF32 && m_dtype != x_dtype) return "ln_modulate_residual: gate dtype must be fp32 or x's";
  const int64_t K = bwd_chunks(B, S, D), chunk = (S + K - 1) / K;
  const dim3 grid(unsigned((D + 31) / 32), unsigned(B), unsigned(K));
  const bool mf = m_dtype == kF32;
  switch (x_dtype) {
    case kF32: resid_bwd_kernel<float, float><<<grid, 256, 0, stream>>>(S, D, chunk, r, workspace); break;
    case kF16:
      if (mf) resid_bwd_kernel<__half, float><<<grid, 256, 0, stream>>>(S, D, chunk, r, workspace);
      else resid_bwd_kernel<__half, __half><<<grid, 256, 0, stream>>>(S, D, chunk, r, workspace);
      break;
    case kBF16:
      if (mf) resid_bwd_kernel<__nv_bfloat16, float><<<grid, 256, 0, stream>>>(S, D, chunk, r, workspace);
      else resid_bwd_kernel<__nv_bfloat16, __nv_bfloat16><<<grid, 256, 0, stream>>>(S, D, chunk, r, workspace);
      break;
    default: return "ln_modulate_residual: unsupported x dtype";
  }
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && r.g_mode != kPerToken)  // per sample: sum the K chunks; global: all B * K
    e = r.g_mode == kPerSample ? reduce_parts(workspace, r.dgate_red, B, K, D, stream)
                               : reduce_parts(workspace, r.dgate_red, 1, B * K, D, stream);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lnmod
