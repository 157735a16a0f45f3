// fxdebug's fused observation kernel: every record-mode statistic of one tensor in one pass.
//
// fxdebug::observe(x, table, row, chan_off, channels, channel_dim) reads x once and folds its
// sum, sum of squares, sum of |x|, min, max, zero / NaN / Inf counts (and, with channels > 0,
// the max of every channel along channel_dim) into row `row` of `table`, a float64 state tensor
// on x's device (layout: fxdebug/runtime/slots.py). Sums are added in double (per block of 512
// in float lanes, redone in double where a block holds NaN/Inf or overflowed), so finite values up
// to float32's range never overflow the statistics (1e36**2 = 1e72) nor look non-finite. Partial results are
// computed over fixed-size chunks and combined in chunk order, so the figures do not depend on
// the thread count. Only the final fold into the table is serialised (a mutex held for a few
// dozen stores), which is what makes concurrent calls from several threads safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t K = 16;  // slots per row; row r starts at K * (r + 1); slot 0 of the table is the clock
enum Slot : int64_t {
  CALLS = 0, STAT_CALLS, COUNT, SUM, SUMSQ, ABS, ZEROS, NANS, INFS, MIN, MAX, NORM, BAD_CALLS, FIRST_BAD,
  CHAN_MISMATCH
};
constexpr int64_t GRAIN = 32768;  // elements per chunk (and the parallel grain)

std::mutex& fold_lock() {
  static std::mutex m;
  return m;
}

struct Acc {
  double sum = 0, sumsq = 0, abs = 0, mn = INFINITY, mx = -INFINITY;
  int64_t zeros = 0, nans = 0, infs = 0;
  void merge(const Acc& o) {
    sum += o.sum; sumsq += o.sumsq; abs += o.abs;
    zeros += o.zeros; nans += o.nans; infs += o.infs;
    mn = std::min(mn, o.mn); mx = std::max(mx, o.mx);
  }
};

// The working type: double for double inputs, float for every other floating type.
template <typename T>
using work_t = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

// Statistics of a contiguous run into `a`; returns the run's max ignoring NaN (NaNs are counted).
// Exact path: every lane in double (float64 inputs, and any block that holds NaN/Inf or whose
// float partial sums overflowed). One uniform vector width, so the whole body vectorises.
template <typename T>
inline void run_stats_exact(const T* p, int64_t n, Acc& a) {
  double s = 0, sq = 0, ab = 0, z = 0, nn = 0, ni = 0;
  double mn = INFINITY, mx = -INFINITY;
#pragma omp simd reduction(+ : s, sq, ab, z, nn, ni) reduction(min : mn) reduction(max : mx)
  for (int64_t i = 0; i < n; i++) {
    double d = static_cast<double>(static_cast<work_t<T>>(p[i]));
    double ad = std::fabs(d);
    s += d;
    sq += d * d;
    ab += ad;
    z += (d == 0.0) ? 1.0 : 0.0;
    bool isn = d != d;
    nn += isn ? 1.0 : 0.0;
    ni += (ad == INFINITY) ? 1.0 : 0.0;
    mn = d < mn ? d : mn;  // a NaN d leaves mn alone (NaNs are counted, not compared)
    mx = d > mx ? d : mx;
  }
  a.sum += s; a.sumsq += sq; a.abs += ab;
  a.zeros += static_cast<int64_t>(z); a.nans += static_cast<int64_t>(nn); a.infs += static_cast<int64_t>(ni);
  a.mn = std::min(a.mn, mn);
  a.mx = std::max(a.mx, mx);
}

constexpr int64_t BLOCK = 512;
constexpr int LANES = 16;  // one AVX-512 register of floats (two of AVX2): the accumulators stay vectors

