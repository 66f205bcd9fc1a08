// The GPT's cuBLASLt matmuls: plain, with a bias, with GELU epilogues, and
// their choice of algorithm (see the header).
//
// cuBLASLt is column-major. A row-major [R, C] matrix is a column-major
// C x R one with leading dimension C, so the row-major products here are
// written as their transposes: pre^T (N x M) = W (as K x N, transposed)
// times x^T (K x M). The epilogue's bias then runs along the rows of the
// column-major result, that is, over the layer's features, and its
// auxiliary matrix (the pre-activation) has the result's layout.
#include "ddp/cuda/gemm_gelu.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace ddp::cuda {
namespace {

// The cuBLASLt functions used here, looked up in the copy LibTorch loaded.
struct Lt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  // For the neighbours and the alignment check (see below).
  decltype(&cublasLtMatmulAlgoCheck) algo_check = nullptr;
  decltype(&cublasLtMatmulAlgoCapGetAttribute) cap_get = nullptr;
  decltype(&cublasLtMatmulAlgoConfigSetAttribute) config_set = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) config_get = nullptr;
};

template <typename F>
bool find(F& f, const char* name) {
  f = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
  return f != nullptr;
}

const Lt* lt() {
  static const Lt* loaded = [] {
    auto* l = new Lt;  // kept for the process
    const bool all = find(l->create, "cublasLtCreate") && find(l->desc_create, "cublasLtMatmulDescCreate") &&
                     find(l->desc_destroy, "cublasLtMatmulDescDestroy") &&
                     find(l->desc_set, "cublasLtMatmulDescSetAttribute") &&
                     find(l->layout_create, "cublasLtMatrixLayoutCreate") &&
                     find(l->layout_destroy, "cublasLtMatrixLayoutDestroy") &&
                     find(l->pref_create, "cublasLtMatmulPreferenceCreate") &&
                     find(l->pref_destroy, "cublasLtMatmulPreferenceDestroy") &&
                     find(l->pref_set, "cublasLtMatmulPreferenceSetAttribute") &&
                     find(l->heuristic, "cublasLtMatmulAlgoGetHeuristic") && find(l->matmul, "cublasLtMatmul") &&
                     find(l->algo_check, "cublasLtMatmulAlgoCheck") &&
                     find(l->cap_get, "cublasLtMatmulAlgoCapGetAttribute") &&
                     find(l->config_set, "cublasLtMatmulAlgoConfigSetAttribute") &&
                     find(l->config_get, "cublasLtMatmulAlgoConfigGetAttribute");
    return all ? l : nullptr;
  }();
  return loaded;
}

void check(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed with status ", static_cast<int>(s));
}

// One handle per device, for the process (never destroyed: at exit the
// CUDA context may be gone first).
cublasLtHandle_t handle_for(int device) {
  static std::mutex mutex;
  static auto& handles = *new std::map<int, cublasLtHandle_t>;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  check(lt()->create(&h), "create");
  handles[device] = h;
  return h;
}

constexpr size_t kWorkspaceBytes = 32u << 20;

// The largest power of two, up to 256, that divides the address.
uint32_t alignment(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  uint32_t a = 1;
  while (a < 256 && at % (2 * a) == 0) a *= 2;
  return a;
}

