// The eager engine's FP8 linear in one host call: y = x @ W^T with x quantized 1x128 into a per-stream
// workspace by the CUDA quantizer (`kernels.quant_cuda`'s NVRTC kernel, passed in as a CUfunction), then
// cuBLASLt's blockwise GEMM from a plan made once per shape (`gemm/cublaslt.py`'s descriptors, layouts and
// heuristic query, in C++).
//
// Why C++: an eager decode step waits on the host time of every projection. From Python the same two launches
// cost ~37 us (a ctypes cuLaunchKernel plus torch._scaled_mm, which rebuilds cuBLASLt's descriptors and asks its
// heuristic on every call) where F.linear costs ~21 us. Here the call is one pybind hop, one cuLaunchKernel,
// two descriptor attributes, one cublasLtMatmul and one output allocation.
//
// The same runtime serves the training step's three blockwise GEMMs (`Runtime::gemm`, opt-in from
// `gemm/cublaslt_native.py`): torch._scaled_mm's call with its plan made once per shape instead of on every call.
//
// Built by torch.utils.cpp_extension as a CPU extension: libcuda and the libcublasLt torch loaded are opened at
// run time (dlopen), so building needs no CUDA toolkit. Python (`integrations/engine_native.py`) checks the
// result against the Python path bit for bit at first use and keeps that path where anything differs.
#include <torch/extension.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

namespace {

// --- libcuda (driver API) -----------------------------------------------------------------------------------
using cuLaunchKernel_t = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                 void**, void**);
using cuDeviceGet_t = int (*)(int*, int);
using cuDevicePrimaryCtxRetain_t = int (*)(void**, int);
using cuCtxSetCurrent_t = int (*)(void*);
using cuStreamIsCapturing_t = int (*)(void*, int*);
constexpr int kCudaErrorInvalidContext = 201;

// --- libcublasLt; values are cublasLt.h's (CUDA 12.9-13.1), as in gemm/cublaslt.py --------------------------
using ltCreate_t = int (*)(void**);
using ltDescCreate_t = int (*)(void**, int, int);
using ltSetAttr_t = int (*)(void*, int, const void*, size_t);
using ltLayoutCreate_t = int (*)(void**, int, uint64_t, uint64_t, int64_t);
using ltCreateOne_t = int (*)(void**);
using ltDestroy_t = int (*)(void*);
using ltHeuristic_t = int (*)(void*, void*, void*, void*, void*, void*, void*, int, void*, int*);
using ltMatmul_t = int (*)(void*, void*, const void*, const void*, void*, const void*, void*, const void*, const void*,
                           void*, void*, void*, const void*, void*, size_t, void*);
constexpr int kCompute32F = 68, kR32F = 0, kE4M3 = 28, kR16BF = 14;
constexpr int kOpN = 0, kOpT = 1;
constexpr int kTransA = 3, kTransB = 4, kAScalePtr = 17, kBScalePtr = 18, kFastAccum = 25, kAScaleMode = 31,
              kBScaleMode = 32;
constexpr int kVec128 = 4, kBlk128x128 = 5;  // cublasLtMatmulMatrixScale_t
constexpr int kPrefMaxWorkspace = 1;
constexpr int kStatusExecutionFailed = 13;
constexpr int kHeuristicBytes = 96;  // cublasLtMatmulHeuristicResult_t; its first 64 bytes are the algorithm
constexpr int64_t kMaxRows = 512;    // decode-sized batches only: the workspace is kMaxRows x K
constexpr size_t kMaxPlans = 16384;  // training shapes (one per token count); past it, new shapes run torch's call

template <typename F>
F sym(void* lib, const char* name, const std::string& path) {
  void* p = dlsym(lib, name);
  if (p == nullptr) throw std::runtime_error(path + " has no " + name);
  return reinterpret_cast<F>(p);
}

void check(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string("jetrl_precision native linear: ") + what + " failed (status " +
                                        std::to_string(rc) + ")");
}

struct Plan {
  void* desc = nullptr;
  void* layouts[4] = {nullptr, nullptr, nullptr, nullptr};
  alignas(16) unsigned char result[kHeuristicBytes];
  std::mutex mu;  // the descriptor holds one call's scale pointers until cublasLtMatmul returns
};

