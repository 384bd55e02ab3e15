// PyTorch front end of the fused LayerNorm-Modulate op. The Python wrapper
// (ds_adaptiveload/ops/layernorm_modulate.py) canonicalizes shapes: x is [B*S, D] contiguous; scale and shift
// are described by (mode, stride_b, stride_s) over rows r = b * S + s, with unit stride along D.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: it needs cuSPARSE/cuBLAS headers
#include <c10/cuda/CUDAGuard.h>
#include <torch/version.h>
#include "ln_modulate.h"

namespace {

int dtype_code(const at::ScalarType t) {
  switch (t) {
    case at::kFloat: return lnmod::kF32;
    case at::kHalf: return lnmod::kF16;
    case at::kBFloat16: return lnmod::kBF16;
    default: TORCH_CHECK(false, "ln_modulate: unsupported dtype ", t);
  }
  return -1;
}

// Row-stream depth for the next launches (tuning / A-B comparison; -1 or 0 = register prefetch, the
// default; n >= 2 = n rows staged ahead in shared memory by cp.async). Process-wide, set by set_stages().
int g_fwd_stages = -1, g_bwd_stages = -1;
// Kernel choice for the next launches, for A-B comparison (benchmark, tests): 0 = default (compile-time tiles
// where they apply, else the general kernels); 1 = the general kernels only; 2 = the baseline kernels of
// 2026-11-29 (fwd_vec_kernel / bwd_vec_kernel) only.
int g_fwd_variant = 0, g_bwd_variant = 0;
// Compile-time tile for the next launches (index into op.fast_tiles(); -1 = the default for D), for tuning.
int g_fwd_tile = -1, g_bwd_tile = -1;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

const float* opt_ptr(const c10::optional<at::Tensor>& t, int64_t D, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == D,
              "ln_modulate: ", name, " must be a contiguous fp32 CUDA tensor of D elements");
  return t->data_ptr<float>();
}

// Vectorized 8-element accesses need every row base 16-byte aligned.
bool vec_ok(int64_t D, const at::Tensor& x, const at::Tensor& a, int64_t a_sb, int64_t a_ss, const at::Tensor& b,
            int64_t b_sb, int64_t b_ss) {
  if (D % 8 != 0) return false;
  auto rows_ok = [](const at::Tensor& t, int64_t sb, int64_t ss) {
    return aligned16(t.data_ptr()) && (sb * t.element_size()) % 16 == 0 && (ss * t.element_size()) % 16 == 0;
  };
  return aligned16(x.data_ptr()) && rows_ok(a, a_sb, a_ss) && rows_ok(b, b_sb, b_ss);
}