// The descriptors of one matmul, destroyed with it, and what identifies it
// for the choice of algorithm: every attribute set, with pointers by their
// alignment only.
struct Plan {
  const Lt& l;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cudaDataType_t d_type = CUDA_R_16BF;
  std::vector<int64_t> key;
  std::string shape;  // for the tuning log (describe(), then set()'s epilogue)
  explicit Plan(const Lt& lt) : l(lt) {}
  ~Plan() {
    if (d) l.layout_destroy(d);
    if (b) l.layout_destroy(b);
    if (a) l.layout_destroy(a);
    if (op) l.desc_destroy(op);
  }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    check(l.desc_set(op, attr, &value, sizeof(value)), "set attribute");
    if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE) shape += " +epilogue";
    key.push_back(static_cast<int64_t>(attr));
    if constexpr (std::is_pointer_v<T>) {
      key.push_back(static_cast<int64_t>(alignment(value)));
    } else {
      key.push_back(static_cast<int64_t>(value));
    }
  }
  // D = op_a(A) op_b(B), bf16 operands, fp32 accumulation; each matrix as
  // stored, column-major {rows, columns} with the rows as leading dimension.
  void describe(cublasOperation_t op_a, cublasOperation_t op_b, std::array<int64_t, 2> a_dims,
                std::array<int64_t, 2> b_dims, std::array<int64_t, 2> d_dims, cudaDataType_t d_type) {
    check(l.desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    check(l.layout_create(&a, CUDA_R_16BF, a_dims[0], a_dims[1], a_dims[0]), "layout");
    check(l.layout_create(&b, CUDA_R_16BF, b_dims[0], b_dims[1], b_dims[0]), "layout");
    check(l.layout_create(&d, d_type, d_dims[0], d_dims[1], d_dims[0]), "layout");
    this->d_type = d_type;
    std::ostringstream text;
    text << "A " << a_dims[0] << "x" << a_dims[1] << (op_a == CUBLAS_OP_T ? "^T" : "") << " B " << b_dims[0] << "x"
         << b_dims[1] << (op_b == CUBLAS_OP_T ? "^T" : "") << (d_type == CUDA_R_32F ? " fp32" : " bf16");
    shape = text.str();
    key.insert(key.end(), {a_dims[0], a_dims[1], b_dims[0], b_dims[1], d_dims[0], d_dims[1], d_type});
  }
};

// ---- the choice of algorithm ----------------------------------------------
// Why by hand: cuBLASLt's heuristic ranks its algorithms by a model of the
// GPU, and its first choice is not always the fastest for a given shape;
// LibTorch takes the first. Like cuDNN's autotuning (which ddptrain turns
// on), the first eager call of each kind of matmul times the heuristic's
// candidates and their neighbours (below) on the real operands and keeps
// the fastest for the process. For GPT-2 124M on an H100 (bench/RESULTS.md,
// sessions 25 and 26) the output head's forward went from 1.76 to 1.58 ms,
// its input gradient from 1.77 to 1.50, its weight gradient from 1.57 to
// 1.50, the MLP's DGELU matmul from 0.155 to 0.145 a layer and c_fc's weight
// gradient from 0.122 to 0.106. Tuning GPT-2's 15 kinds takes about 20 s,
// most of it on the output head's three (session 26). Inside a
// CUDA graph's capture nothing can be timed: a kind not yet seen runs the
// first choice there (ddptrain's step captures after eager steps).

std::atomic<bool> g_tuning{true};

constexpr int kCandidates = 16;

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
using Choices = std::map<std::vector<int64_t>, cublasLtMatmulAlgo_t>;
// The algorithm run for each kind of matmul at its operands' alignments
// (the key: Plan::key, the device, the three alignments), and the one first
// chosen by timing for each kind whatever its alignments (the key without
// them), which the kind's other alignments keep where it runs. Guarded by
// cache_mutex(); kept for the process.
Choices& cache() {
  static auto& c = *new Choices;
  return c;
}
Choices& first_choices() {
  static auto& c = *new Choices;
  return c;
}
size_t g_timed_choices = 0;  // how many kinds were tuned by timing (cache_mutex)

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Two CUDA events, destroyed with it.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  EventPair() {
    C10_CUDA_CHECK(cudaEventCreate(&start));
    C10_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(stop);
    cudaEventDestroy(start);
  }
};

// One matmul of a kind on its operands: go(algo) runs it with an algorithm.
struct Launch {
  const Plan& p;
  cublasLtHandle_t h;
  const at::Tensor& a;
  const at::Tensor& b;
  at::Tensor& d;
  void* workspace;
  cudaStream_t stream;

  bool go(const cublasLtMatmulAlgo_t& algo) const {
    const float one = 1.f, zero = 0.f;
    return p.l.matmul(h, p.op, &one, a.data_ptr(), p.a, b.data_ptr(), p.b, &zero, d.data_ptr(), p.d, d.data_ptr(),
                      p.d, &algo, workspace, kWorkspaceBytes, stream) == CUBLAS_STATUS_SUCCESS;
  }
};

// That matmul timed (its events made only where a kind is tuned).
struct Trial {
  const Launch& launch;
  EventPair events;