// Per device: the libraries, cuBLASLt's handle and plans, and the per-stream workspaces (quantized activation,
// its scales, cuBLASLt's scratch). A stream orders each layer's GEMM (the reader) before the next layer's
// quantization (the writer), so every layer of one K on one stream shares one activation workspace.
class Runtime {
 public:
  Runtime(const std::string& lt_path, int64_t device_index, int64_t lt_workspace_bytes)
      : device_(static_cast<int>(device_index)), ws_bytes_(static_cast<size_t>(lt_workspace_bytes)) {
    void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (cu == nullptr) throw std::runtime_error(std::string("libcuda.so.1 could not be opened: ") + dlerror());
    launch_ = sym<cuLaunchKernel_t>(cu, "cuLaunchKernel", "libcuda");
    device_get_ = sym<cuDeviceGet_t>(cu, "cuDeviceGet", "libcuda");
    retain_ = sym<cuDevicePrimaryCtxRetain_t>(cu, "cuDevicePrimaryCtxRetain", "libcuda");
    set_current_ = sym<cuCtxSetCurrent_t>(cu, "cuCtxSetCurrent", "libcuda");
    is_capturing_ = sym<cuStreamIsCapturing_t>(cu, "cuStreamIsCapturing", "libcuda");
    void* lt = dlopen(lt_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lt == nullptr) throw std::runtime_error(lt_path + " could not be opened: " + dlerror());
    desc_create_ = sym<ltDescCreate_t>(lt, "cublasLtMatmulDescCreate", lt_path);
    desc_set_ = sym<ltSetAttr_t>(lt, "cublasLtMatmulDescSetAttribute", lt_path);
    layout_create_ = sym<ltLayoutCreate_t>(lt, "cublasLtMatrixLayoutCreate", lt_path);
    pref_create_ = sym<ltCreateOne_t>(lt, "cublasLtMatmulPreferenceCreate", lt_path);
    pref_set_ = sym<ltSetAttr_t>(lt, "cublasLtMatmulPreferenceSetAttribute", lt_path);
    pref_destroy_ = sym<ltDestroy_t>(lt, "cublasLtMatmulPreferenceDestroy", lt_path);
    heuristic_ = sym<ltHeuristic_t>(lt, "cublasLtMatmulAlgoGetHeuristic", lt_path);
    matmul_ = sym<ltMatmul_t>(lt, "cublasLtMatmul", lt_path);
    make_current();
    check(sym<ltCreate_t>(lt, "cublasLtCreate", lt_path)(&handle_), "cublasLtCreate");
  }

  // y [M, N] = x [M, K] @ W^T; an undefined tensor (None in Python) for an input this path is not for, so the
  // caller runs the Python path: a capturing stream, M > kMaxRows, another dtype or device, unaligned rows.
  at::Tensor linear(const at::Tensor& x, int64_t stream_handle, int64_t quant_fn, const at::Tensor& w,
                    const at::Tensor& w_scale_t, int out_type) {
    if (x.dim() != 2 || !x.is_cuda() || x.get_device() != device_) return {};
    const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    if (m == 0 || m > kMaxRows || k != w.size(1) || x.stride(1) != 1 || x.stride(0) % 4 != 0 ||
        reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 != 0)
      return {};
    void* stream = reinterpret_cast<void*>(stream_handle);
    if (capturing(stream)) return {};

    const int64_t mp = (m + 3) / 4 * 4;  // cuBLASLt refuses an MN-major scale_a whose M is not a multiple of 4
    const int64_t groups = (k + 127) / 128;
    Workspace& ws = workspace(stream_handle, k);
    void* q = ws.data.data_ptr();
    void* s = ws.scale.data_ptr();
    const void* xp = x.data_ptr();

    // the quantizer: quant_1x128_rows(x, q, s, M, K, ldx, ldq_words, lds), a CTA per 4 rows of one 128-group
    int mi = static_cast<int>(m), ki = static_cast<int>(k), ldx = static_cast<int>(x.stride(0)),
        ldq = static_cast<int>(k / 4), lds = static_cast<int>(mp);
    void* args[] = {&xp, &q, &s, &mi, &ki, &ldx, &ldq, &lds};
    auto fn = reinterpret_cast<void*>(quant_fn);
    const unsigned gx = static_cast<unsigned>((m + 3) / 4), gy = static_cast<unsigned>(groups);
    auto quantize = [&] { return launch_(fn, gx, gy, 1, 128, 1, 1, 0, stream, args, nullptr); };
    int rc = quantize();
    if (rc == kCudaErrorInvalidContext) {  // a thread with no current context yet: make the primary one current
      make_current();
      rc = quantize();
    }
    check(rc, "cuLaunchKernel of the 1x128 quantizer");

    Plan& plan = plan_for(mp, n, k, out_type, kBlk128x128, w_scale_t.data_ptr(), s);
    at::Tensor y = at::empty({mp, n}, x.options());
    void* yp = y.data_ptr();
    void* lt_ws = ws.lt.data_ptr();
    {
      std::lock_guard<std::mutex> lock(plan.mu);
      // cuBLAS's A is W (scales w_scale_t), its B is x (scales s): torch's column-major reading of x @ W^T
      const void* sa = w_scale_t.data_ptr();
      desc_set_(plan.desc, kAScalePtr, &sa, sizeof(sa));
      desc_set_(plan.desc, kBScalePtr, &s, sizeof(s));
      auto multiply = [&] {
        return matmul_(handle_, plan.desc, &one_, w.data_ptr(), plan.layouts[0], q, plan.layouts[1], &zero_, yp,
                       plan.layouts[2], yp, plan.layouts[3], plan.result, lt_ws, ws_bytes_, stream);
      };
      rc = multiply();
      if (rc == kStatusExecutionFailed) {  // cuBLASLt's answer to a thread with no current context
        make_current();
        rc = multiply();
      }
    }
    check(rc, "cublasLtMatmul");
    return mp == m ? y : y.narrow(0, 0, m);
  }