// Fast path for float32/16/bf16: blocks of 512 in float lanes (twice the lanes of double). Each
// block's lane sums are added, lane by lane, into double lanes, and only the run's end reduces
// across lanes: a horizontal reduction per block (six chains of scalar adds) cost as much as the
// block's loop itself. A block's |x| sum is finite exactly when the block holds no NaN/Inf and
// nothing overflowed; otherwise the block's sums are redone on the exact path, so large finite
// values (1e36) are never mistaken for non-finite ones and NaN/Inf counts stay exact. Min and max
// are exact in float and ignore NaN on both paths, so they stay in lanes across every block.
template <typename T>
inline void run_stats(const T* p, int64_t n, Acc& a) {
  if constexpr (std::is_same<T, double>::value) {
    run_stats_exact(p, n, a);
  } else {
    double ds[LANES] = {0}, dsq[LANES] = {0}, dab[LANES] = {0};
    int64_t dz[LANES] = {0};
    float mn[LANES], mx[LANES];
    for (int j = 0; j < LANES; j++) { mn[j] = INFINITY; mx[j] = -INFINITY; }
    int64_t full = n / BLOCK * BLOCK;
    for (int64_t b = 0; b < full; b += BLOCK) {
      const T* q = p + b;
      float s[LANES] = {0}, sq[LANES] = {0}, ab[LANES] = {0};
      int32_t z[LANES] = {0};
      for (int64_t i = 0; i < BLOCK; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) {
          float v = static_cast<float>(q[i + j]);
          s[j] += v;
          sq[j] += v * v;
          ab[j] += std::fabs(v);
          z[j] += (v == 0.0f);
          mn[j] = v < mn[j] ? v : mn[j];
          mx[j] = v > mx[j] ? v : mx[j];
        }
      }
      int bad = 0;
#pragma omp simd reduction(| : bad)
      for (int j = 0; j < LANES; j++) bad |= !(ab[j] < INFINITY) | !(sq[j] < INFINITY);
      if (!bad) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) { ds[j] += s[j]; dsq[j] += sq[j]; dab[j] += ab[j]; dz[j] += z[j]; }
      } else {
        run_stats_exact(q, BLOCK, a);
      }
    }
    for (int j = 0; j < LANES; j++) {
      a.sum += ds[j]; a.sumsq += dsq[j]; a.abs += dab[j]; a.zeros += dz[j];
      a.mn = std::min(a.mn, static_cast<double>(mn[j]));
      a.mx = std::max(a.mx, static_cast<double>(mx[j]));
    }
    if (full < n) {  // the tail, shorter than a block: one float block as before
      const T* q = p + full;
      int64_t m = n - full;
      float s = 0, sq = 0, ab = 0, z = 0, tmn = INFINITY, tmx = -INFINITY;
#pragma omp simd reduction(+ : s, sq, ab, z) reduction(min : tmn) reduction(max : tmx)
      for (int64_t i = 0; i < m; i++) {
        float v = static_cast<float>(q[i]);
        s += v;
        sq += v * v;
        ab += std::fabs(v);
        z += (v == 0.0f) ? 1.0f : 0.0f;
        tmn = v < tmn ? v : tmn;
        tmx = v > tmx ? v : tmx;
      }
      if (std::isfinite(ab) && std::isfinite(sq)) {
        a.sum += s; a.sumsq += sq; a.abs += ab; a.zeros += static_cast<int64_t>(z);
        a.mn = std::min(a.mn, static_cast<double>(tmn));
        a.mx = std::max(a.mx, static_cast<double>(tmx));
      } else {
        run_stats_exact(q, m, a);
      }
    }
  }
}

// Max of a contiguous run, ignoring NaN (channels holding NaN are marked afterwards, only in the
// rare calls that saw one).
template <typename T>
inline void run_max(const T* p, int64_t n, work_t<T>& m) {
  using V = work_t<T>;
  V mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; i++) {
    V v = static_cast<V>(p[i]);
    mx = v > mx ? v : mx;
  }
  m = mx;
}

inline void nan_max_into(double& slot, double v) { slot = (std::isnan(slot) || std::isnan(v)) ? NAN : std::max(slot, v); }