  bool go(const cublasLtMatmulAlgo_t& algo) const { return launch.go(algo); }
  float mean_of(const cublasLtMatmulAlgo_t& algo, int runs) {
    C10_CUDA_CHECK(cudaEventRecord(events.start, launch.stream));
    bool ran = true;
    for (int r = 0; r < runs && ran; ++r) ran = go(algo);
    C10_CUDA_CHECK(cudaEventRecord(events.stop, launch.stream));
    C10_CUDA_CHECK(cudaEventSynchronize(events.stop));
    float t = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&t, events.start, events.stop));
    return ran ? t / runs : std::numeric_limits<float>::infinity();
  }
  // Mean ms of `runs` runs after one untimed run; infinity if it fails.
  // Where the first timed run is slower than `give_up` ms, that run's time.
  float ms(const cublasLtMatmulAlgo_t& algo, int runs, float give_up = std::numeric_limits<float>::infinity()) {
    if (!go(algo)) return std::numeric_limits<float>::infinity();
    const float first = mean_of(algo, 1);
    if (runs == 1 || !(first <= give_up)) return first;
    return (first + mean_of(algo, runs - 1) * (runs - 1)) / runs;
  }
};

bool same(const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
  return std::memcmp(&x, &y, sizeof(x)) == 0;
}

// A candidate: one of the heuristic's best fits, or a neighbour of a fast one.
struct Candidate {
  cublasLtMatmulAlgo_t algo;
  bool neighbour;
  float ms = std::numeric_limits<float>::infinity();
};

void add(std::vector<Candidate>& to, const cublasLtMatmulAlgo_t& algo, bool neighbour) {
  for (const auto& c : to)
    if (same(c.algo, algo)) return;
  to.push_back({algo, neighbour});
}

// The operands' alignments, in bytes (C is D).
struct Alignments {
  uint32_t a, b, d;
};

// The heuristic's preferences. A split over K whose parts are added in a
// bf16 output's type (in place or out of place) rounds each part: session
// 26 saw a DGELU algorithm so chosen miss float64 by 1.3% (bf16 keeps
// 0.4%). Where the output is bf16 only the fp32 sum of parts is allowed, as
// under PyTorch's allow_bf16_reduced_precision_reduction = False.
cublasLtMatmulPreference_t preference(const Lt& l, cudaDataType_t d_type, Alignments align) {
  cublasLtMatmulPreference_t pref = nullptr;
  check(l.pref_create(&pref), "preference");
  const uint64_t bytes = kWorkspaceBytes;
  if (d_type != CUDA_R_32F) {
    const uint32_t fp32_sums = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &fp32_sums, sizeof(fp32_sums)), "preference");
  }
  check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)), "preference");
  check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align.a, sizeof(align.a)), "preference");
  check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align.b, sizeof(align.b)), "preference");
  check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align.d, sizeof(align.d)), "preference");
  check(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align.d, sizeof(align.d)), "preference");
  return pref;
}

// The neighbours: candidates beyond the heuristic's. Why by hand: cuBLASLt's best-fit
// heuristic offers at most 8 configurations, and on an H100 a faster one
// was often one attribute away from them (session 26: the output head's
// input gradient 1.61 -> 1.52 ms, c_fc's weight gradient 0.122 -> 0.113 ms
// a layer, by another tile). The neighbours of a fast candidate change its
// tile, its pipeline stages or its CTA swizzle, each checked by
// cublasLtMatmulAlgoCheck (which sees no pointers) and against the
// operands' alignments before it runs. Split-K is left as the heuristic
// gives it: a new split could add its parts atomically, in no fixed order.
// Whether an algorithm's alignment needs are met by these operands.
bool fits_alignment(const Lt& l, const cublasLtMatmulAlgo_t& algo, Alignments align) {
  auto need = [&](cublasLtMatmulAlgoCapAttributes_t cap) {
    uint32_t v = 256;
    size_t bytes = 0;
    return l.cap_get(&algo, cap, &v, sizeof(v), &bytes) == CUBLAS_STATUS_SUCCESS ? v : 256u;
  };
  return need(CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES) <= align.a && need(CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES) <= align.b &&
         need(CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES) <= align.d && need(CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES) <= align.d;
}

