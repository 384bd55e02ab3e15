// Fused LayerNorm-Modulate: y = (LN(x) [* w + b]) * (1 + scale) + shift, fp32 math.
// Host interface between the pybind front end (ln_modulate.cpp, compiled by the C++ compiler with the
// torch headers) and the kernels (ln_modulate_{fwd,bwd}.cu, compiled by nvcc WITHOUT the torch headers,
// which keeps the nvcc part of the build short). Plain structs of pointers and element strides only.
#pragma once
#include <array>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

namespace lnmod {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// How scale / shift map onto rows r = b * S + s. Element offset of row r: b * stride_b + s * stride_s.
enum Mode : int { kGlobal = 0, kPerSample = 1, kPerToken = 2 };

struct FwdParams {
  const void* x;        // [B*S, D] contiguous, x_dtype
  const void* scale;    // m_dtype, row base at b*sc_sb + s*sc_ss, unit stride along D
  const void* shift;    // m_dtype, row base at b*sh_sb + s*sh_ss
  const float* weight;  // [D] or null
  const float* bias;    // [D] or null
  void* y;              // [B*S, D] contiguous, y_dtype
  float* mean;          // [B*S] or null (not saved)
  float* rstd;          // [B*S] or null
  int64_t B, S;
  int D;
  int64_t sc_sb, sc_ss, sh_sb, sh_ss;
  float eps;
  int x_dtype, m_dtype, y_dtype;
  bool vectorized;      // caller checked 16-byte alignment of every row base and D % 8 == 0
  int vpt, rpc;         // launch overrides for tuning (-1 = heuristic)
  int stages;           // rows of x staged ahead in shared memory by cp.async (<= 0: off, the default)
  int variant;          // tuning: 0 = default (tiles, then general); 1 = no tiles; 2 = the 2026-11-29 baseline kernels
  int tile;             // tuning: index into the forward tile table (-1 = the default for D)
  int batch_path;       // tuning: 0 = auto (the flat row space at every B), 1 = per-sample grid, 2 = flat
  int waves;            // tuning: the flat forward's grid in waves of resident CTAs (0: the default rule)
};

struct BwdParams {
  const void* x;        // [B*S, D], x_dtype
  const void* dy;       // [B*S, D], y_dtype, contiguous
  const void* scale;    // as in FwdParams
  const float* weight;  // or null
  const float* bias;    // or null (needed: dscale = dy * (xhat * w + b))
  const float* mean;    // saved stats, or null with recompute
  const float* rstd;
  void* dx;             // [B*S, D], x_dtype
  const void* dres;     // [B*S, D] x_dtype, contiguous, or null: a gradient added to dx before it is rounded
                        // (the residual stream's, ln_modulate_residual); only the general kernels take it
  void* dscale_tok;     // per-token gradient [B*S, D] in m_dtype (mode kPerToken), else null
  void* dshift_tok;
  float* dscale_red;    // reduced gradient: [B, D] (kPerSample) or [D] (kGlobal), fp32; null if unused
  float* dshift_red;
  float* dweight;       // [D] fp32 or null
  float* dbias;
  float* workspace;     // fp32 partial sums, size from bwd_workspace_floats()
  int64_t B, S;
  int D;
  int64_t sc_sb, sc_ss;
  int sc_mode, sh_mode; // Mode; -1 = no gradient wanted
  float eps;
  bool recompute;       // recompute mean/rstd from x instead of reading saved stats
  int x_dtype, m_dtype, y_dtype;
  bool vectorized;
  int vpt, rpc;
  int stages;           // rows of x and dy staged ahead in shared memory (<= 0: off, the default)
  int variant;          // as FwdParams::variant
  int tile;             // as FwdParams::tile, into the backward table
  int batch_path;       // as FwdParams::batch_path
  int ctas_per_sample;  // filled by bwd_plan(): CTAs per sample of the grid (C, B), or all CTAs of the flat grid
  int maxseg;           // filled by bwd_plan(): flat grid, the most samples one CTA's rows span; 0 = grid (C, B)
};

// Compile-time-tiled fast paths (ln_modulate_fast.cu): bf16 / fp16 x with D in a tile table (forward 1536, 2048,
// 5120, 8192; backward also 3072 and 4096), per-sample / global fp32 modulation, no affine, outputs in x's
// dtype, variant 0. Each returns false when the launch is not its case (the general kernels take it then).
bool fast_fwd_launch(const FwdParams& p, cudaStream_t stream, cudaError_t* err);
bool fast_bwd_occupancy(const BwdParams& p, int* per_sm, int* rpc);
bool fast_bwd_launch(const BwdParams& p, cudaStream_t stream, cudaError_t* err);
// The same tiles over the flat row space r = b * S + s (ln_modulate_batch.cu), for B >= 2: each CTA of one
// persistent wave takes a contiguous share of all B * S rows (sample boundaries inside it restage the
// modulation), so every resident slot works however B divides the wave. batch_bwd_plan fills ctas_per_sample
// and maxseg and returns the workspace floats (-1: not its case); batch_bwd_launch also reduces dscale/dshift.
bool batch_fwd_launch(const FwdParams& p, cudaStream_t stream, cudaError_t* err);
int64_t batch_bwd_plan(BwdParams& p);
bool batch_bwd_launch(const BwdParams& p, cudaStream_t stream, cudaError_t* err);
// The tile tables, (D, vpt, wpr, rows ahead) each, the default per D first (tests and the benchmark read them).
std::vector<std::array<int, 4>> fast_tiles(bool backward);

// Gated residual fused in front of the forward (ln_modulate_resid.cu): x_new = x + gate * branch in fp32,
// stored in x's dtype, then LN-Modulate of the stored x_new; FwdParams::x is x and FwdParams::y the output
// (in x's dtype). gate is m_dtype, its row base at b * g_sb + s * g_ss, unit stride along D.
struct ResidParams {
  const void* branch;   // [B*S, D] contiguous, x_dtype
  const void* gate;
  int64_t g_sb, g_ss;
  int g_mode;           // Mode of the gate (backward: how dgate is reduced)
  void* x_new;          // [B*S, D] contiguous, x_dtype (forward output)
  const void* dx;       // backward: the full gradient of x_new ([B*S, D], x_dtype), from bwd_launch with dres
  void* dbranch;        // backward: gate * dx, x_dtype
  void* dgate_tok;      // backward, kPerToken: branch * dx in m_dtype [B*S, D]
  float* dgate_red;     // backward, kPerSample / kGlobal: fp32 [B, D] / [D]
};
const char* resid_fwd_launch(const FwdParams& p, const ResidParams& r, cudaStream_t stream);
// The backward after bwd_launch: dbranch and dgate. resid_bwd_workspace: fp32 floats its partial sums need.
int64_t resid_bwd_workspace(int64_t B, int64_t S, int D, int g_mode);
const char* resid_bwd_launch(int64_t B, int64_t S, int D, int x_dtype, int m_dtype, const ResidParams& r,
                             float* workspace, cudaStream_t stream);
// out[g][d] = sum over c of part[g][c][d] in a fixed order (ln_modulate_bwd.cu's deterministic reduction).
cudaError_t reduce_parts(const float* part, float* out, int64_t G, int64_t Cg, int D, cudaStream_t stream);

// Returns an error string (nullptr on success).
const char* fwd_launch(const FwdParams& p, cudaStream_t stream);
// Chooses the persistent grid; returns the fp32 workspace size the caller must allocate.
int64_t bwd_plan(BwdParams& p);
const char* bwd_launch(const BwdParams& p, cudaStream_t stream);

}  // namespace lnmod