// The channel maxima of `len` elements starting at element i0 (whole runs) into `m`.
template <typename T>
inline void chan_max(const T* p, int64_t i0, int64_t len, int64_t c, int64_t inner, work_t<T>* m) {
  using V = work_t<T>;
  if (inner == 1) {  // rows of c channels: vectorised along the channels
    for (int64_t r = 0; r < len / c; r++) {
      const T* q = p + i0 + r * c;
#pragma omp simd
      for (int64_t j = 0; j < c; j++) {
        V v = static_cast<V>(q[j]);
        m[j] = v > m[j] ? v : m[j];
      }
    }
    return;
  }
  // runs of `inner` elements, one channel each; the channel index advances without a division per run
  int64_t q0 = i0 / inner, q1 = (i0 + len) / inner, ch = q0 % c;
  if (inner >= LANES) {
    for (int64_t q = q0; q < q1; q++) {
      run_max(p + q * inner, inner, m[ch]);
      if (++ch == c) ch = 0;
    }
    return;
  }
  const T* r = p + q0 * inner;  // short runs (a 2x2 map): a vector loop's set-up per run would cost more than the run
  for (int64_t q = q0; q < q1; q++, r += inner) {
    V mx = m[ch];
    for (int64_t i = 0; i < inner; i++) {
      V v = static_cast<V>(r[i]);
      mx = v > mx ? v : mx;
    }
    m[ch] = mx;
    if (++ch == c) ch = 0;
  }
}

// All statistics of `n` elements in memory order, in fixed chunks of whole runs (a run is the
// `inner` contiguous elements of one channel; channels last means inner == 1 and rows of `c`).
// Each chunk is read from memory once: the global statistics in one vectorised loop, then the
// channel maxima of the same, cache-hot chunk. Chunk partials are combined in chunk order (the
// sums do not depend on the thread count); maxima go to per-thread arrays (max is exact in any order).
// A tensor of one chunk (most of a debugging-size model's) takes none of the per-chunk arrays.
template <typename T>
void stats(const T* p, int64_t n, int64_t c, int64_t inner, bool per_chan, Acc& total, std::vector<double>& cmax) {
  using V = work_t<T>;
  int64_t unit = per_chan ? (inner == 1 ? c : inner) : 1;  // chunks hold whole runs (or rows)
  int64_t per_chunk = std::max<int64_t>(1, GRAIN / unit) * unit;
  int64_t chunks = (n + per_chunk - 1) / per_chunk;
  constexpr V lowest = -std::numeric_limits<V>::infinity();
  if (chunks == 1) {
    run_stats(p, n, total);
    if (!per_chan) return;
    std::vector<V> m(c, lowest);
    chan_max(p, 0, n, c, inner, m.data());
    cmax.assign(m.begin(), m.end());
  } else {
    std::vector<Acc> parts(chunks);
    int threads = at::get_num_threads();
    std::vector<std::vector<V>> tmax(per_chan ? threads : 0, std::vector<V>(per_chan ? c : 0, lowest));
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      int tid = std::min(at::get_thread_num(), threads - 1);
      for (int64_t k = b; k < e; k++) {
        int64_t i0 = k * per_chunk, len = std::min(per_chunk, n - i0);
        run_stats(p + i0, len, parts[k]);
        if (per_chan) chan_max(p, i0, len, c, inner, tmax[tid].data());
      }
    });
    for (auto& part : parts) total.merge(part);
    if (!per_chan) return;
    cmax.assign(c, -INFINITY);
    for (int t = 0; t < threads; t++)
      for (int64_t j = 0; j < c; j++) cmax[j] = std::max(cmax[j], static_cast<double>(tmax[t][j]));
  }
  if (total.nans) {  // rare: mark the channels that held a NaN (their max is NaN, as amax says)
    for (int64_t i = 0; i < n; i++) {
      V v = static_cast<V>(p[i]);
      if (v != v) cmax[inner == 1 ? i % c : (i / inner) % c] = NAN;
    }
  }
}