// The values an algorithm accepts for a configuration attribute.
std::vector<uint32_t> accepted(const Lt& l, const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  auto list = [&](cublasLtMatmulAlgoCapAttributes_t cap) {
    size_t bytes = 0;
    if (l.cap_get(&algo, cap, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0) return std::vector<uint32_t>{};
    std::vector<uint32_t> v(bytes / sizeof(uint32_t));
    if (l.cap_get(&algo, cap, v.data(), bytes, &bytes) != CUBLAS_STATUS_SUCCESS) return std::vector<uint32_t>{};
    return v;
  };
  switch (attr) {
    case CUBLASLT_ALGO_CONFIG_TILE_ID: return list(CUBLASLT_ALGO_CAP_TILE_IDS);
    case CUBLASLT_ALGO_CONFIG_STAGES_ID: return list(CUBLASLT_ALGO_CAP_STAGES_IDS);
    case CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING: {
      uint32_t s = 0;
      size_t bytes = 0;
      l.cap_get(&algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &s, sizeof(s), &bytes);
      return s ? std::vector<uint32_t>{0, 1} : std::vector<uint32_t>{};
    }
    default: return {};
  }
}

void neighbours(const Plan& p, cublasLtHandle_t h, const cublasLtMatmulAlgo_t& of, Alignments align,
                std::vector<Candidate>& out) {
  const Lt& l = p.l;
  for (auto attr : {CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING}) {
    for (uint32_t value : accepted(l, of, attr)) {
      cublasLtMatmulAlgo_t algo = of;
      if (l.config_set(&algo, attr, &value, sizeof(value)) != CUBLAS_STATUS_SUCCESS) continue;
      cublasLtMatmulHeuristicResult_t result{};
      if (l.algo_check(h, p.op, p.a, p.b, p.d, p.d, &algo, &result) != CUBLAS_STATUS_SUCCESS ||
          result.workspaceSize > kWorkspaceBytes || !fits_alignment(l, algo, align))
        continue;
      add(out, algo, /*neighbour=*/true);
    }
  }
}

// The fastest candidate, timed on the real operands; `ok` false if none
// ran. Each run writes d in full, so the caller's last run decides what d
// holds. The heuristic's candidates and the neighbours of the 3 fastest,
// 3 runs each (1 where the first run is over 1.25x the fastest so far);
// the 4 fastest then 10 runs each.
cublasLtMatmulAlgo_t choose(const Plan& p, Trial& trial, Alignments align, std::vector<Candidate>& c, bool& ok) {
  const size_t n_fit = c.size();
  auto by_time = [](const Candidate& x, const Candidate& y) { return x.ms < y.ms; };
  float best = std::numeric_limits<float>::infinity();
  auto screen = [&](size_t from) {
    for (size_t i = from; i < c.size(); ++i) {
      c[i].ms = trial.ms(c[i].algo, 3, 1.25f * best);
      best = std::min(best, c[i].ms);
    }
  };
  screen(0);
  std::vector<Candidate> fit = c;
  std::stable_sort(fit.begin(), fit.end(), by_time);
  for (size_t i = 0; i < std::min<size_t>(3, fit.size()); ++i)
    if (std::isfinite(fit[i].ms)) neighbours(p, trial.launch.h, fit[i].algo, align, c);
  screen(n_fit);
  std::stable_sort(c.begin(), c.end(), by_time);
  // The choice is among the re-timed: their 10-run means, not a screening's.
  const auto top = c.begin() + std::min<size_t>(4, c.size());
  for (auto it = c.begin(); it != top; ++it)
    if (std::isfinite(it->ms)) it->ms = trial.ms(it->algo, 10);
  const auto chosen = std::min_element(c.begin(), top, by_time);
  ok = chosen != top && std::isfinite(chosen->ms);
  return ok ? chosen->algo : cublasLtMatmulAlgo_t{};
}

// The largest power of two, up to 256, that divides the tensor's address.
uint32_t alignment(const at::Tensor& t) { return alignment(t.data_ptr()); }

// Runs the matmul `p` describes on a, b into d, for the operands' actual
// alignment (a view at an offset must not get an algorithm that assumes
// 256 bytes). Tuning on, the algorithm is, in this order: the one run
// before for this kind at these alignments; the kind's first choice, made
// at other alignments, where it meets these (a view at an offset, a slice
// of a flat buffer: one algorithm, so the same bits, for both), kept once
// it has run here; the fastest of cuBLASLt's candidates and their
// neighbours, timed and kept (not while a CUDA graph captures: there, and
// with tuning off, cuBLASLt's first choice, not kept). False if it offers
// none, or none runs.
bool run(Plan& p, const at::Tensor& a, const at::Tensor& b, at::Tensor& d) {
  const Lt& l = p.l;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const Alignments align{alignment(a), alignment(b), alignment(d)};
  const bool tune = g_tuning.load();
  const std::vector<int64_t> kind = [&] {
    auto k = p.key;
    k.push_back(d.get_device());
    return k;
  }();
  auto key = kind;
  key.insert(key.end(), {align.a, align.b, align.d});
  const auto h = handle_for(d.get_device());
  auto workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, d.options().dtype(at::kByte));
  const Launch launch{p, h, a, b, d, workspace.data_ptr(), stream.stream()};
  if (tune) {
    std::optional<cublasLtMatmulAlgo_t> known, first;
    {
      std::lock_guard<std::mutex> lock(cache_mutex());
      if (auto it = cache().find(key); it != cache().end()) known = it->second;
      else if (auto f = first_choices().find(kind); f != first_choices().end()) first = f->second;
    }
    if (known) return launch.go(*known);
    if (first && fits_alignment(l, *first, align) && launch.go(*first)) {
      std::lock_guard<std::mutex> lock(cache_mutex());
      cache().emplace(key, *first);
      return true;
    }
  }
  const bool timed = tune && !capturing(stream.stream());
  cublasLtMatmulPreference_t pref = preference(l, p.d_type, align);
  cublasLtMatmulHeuristicResult_t found[kCandidates] = {};
  int count = 0;
  const cublasStatus_t s = l.heuristic(h, p.op, p.a, p.b, p.d, p.d, pref, timed ? kCandidates : 1, found, &count);
  l.pref_destroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || count == 0) return false;
  std::vector<Candidate> candidates;
  for (int i = 0; i < count; ++i)
    if (found[i].state == CUBLAS_STATUS_SUCCESS && found[i].workspaceSize <= kWorkspaceBytes)
      add(candidates, found[i].algo, /*neighbour=*/false);
  if (candidates.empty()) return false;
  if (!timed) return launch.go(candidates[0].algo);  // capturing, or tuning off: nothing is kept
  Trial trial{launch};
  bool ok = false;
  cublasLtMatmulAlgo_t algo = choose(p, trial, align, candidates, ok);
  if (!ok) return false;  // no candidate ran: nothing is kept, the caller falls back
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    // A kind keeps one algorithm: where another thread chose first, its choice stands.
    const auto [it, inserted] = cache().emplace(key, algo);
    algo = it->second;
    if (inserted) {
      ++g_timed_choices;
      first_choices().emplace(kind, algo);
    }
  }
  return launch.go(algo);
}