// Returns (y, mean, rstd); mean/rstd are empty when save_stats is false.
std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                int64_t B, int64_t S, int64_t sc_sb, int64_t sc_ss, int64_t sh_sb, int64_t sh_ss,
                                double eps, int64_t out_code, bool save_stats, int64_t vpt, int64_t rpc) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "ln_modulate: x must be a contiguous [rows, D] CUDA tensor");
  TORCH_CHECK(x.size(0) == B * S, "ln_modulate: rows != B * S");
  TORCH_CHECK(scale.is_cuda() && shift.is_cuda() && scale.scalar_type() == shift.scalar_type(),
              "ln_modulate: scale and shift must be CUDA tensors of one dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(1);
  TORCH_CHECK(D >= 1 && D <= 16384, "ln_modulate: D must be in [1, 16384]");
  // Output dtype as our code (0 fp32, 1 fp16, 2 bf16): plain ints keep the binding simple.
  const at::ScalarType out_dtype = out_code == lnmod::kF32 ? at::kFloat : out_code == lnmod::kF16 ? at::kHalf : at::kBFloat16;
  TORCH_CHECK(out_code >= 0 && out_code <= 2, "ln_modulate: bad output dtype code");
  auto y = at::empty({B * S, D}, x.options().dtype(out_dtype));
  at::Tensor mean, rstd;
  if (save_stats) {
    mean = at::empty({B * S}, x.options().dtype(at::kFloat));
    rstd = at::empty({B * S}, x.options().dtype(at::kFloat));
  }
  lnmod::FwdParams p{};
  p.x = x.data_ptr();
  p.scale = scale.data_ptr();
  p.shift = shift.data_ptr();
  p.weight = opt_ptr(weight, D, "weight");
  p.bias = opt_ptr(bias, D, "bias");
  p.y = y.data_ptr();
  p.mean = save_stats ? mean.data_ptr<float>() : nullptr;
  p.rstd = save_stats ? rstd.data_ptr<float>() : nullptr;
  p.B = B; p.S = S; p.D = int(D);
  p.sc_sb = sc_sb; p.sc_ss = sc_ss; p.sh_sb = sh_sb; p.sh_ss = sh_ss;
  p.eps = float(eps);
  p.x_dtype = dtype_code(x.scalar_type());
  p.m_dtype = dtype_code(scale.scalar_type());
  p.y_dtype = dtype_code(out_dtype);
  p.vectorized = vec_ok(D, x, scale, sc_sb, sc_ss, shift, sh_sb, sh_ss) && aligned16(y.data_ptr());
  p.vpt = int(vpt); p.rpc = int(rpc);
  p.stages = g_fwd_stages;
  p.variant = g_fwd_variant;
  p.tile = g_fwd_tile;
  const char* err = lnmod::fwd_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {y, mean, rstd};
}

