// fxdebug's fused observation kernel: every record-mode statistic of one tensor in one pass.
//
// fxdebug::observe(x, table, row, chan_off, channels, channel_dim) reads x once and folds its
// sum, sum of squares, sum of |x|, min, max, zero / NaN / Inf counts (and, with channels > 0,
// the max of every channel along channel_dim) into row `row` of `table`, a float64 state tensor
// on x's device (layout: fxdebug/runtime/slots.py). Sums accumulate in double, so finite values
// up to float32's range never overflow the statistics (1e36**2 = 1e72). Partial results are
// computed over fixed-size chunks and combined in chunk order, so the figures do not depend on
// the thread count. Only the final fold into the table is serialised (a mutex held for a few
// dozen stores), which is what makes concurrent calls from several threads safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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
template <typename T>
inline void run_stats(const T* p, int64_t n, Acc& a) {
  // Every lane in double: one uniform vector width, so the compiler vectorises the whole body
  // (counts are exact in double up to 2^53 elements per call).
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
    double lo = isn ? INFINITY : d;
    double hi = isn ? -INFINITY : d;
    mn = lo < mn ? lo : mn;
    mx = hi > mx ? hi : mx;
  }
  a.sum += s; a.sumsq += sq; a.abs += ab;
  a.zeros += static_cast<int64_t>(z); a.nans += static_cast<int64_t>(nn); a.infs += static_cast<int64_t>(ni);
  a.mn = std::min(a.mn, mn);
  a.mx = std::max(a.mx, mx);
}

// Rows of `c` channels (channels last): statistics plus a NaN-propagating max per channel.
template <typename T>
inline void rows_stats(const T* p, int64_t rows, int64_t c, Acc& a, double* cm) {
  using V = work_t<T>;
  std::vector<V> m(c, -std::numeric_limits<V>::infinity());
  V* mp = m.data();
  for (int64_t r = 0; r < rows; r++) {
    const T* q = p + r * c;
    run_stats(q, c, a);
#pragma omp simd
    for (int64_t j = 0; j < c; j++) {
      V v = static_cast<V>(q[j]);
      V old = mp[j];
      mp[j] = (v != v) ? v : (v > old ? v : old);  // once NaN, NaN stays (v > NaN is false)
    }
  }
  for (int64_t j = 0; j < c; j++) {
    double v = static_cast<double>(mp[j]);
    cm[j] = (std::isnan(cm[j]) || std::isnan(v)) ? NAN : std::max(cm[j], v);
  }
}

template <typename T>
void stats(const T* p, int64_t n, int64_t outer, int64_t c, int64_t inner, bool per_chan, Acc& total,
           std::vector<double>& cmax) {
  if (!per_chan) {
    int64_t chunks = (n + GRAIN - 1) / GRAIN;
    std::vector<Acc> parts(chunks);
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; k++) run_stats(p + k * GRAIN, std::min(GRAIN, n - k * GRAIN), parts[k]);
    });
    for (auto& part : parts) total.merge(part);
    return;
  }
  cmax.assign(c, -INFINITY);
  if (inner == 1) {  // channels last: (outer rows) x (c channels)
    int64_t rows_per = std::max<int64_t>(1, GRAIN / std::max<int64_t>(c, 1));
    int64_t chunks = (outer + rows_per - 1) / rows_per;
    std::vector<Acc> parts(chunks);
    std::vector<std::vector<double>> pm(chunks, std::vector<double>(c, -INFINITY));
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; k++) {
        int64_t r0 = k * rows_per, r1 = std::min(outer, r0 + rows_per);
        rows_stats(p + r0 * c, r1 - r0, c, parts[k], pm[k].data());
      }
    });
    for (int64_t k = 0; k < chunks; k++) {
      total.merge(parts[k]);
      for (int64_t j = 0; j < c; j++) {
        double v = pm[k][j];
        cmax[j] = (std::isnan(cmax[j]) || std::isnan(v)) ? NAN : std::max(cmax[j], v);
      }
    }
    return;
  }
  // channels first: (outer) x (c) x (inner contiguous); each channel's runs in one task
  std::vector<Acc> parts(c);
  int64_t per_channel = std::max<int64_t>(outer * inner, 1);
  int64_t grain = std::max<int64_t>(1, GRAIN / per_channel);
  at::parallel_for(0, c, grain, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; j++) {
      Acc& a = parts[j];
      for (int64_t o = 0; o < outer; o++) run_stats(p + (o * c + j) * inner, inner, a);
      cmax[j] = a.nans ? NAN : a.mx;
    }
  });
  for (auto& part : parts) total.merge(part);
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
      stats<scalar_t>(x.const_data_ptr<scalar_t>(), n, outer, c, inner, per_chan, a, cmax);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(fxdebug, m) {
  m.def("observe(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()");
}

TORCH_LIBRARY_IMPL(fxdebug, CPU, m) { m.impl("observe", &observe_cpu); }

TORCH_LIBRARY_IMPL(fxdebug, Autograd, m) { m.impl("observe", &observe_autograd); }
