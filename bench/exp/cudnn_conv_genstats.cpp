// Probe: can cuDNN's backend graph API (the C API of cudnn_graph.h, cuDNN 9)
// fuse a convolution forward with batch-norm statistics in its epilogue
// (conv fprop -> GEN_STATS SUM_SQSUM: per-channel sum and sum of squares of
// the conv output), as NVIDIA's MLPerf ResNet-50 does, and how fast is it
// beside the plain convolution plus a separate statistics pass?
//
// Plain C++17 + CUDA runtime + cuDNN backend API (no LibTorch, no
// cudnn-frontend). It holds a few CUDA kernels (data init, the separate
// stats pass, a BN-apply+ReLU pass, a double-precision reference), so it is
// compiled as CUDA: nvcc -x cu (bench/exp/cudnn_conv_genstats.sh does that).
//
// For every ResNet-50 1x1/3x3 conv shape (batch 256 by default, NHWC,
// bf16 or fp16 I/O, fp32 accumulation) it builds these operation graphs:
//   conv              X,W -> conv fprop -> Y                       (baseline)
//   conv_genstats     X,W -> conv fprop -> Y -> genstats -> SUM,SQSUM
//   sbr_conv_genstats X -> *scale -> +bias -> relu -> conv -> Y -> genstats
//                     (the MLPerf pattern: previous BN's apply+ReLU in the
//                     prologue, this BN's stats in the epilogue)
//   conv_reduce       X,W -> conv -> Y -> reduction(add) -> SUM, and
//                     Y*Y -> reduction(add) -> SQSUM (generic alternative)
// asks heuristics (mode A, then FALLBACK) for engine configs, finalizes up
// to --max-plans execution plans, times each briefly, keeps the fastest and
// times it with CUDA events (--warmup, then --iters launches). It times the
// separate passes the fusion would replace with simple kernels of its own
// (stats over Y; relu(x*scale+bias) over X), checks the fused sums against
// a double-precision reduction of the Y the graph wrote (and, on two small
// shapes, against a host conv in double), and prints one JSON line per
// shape. A graph cuDNN will not run gives a one-line error naming the cuDNN
// status (also in the JSON, as <variant>_error).
//
// Output fields per variant V: V_ms (best finalized plan), V_engine (global
// engine index), V_rt_compiled (runtime-fusion engine, NVRTC), V_notes
// (b<behavior note> n<numerical note> codes of cudnn_graph.h), V_ws, V_plans,
// V_configs, V_build_s, V_heur_first_ms, V_accumulates (SUM/SQSUM added to,
// not overwritten: the timed loop then zeroes them), V_err_sum (|sum - ref|
// over the channel's sum of |y|), V_err_sqsum (relative), V_host_err_* on
// the check shapes; V_error when cuDNN refused the graph.
//
// --descriptors-only finalizes the tensor and operation descriptors of every
// graph without a GPU (it ran clean against cuDNN 9.19 on a CPU machine).
// Measured on an H200 with cuDNN 9.14 (2026-12-04, bench/RESULTS.md
// "Session 13"): in bf16 conv_genstats is 2.2x slower than conv plus the
// stats pass and sbr_conv_genstats has no engine; in fp16 both fuse and win.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn_graph.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------- errors

struct CudnnError : std::runtime_error {
  cudnnStatus_t status;
  CudnnError(cudnnStatus_t s, const std::string& what) : std::runtime_error(what), status(s) {}
};

std::string last_cudnn_message() {
  char buf[1024] = {0};
  cudnnGetLastErrorString(buf, sizeof(buf));
  std::string m(buf);
  for (char& ch : m)
    if (ch == '\n' || ch == '\r') ch = ' ';
  if (m.size() > 400) m = m.substr(0, 400) + "...";
  return m;
}

void ck(cudnnStatus_t s, const char* where) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  std::string msg = std::string(cudnnGetErrorString(s)) + " (" + std::to_string(int(s)) + ") at " + where;
  std::string detail = last_cudnn_message();
  if (!detail.empty()) msg += ": " + detail;
  throw CudnnError(s, msg);
}

void cuda_ck(cudaError_t e, const char* where) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorString(e) + " at " + where);
}
#define CUDA_CK(x) cuda_ck((x), #x)

// ---------------------------------------------------------------- JSON

std::string jesc(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      o += ' ';
    } else {
      o += ch;
    }
  }
  return o;
}

struct Json {
  std::ostringstream o;
  bool first = true;
  Json() { o << "{"; }
  void key(const std::string& k) {
    o << (first ? "" : ",") << "\"" << jesc(k) << "\":";
    first = false;
  }
  Json& s(const std::string& k, const std::string& v) {
    key(k);
    o << "\"" << jesc(v) << "\"";
    return *this;
  }
  Json& i(const std::string& k, long long v) {
    key(k);
    o << v;
    return *this;
  }
  Json& d(const std::string& k, double v) {
    key(k);
    if (std::isfinite(v)) {
      char b[64];
      std::snprintf(b, sizeof(b), "%.5g", v);
      o << b;
    } else {
      o << "null";
    }
    return *this;
  }
  Json& b(const std::string& k, bool v) {
    key(k);
    o << (v ? "true" : "false");
    return *this;
  }
  std::string str() { return o.str() + "}"; }
};

// ------------------------------------------------- backend descriptors

// Owns one cudnnBackendDescriptor_t.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  Desc(cudnnBackendDescriptorType_t t, const char* what) { ck(cudnnBackendCreateDescriptor(t, &d), what); }
  ~Desc() {
    if (d) cudnnBackendDestroyDescriptor(d);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc& set(cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, int64_t n, const void* v, const char* what) {
    ck(cudnnBackendSetAttribute(d, a, t, n, v), what);
    return *this;
  }
  Desc& desc(cudnnBackendAttributeName_t a, const Desc* other, const char* what) {
    return set(a, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &other->d, what);
  }
  void finalize(const char* what) { ck(cudnnBackendFinalize(d), what); }
};
using DescPtr = std::unique_ptr<Desc>;

// Tensor UIDs in every graph.
enum : int64_t { kX = 1, kW = 2, kY = 3, kScale = 4, kBias = 5, kSum = 6, kSqSum = 7, kVirtual = 100 };

using Dims = std::array<int64_t, 4>;

// dims in N,C,H,W order; strides of a channels-last (NHWC / KRSC) layout.
Dims nhwc_strides(const Dims& dims) {
  const int64_t c = dims[1], h = dims[2], w = dims[3];
  return {c * h * w, 1, w * c, c};
}

struct Shape {
  std::string name;
  int64_t n, c, h, w, k, r, s, stride, pad;
  int count;  // times the shape occurs in ResNet-50 (torchvision v1.5: stride on the 3x3)
  int64_t p() const { return (h + 2 * pad - r) / stride + 1; }
  int64_t q() const { return (w + 2 * pad - s) / stride + 1; }
  double gflop() const { return 2.0 * n * p() * q() * k * c * r * s * 1e-9; }
};