// Returns (dx, dscale, dshift, dweight, dbias). dscale/dshift: per-token [rows, D] in scale's dtype for
// mode 2, fp32 [B, D] for mode 1, fp32 [D] for mode 0, empty for mode -1 (not wanted).
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& mean, const c10::optional<at::Tensor>& rstd,
                                 int64_t B, int64_t S, int64_t sc_sb, int64_t sc_ss, int64_t sc_mode, int64_t sh_mode,
                                 bool want_dweight, bool want_dbias, double eps, int64_t vpt, int64_t rpc) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "ln_modulate: x must be a contiguous [rows, D] CUDA tensor");
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == x.sizes(), "ln_modulate: dy must be contiguous and shaped like x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(1);
  auto f32 = x.options().dtype(at::kFloat);
  auto dx = at::empty_like(x);
  auto grad_for = [&](int64_t mode) -> at::Tensor {
    if (mode == lnmod::kPerToken) return at::empty({B * S, D}, scale.options().memory_format(at::MemoryFormat::Contiguous));
    if (mode == lnmod::kPerSample) return at::empty({B, D}, f32);
    if (mode == lnmod::kGlobal) return at::empty({D}, f32);
    return at::Tensor();
  };
  at::Tensor dsc = grad_for(sc_mode), dsh = grad_for(sh_mode);
  at::Tensor dw = want_dweight ? at::empty({D}, f32) : at::Tensor();
  at::Tensor db = want_dbias ? at::empty({D}, f32) : at::Tensor();

  lnmod::BwdParams p{};
  p.x = x.data_ptr();
  p.dy = dy.data_ptr();
  p.scale = scale.data_ptr();
  p.weight = opt_ptr(weight, D, "weight");
  p.bias = opt_ptr(bias, D, "bias");
  const bool have_stats = mean.has_value() && mean->defined();
  p.mean = have_stats ? mean->data_ptr<float>() : nullptr;
  p.rstd = have_stats ? rstd->data_ptr<float>() : nullptr;
  p.recompute = !have_stats;
  p.dx = dx.data_ptr();
  p.dscale_tok = sc_mode == lnmod::kPerToken ? dsc.data_ptr() : nullptr;
  p.dshift_tok = sh_mode == lnmod::kPerToken ? dsh.data_ptr() : nullptr;
  p.dscale_red = (sc_mode == lnmod::kGlobal || sc_mode == lnmod::kPerSample) ? dsc.data_ptr<float>() : nullptr;
  p.dshift_red = (sh_mode == lnmod::kGlobal || sh_mode == lnmod::kPerSample) ? dsh.data_ptr<float>() : nullptr;
  p.dweight = want_dweight ? dw.data_ptr<float>() : nullptr;
  p.dbias = want_dbias ? db.data_ptr<float>() : nullptr;
  p.B = B; p.S = S; p.D = int(D);
  p.sc_sb = sc_sb; p.sc_ss = sc_ss;
  p.sc_mode = int(sc_mode); p.sh_mode = int(sh_mode);
  p.eps = float(eps);
  p.x_dtype = dtype_code(x.scalar_type());
  p.m_dtype = dtype_code(scale.scalar_type());
  p.y_dtype = dtype_code(dy.scalar_type());
  // The per-token gradient outputs are fresh contiguous tensors, so only x, dy and scale decide.
  p.vectorized = D % 8 == 0 && aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) && aligned16(dx.data_ptr()) &&
                 aligned16(scale.data_ptr()) && (sc_sb * scale.element_size()) % 16 == 0 &&
                 (sc_ss * scale.element_size()) % 16 == 0;
  p.vpt = int(vpt); p.rpc = int(rpc);
  p.stages = g_bwd_stages;
  p.variant = g_bwd_variant;
  p.tile = g_bwd_tile;
  const int64_t ws_floats = lnmod::bwd_plan(p);
  auto ws = at::empty({ws_floats}, f32);
  p.workspace = ws.data_ptr<float>();
  const char* err = lnmod::bwd_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {dx, dsc, dsh, dw, db};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused LayerNorm-Modulate (ds_adaptiveload)";
  m.def("forward", &forward, "y = LN(x)[*w+b]*(1+scale)+shift");
  m.def("backward", &backward, "gradients of forward");
  m.def("set_stages", [](int64_t fwd, int64_t bwd) {
    TORCH_CHECK(fwd >= -1 && bwd >= -1 && fwd != 1 && bwd != 1, "ln_modulate.set_stages: -1 / 0 (off) or a depth >= 2");
    g_fwd_stages = int(fwd);
    g_bwd_stages = int(bwd);
  }, "rows staged ahead in shared memory by the forward / backward (-1 / 0: off, the default); for tuning");
  m.def("set_variant", [](int64_t fwd, int64_t bwd) {
    TORCH_CHECK(fwd >= 0 && fwd <= 2 && bwd >= 0 && bwd <= 2, "ln_modulate.set_variant: 0 (default), 1 or 2");
    g_fwd_variant = int(fwd);
    g_bwd_variant = int(bwd);
  }, "kernels of the forward / backward: 0 default, 1 general only, 2 baseline only; for A-B comparison");
  m.def("fast_tiles", [](bool backward) { return lnmod::fast_tiles(backward); },
        "the compile-time tiles (D, vpt, wpr, rows ahead) of the forward or the backward, the default per D first");
  m.def("set_tile", [](int64_t fwd, int64_t bwd) {
    TORCH_CHECK(fwd >= -1 && bwd >= -1, "ln_modulate.set_tile: -1 (default) or an index into fast_tiles()");
    g_fwd_tile = int(fwd);
    g_bwd_tile = int(bwd);
  }, "tile of the forward / backward by index into fast_tiles() (-1: the default for D; an index for another D "
     "runs the general kernels); for tuning");
  m.def("get_tile", []() { return pybind11::make_tuple(g_fwd_tile, g_bwd_tile); });
  m.def("get_variant", []() { return pybind11::make_tuple(g_fwd_variant, g_bwd_variant); });
  m.def("get_stages", []() { return pybind11::make_tuple(g_fwd_stages, g_bwd_stages); });
  // The torch this module was compiled against: a prebuilt module is only used with the same torch.
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
