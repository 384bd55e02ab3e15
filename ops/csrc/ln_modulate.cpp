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

// Benchmark-only kernel choices for the next launches, set through bench/kernel/ln_tuning.py (tests and
// the benchmark A-B them in one process); the defaults are what users run. Per direction (forward, backward):
// variant 0 = default (compile-time tiles where they apply, else the general kernels), 1 = the general kernels
// only, 2 = the 2026-11-29 baseline kernels (fwd_vec_kernel / bwd_vec_kernel); tile = index into the tile
// table (-1: the default for D); stages = rows staged ahead by cp.async (-1 / 0: off); batch path 0 = auto
// (the flat row space: the forward at every B, the backward for B >= 2), 1 = the per-sample grid (C, B), 2 = the
// flat row space also for the backward at B = 1; waves =
// the flat forward's grid in waves of resident CTAs (0: the default rule, ln_modulate_batch.cu's fwd_ctas).
struct Tuning {
  int variant[2] = {0, 0}, tile[2] = {-1, -1}, stages[2] = {-1, -1}, batch_path = 0, waves = 0;
};
Tuning g_tuning;

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

// `into`, when given, is where the result goes (a contiguous [B*S, D] tensor of the output dtype, e.g. one shape
// group's rows of a packed micro-batch's [T, D] output), so the caller needs no copy to assemble its rows.
at::Tensor output_tensor(const c10::optional<at::Tensor>& into, const at::Tensor& like, int64_t rows, int64_t D,
                         at::ScalarType dtype, const char* name) {
  if (!into.has_value() || !into->defined()) return at::empty({rows, D}, like.options().dtype(dtype));
  const at::Tensor& t = *into;
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == D,
              "ln_modulate: ", name, " must be a contiguous [rows, D] tensor of the output dtype on x's device");
  return t;
}

// Returns (y, mean, rstd); mean/rstd are empty when save_stats is false. y is `into` when given.
std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                int64_t B, int64_t S, int64_t sc_sb, int64_t sc_ss, int64_t sh_sb, int64_t sh_ss,
                                double eps, int64_t out_code, bool save_stats, int64_t vpt, int64_t rpc,
                                const c10::optional<at::Tensor>& into) {
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
  auto y = output_tensor(into, x, B * S, D, out_dtype, "into");
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
  p.stages = g_tuning.stages[0];
  p.variant = g_tuning.variant[0];
  p.tile = g_tuning.tile[0];
  p.batch_path = g_tuning.batch_path;
  p.waves = g_tuning.waves;
  const char* err = lnmod::fwd_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {y, mean, rstd};
}

// Returns (dx, dscale, dshift, dweight, dbias). dscale/dshift: per-token [rows, D] in scale's dtype for
// mode 2, fp32 [B, D] for mode 1, fp32 [D] for mode 0, empty for mode -1 (not wanted). dx is `dx_into` when given;
// `dres` (x's shape and dtype, or undefined) is added to dx (the residual op's gradient of x_new).
std::vector<at::Tensor> backward_res(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& mean, const c10::optional<at::Tensor>& rstd,
                                 int64_t B, int64_t S, int64_t sc_sb, int64_t sc_ss, int64_t sc_mode, int64_t sh_mode,
                                 bool want_dweight, bool want_dbias, double eps, int64_t vpt, int64_t rpc,
                                 const c10::optional<at::Tensor>& dx_into, const at::Tensor& dres) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "ln_modulate: x must be a contiguous [rows, D] CUDA tensor");
  TORCH_CHECK(!dres.defined() || (dres.is_contiguous() && dres.sizes() == x.sizes() && dres.scalar_type() == x.scalar_type()),
              "ln_modulate: dres must be contiguous, shaped and typed like x");
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == x.sizes(), "ln_modulate: dy must be contiguous and shaped like x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(1);
  auto f32 = x.options().dtype(at::kFloat);
  auto dx = output_tensor(dx_into, x, x.size(0), D, x.scalar_type(), "dx_into");
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
  p.dres = dres.defined() ? dres.data_ptr() : nullptr;
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
                 (!dres.defined() || aligned16(dres.data_ptr())) &&
                 aligned16(scale.data_ptr()) && (sc_sb * scale.element_size()) % 16 == 0 &&
                 (sc_ss * scale.element_size()) % 16 == 0;
  p.vpt = int(vpt); p.rpc = int(rpc);
  p.stages = g_tuning.stages[1];
  p.variant = g_tuning.variant[1];
  p.tile = g_tuning.tile[1];
  p.batch_path = g_tuning.batch_path;
  const int64_t ws_floats = lnmod::bwd_plan(p);
  auto ws = at::empty({ws_floats}, f32);
  p.workspace = ws.data_ptr<float>();
  const char* err = lnmod::bwd_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {dx, dsc, dsh, dw, db};
}