void fold(double* t, int64_t base, int64_t n, const Acc& a, bool per_chan, bool mismatch, const std::vector<double>& cmax,
          int64_t chan_off) {
  std::lock_guard<std::mutex> guard(fold_lock());
  double* r = t + base;
  r[CALLS] += 1;
  if (mismatch) r[CHAN_MISMATCH] = 1;
  if (n == 0) return;
  r[STAT_CALLS] += 1;
  r[COUNT] += static_cast<double>(n);
  r[SUM] += a.sum;
  r[SUMSQ] += a.sumsq;
  r[ABS] += a.abs;
  r[ZEROS] += static_cast<double>(a.zeros);
  r[NANS] += static_cast<double>(a.nans);
  r[INFS] += static_cast<double>(a.infs);
  double lo = a.nans ? NAN : a.mn, hi = a.nans ? NAN : a.mx;
  r[MIN] = (std::isnan(r[MIN]) || std::isnan(lo)) ? NAN : std::min(r[MIN], lo);
  r[MAX] = (std::isnan(r[MAX]) || std::isnan(hi)) ? NAN : std::max(r[MAX], hi);
  r[NORM] += std::sqrt(a.sumsq);
  if (a.nans + a.infs > 0) {
    r[BAD_CALLS] += 1;
    r[FIRST_BAD] = std::min(r[FIRST_BAD], t[0]);  // t[0]: index of the current forward call
  }
  if (per_chan) {
    double* cm = t + chan_off;
    for (size_t j = 0; j < cmax.size(); j++) {
      double v = cmax[j];
      cm[j] = (std::isnan(cm[j]) || std::isnan(v)) ? NAN : std::max(cm[j], v);
    }
  }
}

void observe_cpu(const at::Tensor& x_in, at::Tensor& table, int64_t row, int64_t chan_off, int64_t channels,
                 int64_t channel_dim) {
  TORCH_CHECK(table.device() == x_in.device(), "fxdebug::observe: the observed tensor is on ", x_in.device(),
              " but the instrumentation state is on ", table.device(),
              "; keep the model and its inputs on one device (or re-instrument after moving them).");
  TORCH_CHECK(table.scalar_type() == at::kDouble && table.is_contiguous(),
              "fxdebug::observe: the state table must be a contiguous float64 tensor");
  int64_t base = K * (row + 1);
  TORCH_CHECK(row >= 0 && base + K <= table.numel(), "fxdebug::observe: row ", row, " outside the state table");
  double* t = table.data_ptr<double>();
  std::vector<double> cmax;
  if (!at::isFloatingType(x_in.scalar_type())) {
    fold(t, base, 0, Acc(), false, false, cmax, 0);
    return;
  }
  at::Tensor x = x_in;
  int64_t n = x.numel();
  bool per_chan = channels > 0 && x.dim() >= 2 && n > 0;
  bool mismatch = false;
  int64_t outer = 1, c = 1, inner = 1;
  if (per_chan) {
    int64_t d = channel_dim < 0 ? channel_dim + x.dim() : channel_dim;
    if (d < 0 || d >= x.dim() || x.size(d) != channels) {
      per_chan = false;
      mismatch = true;
    } else {
      c = channels;
      for (int64_t i = 0; i < d; i++) outer *= x.size(i);
      for (int64_t i = d + 1; i < x.dim(); i++) inner *= x.size(i);
      if (x.dim() == 4 && d == 1 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
        outer = n / c;  // NHWC in memory: rows of channels
        inner = 1;
      } else {
        x = x.contiguous();
        if (inner == 1) outer = n / c;
      }
    }
    TORCH_CHECK(!per_chan || chan_off + c <= table.numel(), "fxdebug::observe: channel slots outside the state table");
  }
  if (!per_chan && !x.is_non_overlapping_and_dense()) x = x.contiguous();  // dense: read in memory order
  Acc a;
  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fxdebug_observe", [&] {
      stats<scalar_t>(x.const_data_ptr<scalar_t>(), n, c, inner, per_chan, a, cmax);
    });
  }
  fold(t, base, n, a, per_chan, mismatch, cmax, chan_off);
}