// ResNet-50's convolutions but the 7x7 stem (C=3), batch `n`.
std::vector<Shape> resnet50_shapes(int64_t n) {
  std::vector<Shape> v = {
      // layer1, 56x56
      {"l1.1x1.64-64", n, 64, 56, 56, 64, 1, 1, 1, 0, 1},
      {"l1.1x1.256-64", n, 256, 56, 56, 64, 1, 1, 1, 0, 2},
      {"l1.3x3.64-64", n, 64, 56, 56, 64, 3, 3, 1, 1, 3},
      {"l1.1x1.64-256", n, 64, 56, 56, 256, 1, 1, 1, 0, 4},  // 3 expand + downsample
      // layer2
      {"l2.1x1.256-128@56", n, 256, 56, 56, 128, 1, 1, 1, 0, 1},
      {"l2.3x3.128-128.s2", n, 128, 56, 56, 128, 3, 3, 2, 1, 1},
      {"l2.ds.1x1.256-512.s2", n, 256, 56, 56, 512, 1, 1, 2, 0, 1},
      {"l2.1x1.512-128", n, 512, 28, 28, 128, 1, 1, 1, 0, 3},
      {"l2.3x3.128-128", n, 128, 28, 28, 128, 3, 3, 1, 1, 3},
      {"l2.1x1.128-512", n, 128, 28, 28, 512, 1, 1, 1, 0, 4},
      // layer3
      {"l3.1x1.512-256@28", n, 512, 28, 28, 256, 1, 1, 1, 0, 1},
      {"l3.3x3.256-256.s2", n, 256, 28, 28, 256, 3, 3, 2, 1, 1},
      {"l3.ds.1x1.512-1024.s2", n, 512, 28, 28, 1024, 1, 1, 2, 0, 1},
      {"l3.1x1.1024-256", n, 1024, 14, 14, 256, 1, 1, 1, 0, 5},
      {"l3.3x3.256-256", n, 256, 14, 14, 256, 3, 3, 1, 1, 5},
      {"l3.1x1.256-1024", n, 256, 14, 14, 1024, 1, 1, 1, 0, 6},
      // layer4
      {"l4.1x1.1024-512@14", n, 1024, 14, 14, 512, 1, 1, 1, 0, 1},
      {"l4.3x3.512-512.s2", n, 512, 14, 14, 512, 3, 3, 2, 1, 1},
      {"l4.ds.1x1.1024-2048.s2", n, 1024, 14, 14, 2048, 1, 1, 2, 0, 1},
      {"l4.1x1.2048-512", n, 2048, 7, 7, 512, 1, 1, 1, 0, 2},
      {"l4.3x3.512-512", n, 512, 7, 7, 512, 3, 3, 1, 1, 2},
      {"l4.1x1.512-2048", n, 512, 7, 7, 2048, 1, 1, 1, 0, 3},
  };
  return v;
}

// Small shapes whose conv is also computed on the host (in double).
std::vector<Shape> check_shapes() {
  return {
      {"check.3x3.64-64", 4, 64, 14, 14, 64, 3, 3, 1, 1, 0},
      {"check.1x1.64-128.s2", 4, 64, 14, 14, 128, 1, 1, 2, 0, 0},
  };
}

enum class Variant { Conv, ConvGenstats, SbrConvGenstats, ConvReduce };
const char* vname(Variant v) {
  switch (v) {
    case Variant::Conv: return "conv";
    case Variant::ConvGenstats: return "conv_genstats";
    case Variant::SbrConvGenstats: return "sbr_conv_genstats";
    case Variant::ConvReduce: return "conv_reduce";
  }
  return "?";
}
bool has_stats(Variant v) { return v != Variant::Conv; }
bool has_prologue(Variant v) { return v == Variant::SbrConvGenstats; }

// An operation graph and everything it references (descriptors must outlive
// the graph, its heuristics and its plans).
struct Graph {
  std::vector<DescPtr> keep;
  Desc* opgraph = nullptr;

  Desc* make(cudnnBackendDescriptorType_t t, const char* what) {
    keep.emplace_back(new Desc(t, what));
    return keep.back().get();
  }