  // out [M, N] = a [M, K] @ b_t [K, N] for e4m3 `a` (contiguous, 1x128 scales `sa`, MN-major) and `b_t` (the
  // transpose of a contiguous e4m3 [N, K]) with scales `sb` in the layout torch's scaled_mm takes for `mode_b`
  // (kBlk128x128: `row_major_padded_t`; kVec128: MN-major): the call torch._scaled_mm makes, its plan made once per
  // shape. An undefined tensor (None in Python) where the caller should run torch's call instead: a capturing
  // stream, another layout or device, M not a multiple of 4 or K of 128 (torch's path pads them), the plan table full.
  at::Tensor gemm(const at::Tensor& a, const at::Tensor& b_t, const at::Tensor& sa, const at::Tensor& sb, int64_t mode_b,
                  int64_t out_type, int64_t stream_handle) {
    if (a.dim() != 2 || b_t.dim() != 2 || !a.is_cuda() || a.get_device() != device_ || !b_t.is_cuda() ||
        b_t.get_device() != device_ || a.scalar_type() != at::kFloat8_e4m3fn || b_t.scalar_type() != at::kFloat8_e4m3fn)
      return {};
    const int64_t m = a.size(0), k = a.size(1), n = b_t.size(1);
    if (m == 0 || m % 4 != 0 || k % 128 != 0 || b_t.size(0) != k || !a.is_contiguous() || b_t.stride(0) != 1 || b_t.stride(1) != k ||
        (mode_b != kBlk128x128 && mode_b != kVec128))
      return {};
    at::ScalarType out_dtype;
    if (out_type == kR16BF) {
      out_dtype = at::kBFloat16;
    } else if (out_type == kR32F) {
      out_dtype = at::kFloat;
    } else {
      return {};
    }
    void* stream = reinterpret_cast<void*>(stream_handle);
    if (capturing(stream)) return {};
    Plan* plan = find_plan(m, n, k, static_cast<int>(out_type), static_cast<int>(mode_b));
    if (plan == nullptr) {
      if (plan_count() >= static_cast<int64_t>(kMaxPlans)) return {};
      plan = &plan_for(m, n, k, static_cast<int>(out_type), static_cast<int>(mode_b), sb.data_ptr(), sa.data_ptr());
    }
    at::Tensor y = at::empty({m, n}, a.options().dtype(out_dtype));
    void* yp = y.data_ptr();
    void* lt_ws = lt_workspace(stream_handle);
    int rc = 0;
    {
      std::lock_guard<std::mutex> lock(plan->mu);
      // cuBLAS's A is b (its scales sb), its B is a (scales sa): torch's column-major reading of a @ b_t
      const void* pa = sb.data_ptr();
      const void* pb = sa.data_ptr();
      desc_set_(plan->desc, kAScalePtr, &pa, sizeof(pa));
      desc_set_(plan->desc, kBScalePtr, &pb, sizeof(pb));
      auto multiply = [&] {
        return matmul_(handle_, plan->desc, &one_, b_t.data_ptr(), plan->layouts[0], a.data_ptr(), plan->layouts[1],
                       &zero_, yp, plan->layouts[2], yp, plan->layouts[3], plan->result, lt_ws, ws_bytes_, stream);
      };
      rc = multiply();
      if (rc == kStatusExecutionFailed) {  // cuBLASLt's answer to a thread with no current context
        make_current();
        rc = multiply();
      }
    }
    check(rc, "cublasLtMatmul");
    return y;
  }