void check_operand(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == dims, "gemm_gelu: ", name,
              " must be a contiguous bf16 CUDA tensor of ", dims, " dimension(s), got ", t.sizes(), " ",
              t.scalar_type());
}

}  // namespace

bool gemm_gelu_available() { return lt() != nullptr; }

void set_gemm_tuning(bool on) { g_tuning.store(on); }
bool gemm_tuning() { return g_tuning.load(); }

size_t gemm_tuned_kinds() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  return g_timed_choices;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  TORCH_CHECK(gemm_gelu_available(), "linear: cuBLASLt is not loaded in this process");
  check_operand(x, "x", 2);
  check_operand(w, "w", 2);
  if (b.defined()) check_operand(b, "b", 1);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && (!b.defined() || b.size(0) == n), "linear: x ", x.sizes(), ", w ", w.sizes(),
              " and b ", b.defined() ? b.sizes() : at::IntArrayRef{}, " do not fit");
  if (n % 8 != 0 || k % 8 != 0 || (b.defined() && alignment(b) < 16)) return {};
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({m, n}, x.options());
  Plan p(*lt());
  // W (K x N, transposed) times x^T (K x M) is y^T (N x M).
  p.describe(CUBLAS_OP_T, CUBLAS_OP_N, {k, n}, {k, m}, {n, m}, CUDA_R_16BF);
  if (b.defined()) {
    p.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    p.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  }
  if (!run(p, w, x, y)) return {};
  return y;
}

at::Tensor matmul(const at::Tensor& g, const at::Tensor& w) {
  TORCH_CHECK(gemm_gelu_available(), "matmul: cuBLASLt is not loaded in this process");
  check_operand(g, "g", 2);
  check_operand(w, "w", 2);
  const int64_t m = g.size(0), n = g.size(1), k = w.size(1);
  TORCH_CHECK(w.size(0) == n, "matmul: g ", g.sizes(), " and w ", w.sizes(), " do not fit (g: [M, N], w: [N, K])");
  if (n % 8 != 0 || k % 8 != 0) return {};
  const c10::cuda::CUDAGuard guard(g.device());
  auto out = at::empty({m, k}, g.options());
  Plan p(*lt());
  // W^T (K x N: W as stored) times g^T (N x M) is out^T (K x M).
  p.describe(CUBLAS_OP_N, CUBLAS_OP_N, {k, n}, {n, m}, {k, m}, CUDA_R_16BF);
  if (!run(p, w, g, out)) return {};
  return out;
}