  Desc* tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, bool is_virtual) {
    Desc* t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "create tensor");
    const Dims str = nhwc_strides(dims);
    const int64_t align = 16;
    t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type")
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims")
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str.data(), "tensor strides")
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid")
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment")
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual");
    t->finalize("finalize tensor");
    return t;
  }

  Desc* pointwise(cudnnPointwiseMode_t mode, Desc* x, Desc* b, Desc* y) {
    Desc* pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "create pointwise desc");
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode")
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise math prec");
    pw->finalize("finalize pointwise desc");
    Desc* op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "create pointwise op");
    op->desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, "pointwise op desc")
        .desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise op x");
    if (b) op->desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise op b");
    op->desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise op y");
    op->finalize("finalize pointwise op");
    return op;
  }

  Desc* conv(const Shape& sh, Desc* x, Desc* w, Desc* y) {
    Desc* cd = make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "create conv desc");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    const int64_t nsp = 2;
    const int64_t pad[2] = {sh.pad, sh.pad}, str[2] = {sh.stride, sh.stride}, dil[2] = {1, 1};
    cd->set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "conv comp type")
        .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode, "conv mode")
        .set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &nsp, "conv spatial dims")
        .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad, "conv pre padding")
        .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad, "conv post padding")
        .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dil, "conv dilations")
        .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, str, "conv strides");
    cd->finalize("finalize conv desc");
    Desc* op = make(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, "create conv op");
    const float alpha = 1.f, beta = 0.f;
    op->desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x, "conv op x")
        .desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w, "conv op w")
        .desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, y, "conv op y")
        .desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, cd, "conv op desc")
        .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha, "conv op alpha")
        .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &beta, "conv op beta");
    op->finalize("finalize conv op");
    return op;
  }

  Desc* genstats(Desc* y, Desc* sum, Desc* sqsum) {
    Desc* op = make(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR, "create genstats op");
    const cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    op->set(CUDNN_ATTR_OPERATION_GENSTATS_MODE, CUDNN_TYPE_GENSTATS_MODE, 1, &mode, "genstats mode")
        .set(CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "genstats math prec")
        .desc(CUDNN_ATTR_OPERATION_GENSTATS_XDESC, y, "genstats x")
        .desc(CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum, "genstats sum")
        .desc(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum, "genstats sqsum");
    op->finalize("finalize genstats op");
    return op;
  }

  Desc* reduce_add(Desc* x, Desc* y) {
    Desc* rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "create reduction desc");
    const cudnnReduceTensorOp_t red = CUDNN_REDUCE_TENSOR_ADD;
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    rd->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red, "reduction operator")
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction comp type");
    rd->finalize("finalize reduction desc");
    Desc* op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "create reduction op");
    op->desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x")
        .desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y")
        .desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "reduction desc");
    op->finalize("finalize reduction op");
    return op;
  }

  // io: X, W, Y; sb: the prologue's scale and bias.
  void build(cudnnHandle_t h, Variant v, const Shape& sh, cudnnDataType_t io, cudnnDataType_t sb) {
    const Dims xd = {sh.n, sh.c, sh.h, sh.w}, wd = {sh.k, sh.c, sh.r, sh.s};
    const Dims yd = {sh.n, sh.k, sh.p(), sh.q()}, cd = {1, sh.c, 1, 1}, kd = {1, sh.k, 1, 1};
    int64_t vuid = kVirtual;
    std::vector<Desc*> ops;
    Desc* X = tensor(kX, io, xd, false);
    Desc* W = tensor(kW, io, wd, false);
    Desc* Y = tensor(kY, io, yd, false);
    Desc* conv_in = X;
    if (has_prologue(v)) {
      Desc* S = tensor(kScale, sb, cd, false);
      Desc* B = tensor(kBias, sb, cd, false);
      Desc* t1 = tensor(vuid++, CUDNN_DATA_FLOAT, xd, true);
      Desc* t2 = tensor(vuid++, CUDNN_DATA_FLOAT, xd, true);
      Desc* t3 = tensor(vuid++, CUDNN_DATA_FLOAT, xd, true);
      ops.push_back(pointwise(CUDNN_POINTWISE_MUL, X, S, t1));
      ops.push_back(pointwise(CUDNN_POINTWISE_ADD, t1, B, t2));
      ops.push_back(pointwise(CUDNN_POINTWISE_RELU_FWD, t2, nullptr, t3));
      conv_in = t3;
    }
    ops.push_back(conv(sh, conv_in, W, Y));
    if (v == Variant::ConvGenstats || v == Variant::SbrConvGenstats) {
      Desc* SUM = tensor(kSum, CUDNN_DATA_FLOAT, kd, false);
      Desc* SQ = tensor(kSqSum, CUDNN_DATA_FLOAT, kd, false);
      ops.push_back(genstats(Y, SUM, SQ));
    } else if (v == Variant::ConvReduce) {
      Desc* SUM = tensor(kSum, CUDNN_DATA_FLOAT, kd, false);
      Desc* SQ = tensor(kSqSum, CUDNN_DATA_FLOAT, kd, false);
      Desc* y2 = tensor(vuid++, CUDNN_DATA_FLOAT, yd, true);
      ops.push_back(reduce_add(Y, SUM));
      ops.push_back(pointwise(CUDNN_POINTWISE_MUL, Y, Y, y2));
      ops.push_back(reduce_add(y2, SQ));
    }
    if (!h) return;  // --descriptors-only: tensors and operations, no graph (no GPU needed)
    opgraph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "create operation graph");
    std::vector<cudnnBackendDescriptor_t> raw;
    for (Desc* o : ops) raw.push_back(o->d);
    opgraph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "opgraph handle")
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()), raw.data(),
             "opgraph ops");
    opgraph->finalize("finalize operation graph");
  }

  // Engine configs from one heuristics mode (possibly none).
  std::vector<DescPtr> heuristics(cudnnBackendHeurMode_t mode) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "create heuristics");
    heur.desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, opgraph, "heuristics opgraph")
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    heur.finalize("finalize heuristics");
    int64_t count = 0;
    ck(cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                nullptr),
       "heuristics result count");
    std::vector<DescPtr> cfgs;
    if (count <= 0) return cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.emplace_back(new Desc(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "create engine config"));
      raw.push_back(cfgs.back()->d);
    }
    int64_t got = 0;
    ck(cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                raw.data()),
       "heuristics results");
    cfgs.resize(size_t(std::max<int64_t>(0, std::min(got, count))));
    return cfgs;
  }
};

struct EngineInfo {
  int64_t index = -1;
  bool runtime_compiled = false;
  std::string notes;
};

EngineInfo engine_info(const Desc& cfg) {
  EngineInfo info;
  try {
    Desc eng(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "create engine");
    int64_t n = 0;
    ck(cudnnBackendGetAttribute(cfg.d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &eng.d),
       "engine of config");
    ck(cudnnBackendGetAttribute(eng.d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &info.index),
       "engine index");
    cudnnBackendBehaviorNote_t bn[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
    n = 0;
    if (cudnnBackendGetAttribute(eng.d, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                                 CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, bn) == CUDNN_STATUS_SUCCESS) {
      for (int64_t i = 0; i < n; ++i) {
        if (bn[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) info.runtime_compiled = true;
        info.notes += "b" + std::to_string(int(bn[i])) + " ";
      }
    }
    cudnnBackendNumericalNote_t nn[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    n = 0;
    if (cudnnBackendGetAttribute(eng.d, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                 CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, nn) == CUDNN_STATUS_SUCCESS) {
      for (int64_t i = 0; i < n; ++i) info.notes += "n" + std::to_string(int(nn[i])) + " ";
    }
  } catch (const CudnnError&) {
    // informational only
  }
  return info;
}

// ---------------------------------------------------------------- kernels

template <typename T>
__host__ __device__ inline float to_f(T v);
template <>
__host__ __device__ inline float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__host__ __device__ inline float to_f<__half>(__half v) {
  return __half2float(v);
}
template <typename T>
__host__ __device__ inline T from_f(float v);
template <>
__host__ __device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__host__ __device__ inline __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__host__ __device__ inline float from_f<float>(float v) {
  return v;
}

__device__ inline uint32_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}

template <typename T>
__global__ void fill_uniform(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = float(mix64(seed * 0x9e3779b97f4a7c15ULL + uint64_t(i)) >> 8) * (1.f / 16777216.f);
    p[i] = from_f<T>(lo + (hi - lo) * u);
  }
}

// Per-channel sum and sum of squares (and sum of |y| when abs_sum != null)
// of an [M, K] row-major (NHWC) matrix. Each thread owns 8 adjacent channels
// (one 16-byte load); a block is K/8 x TY threads walking rows; partials are
// added over the block in shared memory, then atomically into `sum`/`sqsum`
// (which the caller zeroes). Acc/Out = float: the timed "separate stats
// pass"; double: the reference.
template <typename T, typename Acc>
__global__ void channel_stats(const T* __restrict__ y, int64_t M, int K, Acc* sum, Acc* sqsum, Acc* abs_sum) {
  extern __shared__ unsigned char smem_raw[];
  Acc* sh = reinterpret_cast<Acc*>(smem_raw);
  const int tx_n = K / 8;
  const int ty_n = blockDim.x / tx_n;
  const int tx = threadIdx.x % tx_n, ty = threadIdx.x / tx_n;
  Acc s[8], q[8], a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j] = q[j] = a[j] = Acc(0);
  auto add = [&](const uint4& v) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const Acc f = Acc(to_f<T>(e[j]));
      s[j] += f;
      q[j] += f * f;
      a[j] += f < Acc(0) ? -f : f;
    }
  };
  if (ty < ty_n) {
    const int64_t step = int64_t(gridDim.x) * ty_n;
    const T* base = y + tx * 8;
    int64_t row = int64_t(blockIdx.x) * ty_n + ty;
    for (; row + 3 * step < M; row += 4 * step) {  // four 16-byte loads in flight
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const uint4*>(base + (row + u * step) * K);
#pragma unroll
      for (int u = 0; u < 4; ++u) add(v[u]);
    }
    for (; row < M; row += step) add(*reinterpret_cast<const uint4*>(base + row * K));
  }
  const int nst = abs_sum ? 3 : 2;
  // layout: sh[(stat * ty_n + ty) * K + channel]
  if (ty < ty_n) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sh[(0 * ty_n + ty) * K + tx * 8 + j] = s[j];
      sh[(1 * ty_n + ty) * K + tx * 8 + j] = q[j];
      if (nst == 3) sh[(2 * ty_n + ty) * K + tx * 8 + j] = a[j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < K; c += blockDim.x) {
    for (int st = 0; st < nst; ++st) {
      Acc t = Acc(0);
      for (int r = 0; r < ty_n; ++r) t += sh[(st * ty_n + r) * K + c];
      Acc* out = st == 0 ? sum : st == 1 ? sqsum : abs_sum;
      atomicAdd(out + c, t);
    }
  }
}