  int64_t plan_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(plans_.size());
  }

 private:
  struct Workspace {
    at::Tensor data, scale, lt;
  };

  void make_current() {
    int dev = 0;
    void* ctx = nullptr;
    check(device_get_(&dev, device_), "cuDeviceGet");
    check(retain_(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(set_current_(ctx), "cuCtxSetCurrent");
  }

  // Whether `stream` is capturing a CUDA graph (or its state cannot be read): such calls go to torch's path. A
  // thread with no current context yet (a plain Python thread) gets the primary one made current first.
  bool capturing(void* stream) {
    int capture = 0;
    int rc = is_capturing_(stream, &capture);
    if (rc == kCudaErrorInvalidContext) {
      make_current();
      rc = is_capturing_(stream, &capture);
    }
    return rc != 0 || capture != 0;
  }

  Plan* find_plan(int64_t m, int64_t n, int64_t k, int out_type, int mode_a) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(std::make_tuple(m, n, k, out_type, mode_a));
    return it == plans_.end() ? nullptr : it->second.get();
  }

  // cuBLASLt's scratch for `gemm`, one per stream as torch keeps one per (handle, stream)
  void* lt_workspace(int64_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = lt_workspaces_.find(stream);
    if (it == lt_workspaces_.end()) {
      auto opts = at::TensorOptions().device(at::kCUDA, device_).dtype(at::kByte);
      it = lt_workspaces_.emplace(stream, at::empty({static_cast<int64_t>(std::max<size_t>(ws_bytes_, 256))}, opts)).first;
    }
    return it->second.data_ptr();
  }

  Workspace& workspace(int64_t stream, int64_t k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(stream, k);
    auto it = workspaces_.find(key);
    if (it != workspaces_.end()) return it->second;
    auto opts = at::TensorOptions().device(at::kCUDA, device_);
    Workspace ws{at::empty({kMaxRows * k}, opts.dtype(at::kFloat8_e4m3fn)),
                 at::empty({kMaxRows * ((k + 127) / 128)}, opts.dtype(at::kFloat)),
                 at::empty({static_cast<int64_t>(std::max<size_t>(ws_bytes_, 256))}, opts.dtype(at::kByte))};
    return workspaces_.emplace(key, std::move(ws)).first->second;
  }

  // Made as torch's scaled_gemm makes them, from the first call's scale pointers (later calls set their own).
  // mode_a is cuBLAS's A's scale mode (the weight-side operand: 128x128 blocks, or 1x128 for WGrad); B is 1x128.
  Plan& plan_for(int64_t m, int64_t n, int64_t k, int out_type, int mode_a, const void* scale_a, const void* scale_b) {
    const auto key = std::make_tuple(m, n, k, out_type, mode_a);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return *it->second;
    }
    auto plan = std::make_unique<Plan>();
    check(desc_create_(&plan->desc, kCompute32F, kR32F), "cublasLtMatmulDescCreate");
    const int32_t trans_a = kOpT, trans_b = kOpN, mode_b = kVec128;
    const int8_t fast = 0;
    check(desc_set_(plan->desc, kTransA, &trans_a, sizeof(trans_a)), "TRANSA");
    check(desc_set_(plan->desc, kTransB, &trans_b, sizeof(trans_b)), "TRANSB");
    check(desc_set_(plan->desc, kFastAccum, &fast, sizeof(fast)), "FAST_ACCUM");
    const int32_t mode_a32 = mode_a;
    check(desc_set_(plan->desc, kAScaleMode, &mode_a32, sizeof(mode_a32)), "A_SCALE_MODE");
    check(desc_set_(plan->desc, kBScaleMode, &mode_b, sizeof(mode_b)), "B_SCALE_MODE");
    check(desc_set_(plan->desc, kAScalePtr, &scale_a, sizeof(scale_a)), "A_SCALE_POINTER");
    check(desc_set_(plan->desc, kBScalePtr, &scale_b, sizeof(scale_b)), "B_SCALE_POINTER");
    // column-major: A = W stored K x N (ld K, op T), B = x stored K x M (ld K), C and D N x M (ld N), C typed as D
    const int rows[4] = {static_cast<int>(k), static_cast<int>(k), static_cast<int>(n), static_cast<int>(n)};
    const int64_t cols[4] = {n, m, m, m};
    const int types[4] = {kE4M3, kE4M3, out_type, out_type};
    for (int i = 0; i < 4; ++i)
      check(layout_create_(&plan->layouts[i], types[i], rows[i], cols[i], rows[i]), "cublasLtMatrixLayoutCreate");
    void* pref = nullptr;
    check(pref_create_(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t cap = ws_bytes_;
    int found = 0;
    int rc = pref_set_(pref, kPrefMaxWorkspace, &cap, sizeof(cap));
    if (rc == 0)
      rc = heuristic_(handle_, plan->desc, plan->layouts[0], plan->layouts[1], plan->layouts[2], plan->layouts[3], pref,
                      1, plan->result, &found);
    pref_destroy_(pref);
    check(rc, "cublasLtMatmulAlgoGetHeuristic");
    if (found < 1)
      throw std::runtime_error("jetrl_precision native linear: cuBLASLt has no algorithm for M=" + std::to_string(m) +
                               " N=" + std::to_string(n) + " K=" + std::to_string(k) + " scale mode " +
                               std::to_string(mode_a));
    std::lock_guard<std::mutex> lock(mu_);
    return *plans_.emplace(key, std::move(plan)).first->second;
  }

  int device_;
  size_t ws_bytes_;
  void* handle_ = nullptr;
  const float one_ = 1.0f, zero_ = 0.0f;
  cuLaunchKernel_t launch_;
  cuDeviceGet_t device_get_;
  cuDevicePrimaryCtxRetain_t retain_;
  cuCtxSetCurrent_t set_current_;
  cuStreamIsCapturing_t is_capturing_;
  ltDescCreate_t desc_create_;
  ltSetAttr_t desc_set_;
  ltLayoutCreate_t layout_create_;
  ltCreateOne_t pref_create_;
  ltSetAttr_t pref_set_;
  ltDestroy_t pref_destroy_;
  ltHeuristic_t heuristic_;
  ltMatmul_t matmul_;
  std::mutex mu_;
  std::map<std::pair<int64_t, int64_t>, Workspace> workspaces_;
  // the engine's M is padded to a multiple of 4 up to kMaxRows (at most 128 plans per N, K); training GEMMs add
  // one per micro-batch token count, which `gemm` bounds (kMaxPlans)
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int>, std::unique_ptr<Plan>> plans_;
  std::map<int64_t, at::Tensor> lt_workspaces_;  // stream -> cuBLASLt scratch of `gemm`
};

// One layer: its weight operands (views of the engine's parameters, so in-place weight installs show) and the
// quantizer for its activation dtype.
class Linear {
 public:
  Linear(std::shared_ptr<Runtime> rt, at::Tensor w, at::Tensor w_scale_t, int64_t quant_fn)
      : rt_(std::move(rt)), w_(std::move(w)), w_scale_t_(std::move(w_scale_t)), quant_fn_(quant_fn) {
    if (w_.dim() != 2 || !w_.is_contiguous() || w_.scalar_type() != at::kFloat8_e4m3fn)
      throw std::invalid_argument("jetrl_precision native linear: the weight must be a contiguous e4m3 [N, K]");
    if (w_.size(0) % 128 != 0 || w_.size(1) % 128 != 0)
      throw std::invalid_argument("jetrl_precision native linear: N and K must be multiples of 128");
  }

  at::Tensor operator()(const at::Tensor& x, int64_t stream) const {
    const auto dt = x.scalar_type();
    if (dt != at::kBFloat16) return {};  // the quantizer given is the bf16 one
    return rt_->linear(x, stream, quant_fn_, w_, w_scale_t_, kR16BF);
  }

 private:
  std::shared_ptr<Runtime> rt_;
  at::Tensor w_, w_scale_t_;
  int64_t quant_fn_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The eager engine's FP8 linear (1x128 quantizer + cuBLASLt blockwise GEMM) in one host call";
  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
      .def(py::init<const std::string&, int64_t, int64_t>(), py::arg("cublaslt_path"), py::arg("device_index"),
           py::arg("lt_workspace_bytes"))
      .def_property_readonly("plan_count", &Runtime::plan_count)
      // the training step's GEMMs (fprop, DGrad, WGrad) with a plan per shape; the GIL released as around `Linear`
      .def("gemm", &Runtime::gemm, py::arg("a"), py::arg("b_t"), py::arg("scale_a"), py::arg("scale_b"), py::arg("mode_b"),
           py::arg("out_type"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  py::class_<Linear>(m, "Linear")
      .def(py::init<std::shared_ptr<Runtime>, at::Tensor, at::Tensor, int64_t>(), py::arg("runtime"),
           py::arg("weight"), py::arg("weight_scale_t"), py::arg("quant_fn"))
      // lets go of the GIL while it launches, as torch's own ops do: the engine's other Python threads run meanwhile
      .def("__call__", &Linear::operator(), py::arg("x"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}