std::vector<at::Tensor> linear_gelu_tanh(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  TORCH_CHECK(gemm_gelu_available(), "gemm_gelu: cuBLASLt is not loaded in this process");
  check_operand(x, "x", 2);
  check_operand(w, "w", 2);
  check_operand(b, "b", 1);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && b.size(0) == n && n % 8 == 0, "gemm_gelu: x ", x.sizes(), ", w ", w.sizes(), ", b ",
              b.sizes(), " do not fit (features a multiple of 8)");
  TORCH_CHECK(alignment(b) >= 16, "gemm_gelu: the bias must be 16-byte aligned (a fresh tensor is)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({m, n}, x.options());
  auto pre = at::empty({m, n}, x.options());
  Plan p(*lt());
  // W (K x N, transposed) times x^T (K x M) is y^T (N x M).
  p.describe(CUBLAS_OP_T, CUBLAS_OP_N, {k, n}, {k, m}, {n, m}, CUDA_R_16BF);
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
  p.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(n));
  TORCH_CHECK(run(p, w, x, y), "gemm_gelu: cuBLASLt offered or ran no GELU_AUX_BIAS algorithm for x ", x.sizes(), " w ", w.sizes());
  return {y, pre};
}

namespace {
// out = g^T x in fp32; whether cuBLASLt ran it.
bool run_weight_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(gemm_gelu_available(), "weight_grad: cuBLASLt is not loaded in this process");
  check_operand(g, "g", 2);
  check_operand(x, "x", 2);
  const int64_t m = g.size(0), n = g.size(1), k = x.size(1);
  TORCH_CHECK(x.size(0) == m && out.is_cuda() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.size(0) == n && out.size(1) == k && out.stride(1) == 1 && out.stride(0) == k,
              "weight_grad: g ", g.sizes(), ", x ", x.sizes(), " and out ", out.sizes(), " ", out.scalar_type(),
              " do not fit (out: a contiguous fp32 [g's columns, x's columns])");
  const c10::cuda::CUDAGuard guard(g.device());
  Plan p(*lt());
  // x^T (K x M) times g^T (N x M, transposed) is out^T (K x N), in fp32.
  p.describe(CUBLAS_OP_N, CUBLAS_OP_T, {k, m}, {n, m}, {k, n}, CUDA_R_32F);
  at::Tensor d = out;
  return run(p, x, g, d);
}
}  // namespace

void weight_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(run_weight_grad(g, x, out),
              "weight_grad: cuBLASLt offered or ran no bf16 x bf16 -> fp32 algorithm for g ", g.sizes(), " x ",
              x.sizes());
}

at::Tensor matmul_gelu_tanh_backward(const at::Tensor& g, const at::Tensor& w, const at::Tensor& pre) {
  TORCH_CHECK(gemm_gelu_available(), "gemm_gelu: cuBLASLt is not loaded in this process");
  check_operand(g, "g", 2);
  check_operand(w, "w", 2);
  check_operand(pre, "pre", 2);
  const int64_t m = g.size(0), n = g.size(1), k = w.size(1);
  TORCH_CHECK(w.size(0) == n && pre.size(0) == m && pre.size(1) == k && k % 8 == 0, "gemm_gelu: g ", g.sizes(),
              ", w ", w.sizes(), " and pre ", pre.sizes(), " do not fit (g: [M, N], w: [N, K], pre: [M, K])");
  const c10::cuda::CUDAGuard guard(g.device());
  auto dh = at::empty({m, k}, g.options());
  Plan p(*lt());
  // W^T (K x N: W as stored) times g^T (N x M) is dh^T (K x M), laid out as pre^T.
  p.describe(CUBLAS_OP_N, CUBLAS_OP_N, {k, n}, {n, m}, {k, m}, CUDA_R_16BF);
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DGELU);
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
  p.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(k));
  if (alignment(pre) < 16 || !run(p, w, g, dh)) return {};
  return dh;
}

}  // namespace ddp::cuda