// y = relu(x * scale[c] + bias[c]) over an [M, C] matrix: the BN-apply pass
// that the MLPerf prologue fusion replaces.
template <typename T>
__global__ void bn_apply_relu(const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ scale,
                              const float* __restrict__ bias, int64_t n_vec, int C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = reinterpret_cast<const uint4*>(x)[i];
    const T* e = reinterpret_cast<const T*>(&v);
    uint4 o;
    T* oe = reinterpret_cast<T*>(&o);
    const int c0 = int((i * 8) % C);
#pragma unroll
    for (int j = 0; j < 8; ++j) oe[j] = from_f<T>(fmaxf(0.f, to_f<T>(e[j]) * scale[c0 + j] + bias[c0 + j]));
    reinterpret_cast<uint4*>(y)[i] = o;
  }
}

// ---------------------------------------------------------------- options

struct Options {
  std::string dtype = "bf16";
  int64_t batch = 256;
  int warmup = 10;
  int iters = 50;
  int max_plans = 4;   // finalized plans per graph to time (autotune)
  int max_tries = 24;  // engine configs to try finalizing per graph
  int max_rt_plans = 2;  // of which runtime-compiled (NVRTC, seconds each to build)
  std::string only;    // substring filter on shape names
  std::vector<Variant> variants = {Variant::Conv, Variant::ConvGenstats, Variant::SbrConvGenstats,
                                   Variant::ConvReduce};
  bool checks = true;  // small shapes against a host conv
  bool big = true;     // the ResNet-50 shapes
  bool sb_float = false;  // prologue scale/bias in fp32 instead of the I/O type
  bool desc_only = false;  // finalize tensor and operation descriptors only (no GPU)
  double max_ws_gib = 2.0;
};

void usage() {
  std::fprintf(stderr,
               "usage: cudnn_conv_genstats [--dtype bf16|fp16] [--batch N] [--warmup N] [--iters N]\n"
               "         [--max-plans N] [--max-rt-plans N] [--max-tries N] [--only SUBSTR] [--variants a,b,...]\n"
               "         [--no-check] [--check-only] [--sb-float] [--descriptors-only]\n"
               "variants: conv conv_genstats sbr_conv_genstats conv_reduce\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dtype") o.dtype = next();
    else if (a == "--batch") o.batch = std::stoll(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--max-plans") o.max_plans = std::stoi(next());
    else if (a == "--max-tries") o.max_tries = std::stoi(next());
    else if (a == "--max-rt-plans") o.max_rt_plans = std::stoi(next());
    else if (a == "--only") o.only = next();
    else if (a == "--no-check") o.checks = false;
    else if (a == "--check-only") o.big = false;
    else if (a == "--sb-float") o.sb_float = true;
    else if (a == "--descriptors-only") o.desc_only = true;
    else if (a == "--variants") {
      o.variants.clear();
      std::stringstream ss(next());
      std::string t;
      while (std::getline(ss, t, ',')) {
        if (t == "conv") o.variants.push_back(Variant::Conv);
        else if (t == "conv_genstats") o.variants.push_back(Variant::ConvGenstats);
        else if (t == "sbr_conv_genstats") o.variants.push_back(Variant::SbrConvGenstats);
        else if (t == "conv_reduce") o.variants.push_back(Variant::ConvReduce);
        else {
          usage();
          std::exit(2);
        }
      }
    } else {
      usage();
      std::exit(2);
    }
  }
  if (o.dtype != "bf16" && o.dtype != "fp16") {
    usage();
    std::exit(2);
  }
  return o;
}

// ---------------------------------------------------------------- buffers

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) {
    if (b) CUDA_CK(cudaMalloc(&p, b));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

float time_loop(cudaStream_t st, int warmup, int iters, const std::function<void()>& f) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t a, b;
  CUDA_CK(cudaEventCreate(&a));
  CUDA_CK(cudaEventCreate(&b));
  CUDA_CK(cudaEventRecord(a, st));
  for (int i = 0; i < iters; ++i) f();
  CUDA_CK(cudaEventRecord(b, st));
  CUDA_CK(cudaEventSynchronize(b));
  float ms = 0;
  CUDA_CK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  CUDA_CK(cudaGetLastError());
  return ms / float(iters);
}

struct Stats {
  std::vector<double> sum, sq, abs;
};

// |a - ref| over the channel's sum of |y| (the sum of a zero-mean output is
// near 0, so a plain relative error would be meaningless); sqsum: plain
// relative error.
void stats_error(const std::vector<float>& s, const std::vector<float>& q, const Stats& ref, double& e_sum,
                 double& e_sq) {
  e_sum = e_sq = 0;
  for (size_t c = 0; c < ref.sum.size(); ++c) {
    const double es = std::fabs(double(s[c]) - ref.sum[c]) / std::max(ref.abs[c], 1e-30);
    const double eq = std::fabs(double(q[c]) - ref.sq[c]) / std::max(ref.sq[c], 1e-30);
    e_sum = std::max(e_sum, std::isfinite(es) ? es : INFINITY);
    e_sq = std::max(e_sq, std::isfinite(eq) ? eq : INFINITY);
    if (!std::isfinite(s[c]) || !std::isfinite(q[c])) e_sum = e_sq = INFINITY;
  }
}