std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& mean, const c10::optional<at::Tensor>& rstd,
                                 int64_t B, int64_t S, int64_t sc_sb, int64_t sc_ss, int64_t sc_mode, int64_t sh_mode,
                                 bool want_dweight, bool want_dbias, double eps, int64_t vpt, int64_t rpc,
                                 const c10::optional<at::Tensor>& dx_into) {
  return backward_res(dy, x, scale, weight, bias, mean, rstd, B, S, sc_sb, sc_ss, sc_mode, sh_mode, want_dweight,
                      want_dbias, eps, vpt, rpc, dx_into, at::Tensor());
}

// Gated residual + LN-Modulate: returns (out, x_new, mean, rstd); x, branch: contiguous [rows, D] of one dtype;
// gate, scale, shift: one dtype (fp32 or x's), each described by (stride_b, stride_s) over rows b * S + s.
std::vector<at::Tensor> resid_forward(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& gate,
                                      const at::Tensor& scale, const at::Tensor& shift, int64_t B, int64_t S,
                                      int64_t g_sb, int64_t g_ss, int64_t sc_sb, int64_t sc_ss, int64_t sh_sb,
                                      int64_t sh_ss, double eps, bool save_stats) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2 && x.size(0) == B * S,
              "ln_modulate_residual: x must be a contiguous [B*S, D] CUDA tensor");
  TORCH_CHECK(branch.is_contiguous() && branch.sizes() == x.sizes() && branch.scalar_type() == x.scalar_type() &&
                  branch.device() == x.device(), "ln_modulate_residual: branch must be contiguous, shaped and typed like x");
  TORCH_CHECK(gate.scalar_type() == scale.scalar_type() && shift.scalar_type() == scale.scalar_type() &&
                  gate.is_cuda() && scale.is_cuda() && shift.is_cuda(),
              "ln_modulate_residual: gate, scale and shift must be CUDA tensors of one dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(1);
  TORCH_CHECK(D >= 1 && D <= 16384, "ln_modulate_residual: D must be in [1, 16384]");
  auto out = at::empty_like(x), x_new = at::empty_like(x);
  at::Tensor mean, rstd;
  if (save_stats) {
    mean = at::empty({B * S}, x.options().dtype(at::kFloat));
    rstd = at::empty({B * S}, x.options().dtype(at::kFloat));
  }
  lnmod::FwdParams p{};
  p.x = x.data_ptr(); p.scale = scale.data_ptr(); p.shift = shift.data_ptr(); p.y = out.data_ptr();
  p.mean = save_stats ? mean.data_ptr<float>() : nullptr;
  p.rstd = save_stats ? rstd.data_ptr<float>() : nullptr;
  p.B = B; p.S = S; p.D = int(D);
  p.sc_sb = sc_sb; p.sc_ss = sc_ss; p.sh_sb = sh_sb; p.sh_ss = sh_ss;
  p.eps = float(eps);
  p.x_dtype = p.y_dtype = dtype_code(x.scalar_type());
  p.m_dtype = dtype_code(scale.scalar_type());
  const bool gate_ok = aligned16(gate.data_ptr()) && (g_sb * gate.element_size()) % 16 == 0 &&
                       (g_ss * gate.element_size()) % 16 == 0;
  p.vectorized = vec_ok(D, x, scale, sc_sb, sc_ss, shift, sh_sb, sh_ss) && gate_ok && aligned16(branch.data_ptr());
  lnmod::ResidParams r{};
  r.branch = branch.data_ptr(); r.gate = gate.data_ptr(); r.g_sb = g_sb; r.g_ss = g_ss; r.x_new = x_new.data_ptr();
  const char* err = lnmod::resid_fwd_launch(p, r, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {out, x_new, mean, rstd};
}

// Returns (dx, dbranch, dgate, dscale, dshift): dx = d_x_new + the LN-Modulate gradient of x_new (one kernel),
// dbranch = gate * dx, dgate = branch * dx summed over the sample's rows (fp32 [B, D] / [D]; per token: gate's
// dtype, [rows, D]); dscale / dshift as backward's. g_mode / sc_mode / sh_mode: Mode, -1 = not wanted.
std::vector<at::Tensor> resid_backward(const at::Tensor& dout, const at::Tensor& dx_new, const at::Tensor& x_new,
                                       const at::Tensor& branch, const at::Tensor& gate, const at::Tensor& scale,
                                       const at::Tensor& mean, const at::Tensor& rstd, int64_t B, int64_t S,
                                       int64_t g_sb, int64_t g_ss, int64_t g_mode, int64_t sc_sb, int64_t sc_ss,
                                       int64_t sc_mode, int64_t sh_mode, double eps) {
  TORCH_CHECK(branch.is_contiguous() && branch.sizes() == x_new.sizes() && branch.scalar_type() == x_new.scalar_type(),
              "ln_modulate_residual: branch must be contiguous, shaped and typed like x");
  TORCH_CHECK(gate.scalar_type() == scale.scalar_type(), "ln_modulate_residual: gate and scale of one dtype");
  auto g = backward_res(dout, x_new, scale, c10::nullopt, c10::nullopt, mean, rstd, B, S, sc_sb, sc_ss, sc_mode,
                        sh_mode, false, false, eps, -1, -1, c10::nullopt, dx_new);
  const c10::cuda::CUDAGuard guard(x_new.device());
  const int64_t D = x_new.size(1);
  at::Tensor dbranch = at::empty_like(branch), dgate;
  if (g_mode == lnmod::kPerToken) dgate = at::empty({B * S, D}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  else dgate = at::empty({g_mode == lnmod::kPerSample ? B : 1, D}, x_new.options().dtype(at::kFloat));
  auto ws = at::empty({lnmod::resid_bwd_workspace(B, S, int(D), int(g_mode))}, x_new.options().dtype(at::kFloat));
  lnmod::ResidParams r{};
  r.branch = branch.data_ptr(); r.gate = gate.data_ptr(); r.g_sb = g_sb; r.g_ss = g_ss; r.g_mode = int(g_mode);
  r.dx = g[0].data_ptr(); r.dbranch = dbranch.data_ptr();
  r.dgate_tok = g_mode == lnmod::kPerToken ? dgate.data_ptr() : nullptr;
  r.dgate_red = g_mode == lnmod::kPerToken ? nullptr : dgate.data_ptr<float>();
  const char* err = lnmod::resid_bwd_launch(B, S, int(D), dtype_code(x_new.scalar_type()), dtype_code(gate.scalar_type()),
                                            r, ws.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, err ? err : "");
  return {g[0], dbranch, dgate, g[1], g[2]};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused LayerNorm-Modulate (ds_adaptiveload)";
  m.def("forward", &forward, "y = LN(x)[*w+b]*(1+scale)+shift");
  m.def("backward", &backward, "gradients of forward");
  m.def("resid_forward", &resid_forward, "x_new = x + gate * branch; out = LN(x_new)*(1+scale)+shift");
  m.def("resid_backward", &resid_backward, "gradients of resid_forward");
#ifdef LNMOD_BENCH_TUNING
  // Benchmark-only, compiled in only with the bench build flag (bench/kernel/ln_tuning.py is the one caller):
  // kernel choices for A-B comparison. The shipped module keeps g_tuning at its defaults.
  m.def("_set_tuning", [](std::vector<int64_t> variant, std::vector<int64_t> tile, std::vector<int64_t> stages,
                          int64_t batch_path, int64_t waves) {
    TORCH_CHECK(variant.size() == 2 && tile.size() == 2 && stages.size() == 2, "_set_tuning: (fwd, bwd) pairs");
    Tuning t;
    for (int i = 0; i < 2; ++i) {
      TORCH_CHECK(variant[i] >= 0 && variant[i] <= 2, "_set_tuning: variant 0, 1 or 2");
      TORCH_CHECK(tile[i] >= -1, "_set_tuning: tile -1 or an index into _fast_tiles()");
      TORCH_CHECK(stages[i] >= -1 && stages[i] != 1, "_set_tuning: stages -1 / 0 (off) or a depth >= 2");
      t.variant[i] = int(variant[i]);
      t.tile[i] = int(tile[i]);
      t.stages[i] = int(stages[i]);
    }
    TORCH_CHECK(batch_path >= 0 && batch_path <= 2, "_set_tuning: batch path 0, 1 or 2");
    t.batch_path = int(batch_path);
    TORCH_CHECK(waves >= 0 && waves <= 64, "_set_tuning: waves 0 (the default rule) to 64");
    t.waves = int(waves);
    g_tuning = t;
  });
  m.def("_get_tuning", []() {
    const Tuning& t = g_tuning;
    return pybind11::make_tuple(pybind11::make_tuple(t.variant[0], t.variant[1]), pybind11::make_tuple(t.tile[0], t.tile[1]),
                                pybind11::make_tuple(t.stages[0], t.stages[1]), t.batch_path, t.waves);
  });
  m.def("_fast_tiles", [](bool backward) { return lnmod::fast_tiles(backward); },
        "the compile-time tiles (D, vpt, wpr, rows ahead) of the forward or the backward, the default per D first");
#endif
  // The torch this module was compiled against: a prebuilt module is only used with the same torch.
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