void observe_autograd(const at::Tensor& x, at::Tensor& table, int64_t row, int64_t chan_off, int64_t channels,
                      int64_t channel_dim) {
  // Observation is not differentiable and records nothing: run the backend kernel below autograd.
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxdebug::observe", "")
                       .typed<void(const at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t, int64_t)>();
  op.call(x, table, row, chan_off, channels, channel_dim);
}

// Several small tensors in one call (one dispatch instead of one per node); `args` holds
// (row, chan_off, channels, channel_dim) for each tensor.
void observe_many_cpu(at::TensorList xs, at::Tensor& table, at::IntArrayRef args) {
  TORCH_CHECK(static_cast<int64_t>(args.size()) == 4 * static_cast<int64_t>(xs.size()),
              "fxdebug::observe_many: expected 4 ints per tensor, got ", args.size(), " for ", xs.size());
  for (size_t i = 0; i < xs.size(); i++)
    observe_cpu(xs[i], table, args[4 * i], args[4 * i + 1], args[4 * i + 2], args[4 * i + 3]);
}

void observe_many_autograd(at::TensorList xs, at::Tensor& table, at::IntArrayRef args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxdebug::observe_many", "")
                       .typed<void(at::TensorList, at::Tensor&, at::IntArrayRef)>();
  op.call(xs, table, args);
}

// Gradient statistics without Python in the backward: fxdebug::observe_grad(x, table, row, ...)
// registers on `x` a C++ tensor hook whose body is fxdebug::observe on the gradient (through the
// dispatcher, so every device's kernel applies), folding it into the node's gradient row. The
// hook returns nothing, so the gradient flows on untouched; the forward costs one dispatch and
// one small allocation per node, the backward no Python frame at all. A no-op without autograd
// (no grad mode, or a tensor that does not require grad). Registered as
// CompositeImplicitAutograd: under torch.compile, AOTAutograd runs it on its traced tensors, so
// the observation of each gradient is traced into the compiled backward graph.
void register_grad_hook(const at::Tensor& x, const at::Tensor& table, int64_t row, int64_t chan_off, int64_t channels,
                        int64_t channel_dim) {
  if (!x.defined() || !x.requires_grad() || !at::GradMode::is_enabled()) return;
  at::Tensor state = table;
  x.register_hook([state, row, chan_off, channels, channel_dim](const at::Tensor& grad) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxdebug::observe", "")
                         .typed<void(const at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t, int64_t)>();
    at::Tensor t = state;  // a new handle on the same table (the op's schema takes it mutable)
    if (grad.defined()) op.call(grad, t, row, chan_off, channels, channel_dim);
  });
}

void observe_grad(const at::Tensor& x, at::Tensor& table, int64_t row, int64_t chan_off, int64_t channels,
                  int64_t channel_dim) {
  register_grad_hook(x, table, row, chan_off, channels, channel_dim);
}

// Several taps in one call; `args` holds (row, chan_off, channels, channel_dim) for each tensor.
void observe_grad_many(at::TensorList xs, at::Tensor& table, at::IntArrayRef args) {
  TORCH_CHECK(static_cast<int64_t>(args.size()) == 4 * static_cast<int64_t>(xs.size()),
              "fxdebug::observe_grad_many: expected 4 ints per tensor, got ", args.size(), " for ", xs.size());
  if (!at::GradMode::is_enabled()) return;
  for (size_t i = 0; i < xs.size(); i++)
    register_grad_hook(xs[i], table, args[4 * i], args[4 * i + 1], args[4 * i + 2], args[4 * i + 3]);
}