struct Ctx {
  cudnnHandle_t handle;
  cudaStream_t stream;
  int sms;
  Options opt;
  cudnnDataType_t io;
};

template <typename T>
class Runner {
 public:
  Runner(Ctx& ctx, const Shape& sh, bool host_check) : c_(ctx), sh_(sh), host_check_(host_check) {}

  // One JSON line; `ms` gets the timings (for the count-weighted summary).
  std::string run(std::map<std::string, double>& ms) {
    const auto t_start = std::chrono::steady_clock::now();
    const int64_t M_x = sh_.n * sh_.h * sh_.w, M_y = sh_.n * sh_.p() * sh_.q();
    const size_t xe = size_t(M_x * sh_.c), we = size_t(sh_.k * sh_.r * sh_.s * sh_.c), ye = size_t(M_y * sh_.k);
    DevBuf X(xe * sizeof(T)), W(we * sizeof(T)), Y(ye * sizeof(T)), X2(xe * sizeof(T));
    DevBuf S(sh_.c * sizeof(T)), B(sh_.c * sizeof(T)), Sf(sh_.c * sizeof(float)), Bf(sh_.c * sizeof(float));
    DevBuf sum(sh_.k * sizeof(float)), sq(sh_.k * sizeof(float));
    DevBuf rsum(sh_.k * sizeof(double)), rsq(sh_.k * sizeof(double)), rabs(sh_.k * sizeof(double));
    const float wscale = 1.f / std::sqrt(float(sh_.c * sh_.r * sh_.s));
    fill(static_cast<T*>(X.p), xe, 1, -1.f, 1.f);
    fill(static_cast<T*>(W.p), we, 2, -wscale, wscale);
    fill(static_cast<T*>(S.p), sh_.c, 3, 0.5f, 1.5f);
    fill(static_cast<T*>(B.p), sh_.c, 4, -0.5f, 0.5f);
    fill(static_cast<float*>(Sf.p), sh_.c, 3, 0.5f, 1.5f);
    fill(static_cast<float*>(Bf.p), sh_.c, 4, -0.5f, 0.5f);
    CUDA_CK(cudaStreamSynchronize(c_.stream));

    Json j;
    j.s("kind", host_check_ ? "check" : "shape").s("dtype", c_.opt.dtype).s("name", sh_.name);
    j.i("n", sh_.n).i("c", sh_.c).i("h", sh_.h).i("w", sh_.w).i("k", sh_.k).i("r", sh_.r).i("s", sh_.s);
    j.i("stride", sh_.stride).i("pad", sh_.pad).i("p", sh_.p()).i("q", sh_.q()).i("count", sh_.count);
    j.d("gflop", sh_.gflop());

    // Separate passes the fusion would replace.
    const int tx = int(sh_.k / 8), ty = std::max(1, 256 / tx);
    const int threads = tx * ty;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((M_y + 4 * ty - 1) / (4 * ty), int64_t(c_.sms) * 4));
    const size_t smem_f = size_t(2) * ty * sh_.k * sizeof(float);
    auto stats_pass = [&]() {
      cudaMemsetAsync(sum.p, 0, sum.bytes, c_.stream);
      cudaMemsetAsync(sq.p, 0, sq.bytes, c_.stream);
      channel_stats<T, float><<<unsigned(blocks), threads, smem_f, c_.stream>>>(
          static_cast<const T*>(Y.p), M_y, int(sh_.k), static_cast<float*>(sum.p), static_cast<float*>(sq.p),
          nullptr);
    };
    const bool stats_ok = sh_.k % 8 == 0 && tx <= 1024 && smem_f <= 48 * 1024;
    if (stats_ok) {
      fill(static_cast<T*>(Y.p), ye, 5, -1.f, 1.f);
      const double t = time_loop(c_.stream, c_.opt.warmup, c_.opt.iters, stats_pass);
      j.d("stats_pass_ms", t).d("stats_pass_gbs", double(ye * sizeof(T)) / (t * 1e-3) * 1e-9);
      ms["stats_pass"] = t;
    }
    if (sh_.c % 8 == 0) {
      const int64_t nv = int64_t(xe / 8);
      const unsigned ab = unsigned(std::min<int64_t>((nv + 255) / 256, int64_t(c_.sms) * 16));
      const double t = time_loop(c_.stream, c_.opt.warmup, c_.opt.iters, [&]() {
        bn_apply_relu<T><<<ab, 256, 0, c_.stream>>>(static_cast<const T*>(X.p), static_cast<T*>(X2.p),
                                                    static_cast<const float*>(Sf.p),
                                                    static_cast<const float*>(Bf.p), nv, int(sh_.c));
      });
      j.d("apply_pass_ms", t);
      ms["apply_pass"] = t;
    }

    for (Variant v : c_.opt.variants) {
      const std::string vn = vname(v);
      try {
        if (c_.opt.sb_float)
          run_variant(v, j, X, W, Y, Sf, Bf, sum, sq, rsum, rsq, rabs, ms);
        else
          run_variant(v, j, X, W, Y, S, B, sum, sq, rsum, rsq, rabs, ms);
      } catch (const std::exception& e) {
        j.s(vn + "_error", e.what());
        std::fprintf(stderr, "ERROR %s %s %s: %s\n", c_.opt.dtype.c_str(), sh_.name.c_str(), vn.c_str(), e.what());
        CUDA_CK(cudaDeviceSynchronize());
        cudaGetLastError();
      }
    }
    // What the fusion replaces: conv + stats pass (+ the BN-apply pass for
    // the prologue variant), against the fused graph.
    if (ms.count("conv") && ms.count("stats_pass")) {
      const double unf = ms["conv"] + ms["stats_pass"];
      j.d("unfused_ms", unf);
      for (const char* fv : {"conv_genstats", "conv_reduce"})
        if (ms.count(fv)) j.d(std::string(fv) + "_speedup", unf / ms[fv]);
      if (ms.count("apply_pass")) {
        const double unf2 = unf + ms["apply_pass"];
        j.d("sbr_unfused_ms", unf2);
        if (ms.count("sbr_conv_genstats")) j.d("sbr_conv_genstats_speedup", unf2 / ms["sbr_conv_genstats"]);
      }
    }
    j.d("wall_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
    return j.str();
  }

 private:
  Ctx& c_;
  Shape sh_;
  bool host_check_;