// The clock's tick: fxdebug::tick(table) adds 1 to slot 0 of the state table (the device call
// counter every row reads), once per forward. On CPU it is one store through the data pointer (the
// in-place add on a view of slot 0 it replaces cost ~3-4 us of TensorIterator set-up per call);
// other devices (and meta) add to a one-element view. The version counter is bumped as add_
// would (not on inference tensors, which have none).
void tick_cpu(at::Tensor& table) {
  TORCH_CHECK(table.numel() > 0, "fxdebug::tick: the state table is empty");
  if (table.scalar_type() == at::kDouble) {
    *table.data_ptr<double>() += 1.0;
    if (!table.is_inference()) table.unsafeGetTensorImpl()->bump_version();
  } else {
    table.narrow(0, 0, 1).add_(1);
  }
}

void tick_any(at::Tensor& table) { table.narrow(0, 0, 1).add_(1); }

void tick_autograd(at::Tensor& table) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fxdebug::tick", "").typed<void(at::Tensor&)>();
  op.call(table);
}

// The optimizer guard's gradient check: fxdebug::any_nonfinite(xs, flag) sets `flag` (a one-element
// floating tensor) to 1.0 when any element of any tensor in `xs` is NaN (any payload) or +/-Inf, and
// leaves it as it is otherwise. Exact: a bit test on the exponent field (all ones: NaN or Inf), so
// large finite values, -0.0 and subnormals never count. It only reads the tensors (each once, in
// memory order), unlike the amp op GradScaler uses (`_amp_foreach_non_finite_check_and_unscale_`),
// which multiplies every element by the inverse scale and writes it back. No host sync; on the
// usual path (dense float32/float64/float16/bfloat16 tensors, a 0-d float32 flag) no allocation.
// The loop OR-accumulates `(bits & EXP) == EXP` over blocks of integers: branch-free, vectorised.
template <typename U>
inline bool bits_nonfinite(const U* p, int64_t n, U exp) {
  constexpr int64_t CHUNK = 4096;  // a look at the result per chunk: a bad tensor stops early
  for (int64_t b = 0; b < n; b += CHUNK) {
    int64_t m = std::min(CHUNK, n - b);
    const U* q = p + b;
    U acc = 0;
#pragma omp simd reduction(| : acc)
    for (int64_t i = 0; i < m; i++) acc |= static_cast<U>((q[i] & exp) == exp);
    if (acc) return true;
  }
  return false;
}

// Whether `n` elements of the dtype `st` at `data` (dense, any order) hold a NaN or Inf; -1 for a
// dtype without a bit test here (the caller converts those to float32 first).
inline int dense_nonfinite(const void* data, int64_t n, at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return bits_nonfinite(static_cast<const uint32_t*>(data), n, static_cast<uint32_t>(0x7F800000u));
    case at::kComplexFloat:
      return bits_nonfinite(static_cast<const uint32_t*>(data), 2 * n, static_cast<uint32_t>(0x7F800000u));
    case at::kDouble:
      return bits_nonfinite(static_cast<const uint64_t*>(data), n, static_cast<uint64_t>(0x7FF0000000000000ull));
    case at::kComplexDouble:
      return bits_nonfinite(static_cast<const uint64_t*>(data), 2 * n, static_cast<uint64_t>(0x7FF0000000000000ull));
    case at::kHalf:
      return bits_nonfinite(static_cast<const uint16_t*>(data), n, static_cast<uint16_t>(0x7C00u));
    case at::kComplexHalf:
      return bits_nonfinite(static_cast<const uint16_t*>(data), 2 * n, static_cast<uint16_t>(0x7C00u));
    case at::kBFloat16:
      return bits_nonfinite(static_cast<const uint16_t*>(data), n, static_cast<uint16_t>(0x7F80u));
    default:
      return -1;
  }
}