  template <typename U>
  void fill(U* p, size_t n, uint64_t seed, float lo, float hi) {
    const unsigned blocks = unsigned(std::min<size_t>((n + 255) / 256, size_t(c_.sms) * 16));
    fill_uniform<U><<<std::max(1u, blocks), 256, 0, c_.stream>>>(p, int64_t(n), seed, lo, hi);
    CUDA_CK(cudaGetLastError());
  }

  Stats reference_stats(const DevBuf& Y, DevBuf& rsum, DevBuf& rsq, DevBuf& rabs) {
    const int64_t M_y = sh_.n * sh_.p() * sh_.q();
    const int tx = int(sh_.k / 8), ty = std::max(1, 128 / tx);
    const size_t smem = size_t(3) * ty * sh_.k * sizeof(double);
    if (smem > 48 * 1024) throw std::runtime_error("reference stats: shared memory too large");
    const int64_t blocks = std::min<int64_t>((M_y + ty - 1) / ty, int64_t(c_.sms) * 8);
    CUDA_CK(cudaMemsetAsync(rsum.p, 0, rsum.bytes, c_.stream));
    CUDA_CK(cudaMemsetAsync(rsq.p, 0, rsq.bytes, c_.stream));
    CUDA_CK(cudaMemsetAsync(rabs.p, 0, rabs.bytes, c_.stream));
    channel_stats<T, double><<<unsigned(blocks), tx * ty, smem, c_.stream>>>(
        static_cast<const T*>(Y.p), M_y, int(sh_.k), static_cast<double*>(rsum.p), static_cast<double*>(rsq.p),
        static_cast<double*>(rabs.p));
    CUDA_CK(cudaGetLastError());
    Stats r;
    r.sum.resize(sh_.k);
    r.sq.resize(sh_.k);
    r.abs.resize(sh_.k);
    CUDA_CK(cudaMemcpyAsync(r.sum.data(), rsum.p, rsum.bytes, cudaMemcpyDeviceToHost, c_.stream));
    CUDA_CK(cudaMemcpyAsync(r.sq.data(), rsq.p, rsq.bytes, cudaMemcpyDeviceToHost, c_.stream));
    CUDA_CK(cudaMemcpyAsync(r.abs.data(), rabs.p, rabs.bytes, cudaMemcpyDeviceToHost, c_.stream));
    CUDA_CK(cudaStreamSynchronize(c_.stream));
    return r;
  }