bool tensor_nonfinite(const at::Tensor& x_in) {
  if (!x_in.defined()) return false;
  at::Tensor x = x_in.is_sparse() ? x_in._values() : x_in;
  at::ScalarType st = x.scalar_type();
  if (!at::isFloatingType(st) && !at::isComplexType(st)) return false;  // integers and bool are always finite
  int64_t n = x.numel();
  if (n == 0) return false;
  TORCH_CHECK(x.layout() == at::kStrided, "fxdebug::any_nonfinite: tensors of layout ", x.layout(),
              " are not supported; pass dense (or sparse COO) tensors");
  if (dense_nonfinite(nullptr, 0, st) < 0) {  // float8 and other rare types: their values as float32 (exact)
    x = x.to(at::kFloat);
    st = at::kFloat;
  }
  if (!x.is_non_overlapping_and_dense()) x = x.contiguous();  // rare: a strided view with gaps
  const void* data = x.const_data_ptr();
  size_t width = x.element_size() / (at::isComplexType(st) ? 2 : 1);
  constexpr int64_t GRAIN_NF = 1 << 18;  // elements per parallel chunk (threads only for large tensors)
  if (n <= GRAIN_NF || at::get_num_threads() == 1) return dense_nonfinite(data, n, st) > 0;
  std::atomic<bool> found{false};
  int64_t scalars = at::isComplexType(st) ? 2 : 1;
  at::ScalarType part = at::isComplexType(st) ? c10::toRealValueType(st) : st;
  at::parallel_for(0, n, GRAIN_NF, [&](int64_t b, int64_t e) {
    if (found.load(std::memory_order_relaxed)) return;
    const char* p = static_cast<const char*>(data) + b * scalars * static_cast<int64_t>(width);
    if (dense_nonfinite(p, (e - b) * scalars, part) > 0) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

void any_nonfinite_cpu(at::TensorList xs, at::Tensor& flag) {
  TORCH_CHECK(flag.numel() == 1 && at::isFloatingType(flag.scalar_type()) && flag.device().is_cpu(),
              "fxdebug::any_nonfinite: the flag must be a one-element floating tensor on the CPU, got ",
              flag.scalar_type(), " of ", flag.numel(), " elements on ", flag.device());
  bool found = false;
  for (const at::Tensor& x : xs) {
    if (!x.defined()) continue;
    TORCH_CHECK(x.device().is_cpu(), "fxdebug::any_nonfinite: a tensor is on ", x.device(),
                "; this kernel checks CPU tensors (use torch._amp_foreach_non_finite_check_and_unscale_ elsewhere)");
    if (tensor_nonfinite(x)) {
      found = true;
      break;
    }
  }
  if (!found) return;
  if (flag.scalar_type() == at::kFloat && flag.is_contiguous()) {
    *flag.data_ptr<float>() = 1.0f;
    if (!flag.is_inference()) flag.unsafeGetTensorImpl()->bump_version();
  } else {
    flag.fill_(1.0);
  }
}

void any_nonfinite_autograd(at::TensorList xs, at::Tensor& flag) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxdebug::any_nonfinite", "")
                       .typed<void(at::TensorList, at::Tensor&)>();
  op.call(xs, flag);
}

// The guard's conditional copies on the CPU: fxdebug.CopyPlan(live, copies) holds the tensors a
// restoring step may change and their copy buffers (pairs of contiguous CPU tensors of equal size),
// built once per plan. save(flag) copies live -> copies and restore(flag) copies -> live, byte for
// byte (every bit pattern kept), only when `flag` (a 0-d float32 CPU tensor, read in place as the
// fused optimizers read found_inf: no host sync) is non-zero. A good step reads the flag and
// returns: no Python list of tensors to unpack, no tensor metadata touched, no version counter
// bumped (a copy that happens bumps the written tensors' counters, as copy_ would).
struct CopyPlan : torch::CustomClassHolder {
  std::vector<at::Tensor> live, copies;

  CopyPlan(std::vector<at::Tensor> live_, std::vector<at::Tensor> copies_)
      : live(std::move(live_)), copies(std::move(copies_)) {
    TORCH_CHECK(live.size() == copies.size(), "fxdebug.CopyPlan: ", live.size(), " tensors but ", copies.size(), " copies");
    for (size_t i = 0; i < live.size(); i++) {
      const at::Tensor& a = live[i];
      const at::Tensor& b = copies[i];
      TORCH_CHECK(a.defined() && b.defined() && a.device().is_cpu() && b.device().is_cpu() && a.layout() == at::kStrided &&
                      b.layout() == at::kStrided && a.is_contiguous() && b.is_contiguous() && a.nbytes() == b.nbytes(),
                  "fxdebug.CopyPlan: tensor ", i, " and its copy must be contiguous dense CPU tensors of equal size");
    }
  }

  static bool set(const at::Tensor& flag) {
    TORCH_CHECK(flag.numel() == 1 && flag.scalar_type() == at::kFloat && flag.device().is_cpu(),
                "fxdebug.CopyPlan: the flag must be a one-element float32 CPU tensor");
    return *flag.const_data_ptr<float>() != 0.0f;
  }

  static void copy_all(std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
    for (size_t i = 0; i < dst.size(); i++) {
      size_t n = dst[i].nbytes();
      if (n) std::memcpy(dst[i].mutable_data_ptr(), src[i].const_data_ptr(), n);
      if (!dst[i].is_inference()) dst[i].unsafeGetTensorImpl()->bump_version();
    }
  }

  void save(const at::Tensor& flag) {
    if (set(flag)) copy_all(copies, live);
  }

  void restore(const at::Tensor& flag) {
    if (set(flag)) copy_all(live, copies);
  }
};

}  // namespace

// flexible_layout: the kernels read any strides (channels last natively, other layouts through a
// copy), so Inductor passes each observed tensor in the layout it chose; under the default
// (needs_exact_strides) it wrote an NCHW copy of every channels-last activation for the extern call.
TORCH_LIBRARY_FRAGMENT(fxdebug, m) {
  const std::vector<at::Tag> flex{at::Tag::flexible_layout};
  m.def("observe(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()", flex);
  m.def("observe_many(Tensor[] xs, Tensor(a!) table, int[] args) -> ()", flex);
  m.def("observe_grad(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()", flex);
  m.def("observe_grad_many(Tensor[] xs, Tensor(a!) table, int[] args) -> ()", flex);
  m.def("tick(Tensor(a!) table) -> ()", flex);
  m.def("any_nonfinite(Tensor[] xs, Tensor(a!) flag) -> ()", flex);
  m.class_<CopyPlan>("CopyPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("save", &CopyPlan::save)
      .def("restore", &CopyPlan::restore);
}

TORCH_LIBRARY_IMPL(fxdebug, CompositeExplicitAutograd, m) {
  m.impl("tick", &tick_any);
}

TORCH_LIBRARY_IMPL(fxdebug, CompositeImplicitAutograd, m) {
  m.impl("observe_grad", &observe_grad);
  m.impl("observe_grad_many", &observe_grad_many);
}

TORCH_LIBRARY_IMPL(fxdebug, CPU, m) {
  m.impl("observe", &observe_cpu);
  m.impl("observe_many", &observe_many_cpu);
  m.impl("tick", &tick_cpu);
  m.impl("any_nonfinite", &any_nonfinite_cpu);
}

TORCH_LIBRARY_IMPL(fxdebug, Autograd, m) {
  m.impl("observe", &observe_autograd);
  m.impl("observe_many", &observe_many_autograd);
  m.impl("tick", &tick_autograd);
  m.impl("any_nonfinite", &any_nonfinite_autograd);
}

// Sparse COO gradients (nn.Embedding(sparse=True)): the same CPU kernel checks their values.
TORCH_LIBRARY_IMPL(fxdebug, SparseCPU, m) {
  m.impl("any_nonfinite", &any_nonfinite_cpu);
}