  // Host conv in double (inputs as the GPU holds them; with the prologue,
  // relu(x*s+b) is rounded to T as the tensor cores would consume it).
  void host_conv(bool prologue, const DevBuf& X, const DevBuf& W, const DevBuf& S, const DevBuf& B,
                 std::vector<double>& y) {
    const size_t xe = X.bytes / sizeof(T), we = W.bytes / sizeof(T);
    std::vector<T> hx(xe), hw(we);
    CUDA_CK(cudaMemcpy(hx.data(), X.p, X.bytes, cudaMemcpyDeviceToHost));
    CUDA_CK(cudaMemcpy(hw.data(), W.p, W.bytes, cudaMemcpyDeviceToHost));
    std::vector<float> hs(sh_.c), hb(sh_.c);  // scale, bias as float
    if (S.bytes == sh_.c * sizeof(float)) {  // --sb-float
      CUDA_CK(cudaMemcpy(hs.data(), S.p, S.bytes, cudaMemcpyDeviceToHost));
      CUDA_CK(cudaMemcpy(hb.data(), B.p, B.bytes, cudaMemcpyDeviceToHost));
    } else {
      std::vector<T> ts(sh_.c), tb(sh_.c);
      CUDA_CK(cudaMemcpy(ts.data(), S.p, S.bytes, cudaMemcpyDeviceToHost));
      CUDA_CK(cudaMemcpy(tb.data(), B.p, B.bytes, cudaMemcpyDeviceToHost));
      for (int64_t c = 0; c < sh_.c; ++c) hs[c] = to_f<T>(ts[c]), hb[c] = to_f<T>(tb[c]);
    }
    std::vector<double> fx(xe), fw(we);
    for (size_t i = 0; i < xe; ++i) {
      float v = to_f<T>(hx[i]);
      if (prologue) {
        const size_t c = i % size_t(sh_.c);
        v = to_f<T>(from_f<T>(std::max(0.f, v * hs[c] + hb[c])));
      }
      fx[i] = v;
    }
    for (size_t i = 0; i < we; ++i) fw[i] = to_f<T>(hw[i]);
    const int64_t P = sh_.p(), Q = sh_.q();
    y.assign(size_t(sh_.n * P * Q * sh_.k), 0.0);
    for (int64_t n = 0; n < sh_.n; ++n)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q)
          for (int64_t k = 0; k < sh_.k; ++k) {
            double acc = 0;
            for (int64_t r = 0; r < sh_.r; ++r) {
              const int64_t hi = p * sh_.stride - sh_.pad + r;
              if (hi < 0 || hi >= sh_.h) continue;
              for (int64_t s = 0; s < sh_.s; ++s) {
                const int64_t wi = q * sh_.stride - sh_.pad + s;
                if (wi < 0 || wi >= sh_.w) continue;
                const double* xp = &fx[size_t(((n * sh_.h + hi) * sh_.w + wi) * sh_.c)];
                const double* wp = &fw[size_t(((k * sh_.r + r) * sh_.s + s) * sh_.c)];
                for (int64_t c = 0; c < sh_.c; ++c) acc += xp[c] * wp[c];
              }
            }
            y[size_t(((n * P + p) * Q + q) * sh_.k + k)] = acc;
          }
  }

  void run_variant(Variant v, Json& j, DevBuf& X, DevBuf& W, DevBuf& Y, DevBuf& S, DevBuf& B, DevBuf& sum,
                   DevBuf& sq, DevBuf& rsum, DevBuf& rsq, DevBuf& rabs, std::map<std::string, double>& ms_of) {
    const std::string vn = vname(v);
    const auto t0 = std::chrono::steady_clock::now();
    Graph g;
    g.build(c_.handle, v, sh_, c_.io, c_.opt.sb_float ? CUDNN_DATA_FLOAT : c_.io);

    // Engine configs: heuristics mode A, then FALLBACK.
    std::vector<DescPtr> cfgs;
    std::string heur_err;
    for (cudnnBackendHeurMode_t m : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      try {
        auto c = g.heuristics(m);
        for (auto& d : c) cfgs.push_back(std::move(d));
      } catch (const CudnnError& e) {
        heur_err += std::string(m == CUDNN_HEUR_MODE_A ? "A: " : "FALLBACK: ") + e.what() + "; ";
      }
    }
    j.i(vn + "_configs", int64_t(cfgs.size()));
    if (!heur_err.empty()) j.s(vn + "_heur_note", heur_err);
    if (cfgs.empty()) throw std::runtime_error("no engine config from heuristics: " + heur_err);

    struct Plan {
      DescPtr plan;
      int64_t ws = 0;
      EngineInfo info;
      size_t cfg;
    };
    std::vector<Plan> plans;
    std::map<std::string, int> fail_status;
    std::string first_fail;
    int tries = 0, rt_plans = 0;
    for (size_t ci = 0; ci < cfgs.size() && tries < c_.opt.max_tries && int(plans.size()) < c_.opt.max_plans;
         ++ci, ++tries) {
      const EngineInfo info = engine_info(*cfgs[ci]);
      if (info.runtime_compiled && rt_plans >= c_.opt.max_rt_plans) continue;
      try {
        DescPtr p(new Desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "create plan"));
        p->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &c_.handle, "plan handle")
            .desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[ci].get(), "plan engine config");
        p->finalize("finalize plan");
        int64_t ws = 0, n = 0;
        ck(cudnnBackendGetAttribute(p->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws),
           "plan workspace size");
        if (double(ws) > c_.opt.max_ws_gib * 1073741824.0) {
          fail_status["workspace>" + std::to_string(c_.opt.max_ws_gib) + "GiB"]++;
          continue;
        }
        plans.push_back(Plan{std::move(p), ws, info, ci});
        if (info.runtime_compiled) ++rt_plans;
      } catch (const CudnnError& e) {
        fail_status[cudnnGetErrorString(e.status)]++;
        if (first_fail.empty()) first_fail = e.what();
      }
    }
    const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    j.i(vn + "_plans", int64_t(plans.size())).d(vn + "_build_s", build_s);
    if (plans.empty()) {
      std::string st;
      for (auto& kv : fail_status) st += kv.first + " x" + std::to_string(kv.second) + " ";
      throw std::runtime_error("no execution plan could be finalized (" + std::to_string(tries) +
                               " configs tried; " + st + "); first: " + first_fail);
    }

    int64_t ws_max = 0;
    for (auto& p : plans) ws_max = std::max(ws_max, p.ws);
    DevBuf ws{static_cast<size_t>(ws_max)};

    std::vector<int64_t> uids = {kX, kW, kY};
    std::vector<void*> ptrs = {X.p, W.p, Y.p};
    if (has_prologue(v)) {
      uids.insert(uids.end(), {kScale, kBias});
      ptrs.insert(ptrs.end(), {S.p, B.p});
    }
    if (has_stats(v)) {
      uids.insert(uids.end(), {kSum, kSqSum});
      ptrs.insert(ptrs.end(), {sum.p, sq.p});
    }
    Desc vp(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "create variant pack");
    void* wsp = ws.p;
    vp.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data(), "vp uids")
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data(),
             "vp pointers")
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &wsp, "vp workspace");
    vp.finalize("finalize variant pack");

    // Does the graph add into SUM/SQSUM or overwrite them? Run twice.
    bool accumulates = false;
    std::vector<float> s1(sh_.k), q1(sh_.k), s2(sh_.k), q2(sh_.k);
    auto exec = [&](const Plan& p) { ck(cudnnBackendExecute(c_.handle, p.plan->d, vp.d), "execute"); };
    if (has_stats(v)) {
      CUDA_CK(cudaMemsetAsync(sum.p, 0, sum.bytes, c_.stream));
      CUDA_CK(cudaMemsetAsync(sq.p, 0, sq.bytes, c_.stream));
      exec(plans[0]);
      CUDA_CK(cudaMemcpyAsync(s1.data(), sum.p, sum.bytes, cudaMemcpyDeviceToHost, c_.stream));
      CUDA_CK(cudaMemcpyAsync(q1.data(), sq.p, sq.bytes, cudaMemcpyDeviceToHost, c_.stream));
      exec(plans[0]);
      CUDA_CK(cudaMemcpyAsync(s2.data(), sum.p, sum.bytes, cudaMemcpyDeviceToHost, c_.stream));
      CUDA_CK(cudaMemcpyAsync(q2.data(), sq.p, sq.bytes, cudaMemcpyDeviceToHost, c_.stream));
      CUDA_CK(cudaStreamSynchronize(c_.stream));
      double a1 = 0, a2 = 0;
      for (int64_t c = 0; c < sh_.k; ++c) a1 += std::fabs(q1[c]), a2 += std::fabs(q2[c]);
      accumulates = a2 > 1.5 * a1;
      j.b(vn + "_accumulates", accumulates);
    }
    auto step = [&](const Plan& p) {
      if (accumulates) {
        cudaMemsetAsync(sum.p, 0, sum.bytes, c_.stream);
        cudaMemsetAsync(sq.p, 0, sq.bytes, c_.stream);
      }
      exec(p);
    };

    // Autotune among the finalized plans, then time the best one.
    size_t best = 0;
    if (plans.size() > 1) {
      double best_ms = INFINITY;
      for (size_t i = 0; i < plans.size(); ++i) {
        double ms = INFINITY;
        try {
          ms = time_loop(c_.stream, 2, std::max(3, c_.opt.iters / 5), [&]() { step(plans[i]); });
        } catch (const std::exception& e) {
          std::fprintf(stderr, "WARN %s %s plan %zu (engine %lld) failed to run: %s\n", sh_.name.c_str(),
                       vn.c_str(), i, (long long)plans[i].info.index, e.what());
        }
        if (i == 0) j.d(vn + "_heur_first_ms", ms);
        if (ms < best_ms) best_ms = ms, best = i;
      }
    }
    const Plan& bp = plans[best];
    const double ms = time_loop(c_.stream, c_.opt.warmup, c_.opt.iters, [&]() { step(bp); });
    ms_of[vn] = ms;
    j.d(vn + "_ms", ms).d(vn + "_tflops", sh_.gflop() / ms);
    j.i(vn + "_engine", bp.info.index).b(vn + "_rt_compiled", bp.info.runtime_compiled);
    j.s(vn + "_notes", bp.info.notes).i(vn + "_ws", bp.ws);
    j.i(vn + "_heur_rank", int64_t(bp.cfg));

    // Correctness: one clean execution, stats against a double reduction of
    // the Y it wrote (and, on check shapes, Y and stats against the host).
    if (has_stats(v) || host_check_) {
      CUDA_CK(cudaMemsetAsync(sum.p, 0, sum.bytes, c_.stream));
      CUDA_CK(cudaMemsetAsync(sq.p, 0, sq.bytes, c_.stream));
      CUDA_CK(cudaMemsetAsync(Y.p, 0, Y.bytes, c_.stream));
      exec(bp);
      CUDA_CK(cudaStreamSynchronize(c_.stream));
    }
    if (has_stats(v)) {
      CUDA_CK(cudaMemcpy(s1.data(), sum.p, sum.bytes, cudaMemcpyDeviceToHost));
      CUDA_CK(cudaMemcpy(q1.data(), sq.p, sq.bytes, cudaMemcpyDeviceToHost));
      const Stats ref = reference_stats(Y, rsum, rsq, rabs);
      double es, eq;
      stats_error(s1, q1, ref, es, eq);
      j.d(vn + "_err_sum", es).d(vn + "_err_sqsum", eq);
    }
    if (host_check_) {
      std::vector<double> hy;
      host_conv(has_prologue(v), X, W, S, B, hy);
      std::vector<T> dy(hy.size());
      CUDA_CK(cudaMemcpy(dy.data(), Y.p, dy.size() * sizeof(T), cudaMemcpyDeviceToHost));
      double maxabs = 0, maxerr = 0;
      Stats hs;
      hs.sum.assign(sh_.k, 0);
      hs.sq.assign(sh_.k, 0);
      hs.abs.assign(sh_.k, 0);
      for (size_t i = 0; i < hy.size(); ++i) {
        maxabs = std::max(maxabs, std::fabs(hy[i]));
        const double e = std::fabs(double(to_f<T>(dy[i])) - hy[i]);
        maxerr = std::isfinite(e) ? std::max(maxerr, e) : INFINITY;
        const size_t c = i % size_t(sh_.k);
        hs.sum[c] += hy[i];
        hs.sq[c] += hy[i] * hy[i];
        hs.abs[c] += std::fabs(hy[i]);
      }
      j.d(vn + "_host_err_y", maxerr / std::max(maxabs, 1e-30));
      if (has_stats(v)) {
        double es, eq;
        stats_error(s1, q1, hs, es, eq);
        j.d(vn + "_host_err_sum", es).d(vn + "_host_err_sqsum", eq);
      }
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  if (opt.desc_only) {  // attribute types and values, on any machine with libcudnn
    int bad = 0;
    auto shapes = resnet50_shapes(opt.batch);
    for (auto& sh : shapes) {
      if (!opt.only.empty() && sh.name.find(opt.only) == std::string::npos) continue;
      for (Variant v : opt.variants) {
        Json j;
        j.s("kind", "descriptors").s("dtype", opt.dtype).s("name", sh.name).s("variant", vname(v));
        try {
          Graph g;
          const cudnnDataType_t io = opt.dtype == "bf16" ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
          g.build(nullptr, v, sh, io, opt.sb_float ? CUDNN_DATA_FLOAT : io);
          j.b("ok", true).i("descriptors", int64_t(g.keep.size()));
        } catch (const std::exception& e) {
          j.b("ok", false).s("error", e.what());
          ++bad;
        }
        std::printf("%s\n", j.str().c_str());
      }
    }
    return bad ? 1 : 0;
  }
  try {
    int dev = 0;
    CUDA_CK(cudaSetDevice(dev));
    cudaDeviceProp prop{};
    CUDA_CK(cudaGetDeviceProperties(&prop, dev));
    Ctx ctx{};
    ctx.opt = opt;
    ctx.sms = prop.multiProcessorCount;
    ctx.io = opt.dtype == "bf16" ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    CUDA_CK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
    ck(cudnnCreate(&ctx.handle), "cudnnCreate");
    ck(cudnnSetStream(ctx.handle, ctx.stream), "cudnnSetStream");
    int rt = 0;
    cudaRuntimeGetVersion(&rt);
    {
      Json j;
      j.s("kind", "env").s("device", prop.name).i("cc", prop.major * 10 + prop.minor).i("sms", prop.multiProcessorCount);
      j.i("cudnn_runtime", int64_t(cudnnGetVersion())).i("cudnn_header", CUDNN_VERSION);
      j.i("cudnn_cudart", int64_t(cudnnGetCudartVersion())).i("cudart", rt).s("dtype", opt.dtype);
      j.b("sb_float", opt.sb_float).i("batch", opt.batch).i("iters", opt.iters).i("warmup", opt.warmup).i("max_plans", opt.max_plans);
      j.i("max_rt_plans", opt.max_rt_plans);
      std::printf("%s\n", j.str().c_str());
      std::fflush(stdout);
    }

    std::vector<std::pair<Shape, bool>> todo;
    if (opt.checks)
      for (auto& s : check_shapes()) todo.push_back({s, true});
    if (opt.big)
      for (auto& s : resnet50_shapes(opt.batch)) todo.push_back({s, false});

    // Count-weighted totals over the ResNet-50 shapes (per fused variant, over
    // the shapes where it and its unfused terms all ran).
    std::map<std::string, double> tot;
    std::map<std::string, int> covered;
    for (auto& [sh, chk] : todo) {
      if (!opt.only.empty() && sh.name.find(opt.only) == std::string::npos) continue;
      std::string line;
      std::map<std::string, double> ms;
      try {
        if (opt.dtype == "bf16")
          line = Runner<__nv_bfloat16>(ctx, sh, chk).run(ms);
        else
          line = Runner<__half>(ctx, sh, chk).run(ms);
      } catch (const std::exception& e) {
        Json j;
        j.s("kind", chk ? "check" : "shape").s("dtype", opt.dtype).s("name", sh.name).s("error", e.what());
        line = j.str();
        std::fprintf(stderr, "ERROR %s %s: %s\n", opt.dtype.c_str(), sh.name.c_str(), e.what());
        cudaDeviceSynchronize();
        cudaGetLastError();
      }
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      if (!chk && ms.count("conv") && ms.count("stats_pass")) {
        const double w = sh.count, base = ms["conv"] + ms["stats_pass"];
        tot["conv"] += w * ms["conv"];
        tot["stats_pass"] += w * ms["stats_pass"];
        covered["conv"]++;
        for (const char* fv : {"conv_genstats", "conv_reduce"})
          if (ms.count(fv)) {
            tot[std::string(fv) + "_unfused"] += w * base;
            tot[fv] += w * ms[fv];
            covered[fv]++;
          }
        if (ms.count("sbr_conv_genstats") && ms.count("apply_pass")) {
          tot["sbr_conv_genstats_unfused"] += w * (base + ms["apply_pass"]);
          tot["sbr_conv_genstats"] += w * ms["sbr_conv_genstats"];
          covered["sbr_conv_genstats"]++;
        }
      }
    }
    if (!covered.empty()) {
      Json j;
      j.s("kind", "summary").s("dtype", opt.dtype).s("note", "ms per ResNet-50 forward, count-weighted, 1x1/3x3 convs only");
      for (auto& kv : tot) j.d(kv.first + "_ms", kv.second);
      for (auto& kv : covered) j.i(kv.first + "_shapes", kv.second);
      std::printf("%s\n", j.str().c_str());
    }
    cudnnDestroy(ctx.handle);
    cudaStreamDestroy(ctx.stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FATAL: %s\n", e.what());
    return 1;
  }
  return 0;
}
