// Cross-entropy fused with its gradient on the CPU, over the rows of one chunk of logits: per row a
// max pass, a sum-of-exponentials pass and a pass that writes (softmax - onehot) * grad_scale over
// the logits. fp32 math for every storage dtype but float64, rows split across OpenMP threads, the
// inner loops vectorised (fast_expf is branch-free). A row of 32000 fp32 logits is 125 KiB, so the
// second and third passes read it from L2.
#include <limits>

#include "cpu_common.h"

namespace fastffn {
namespace cpu {
namespace {

#pragma omp declare simd notinbranch
inline float exp_of(float x) { return fast_expf(x); }
inline double exp_of(double x) { return std::exp(x); }
inline float log_of(float x) { return std::log(x); }
inline double log_of(double x) { return std::log(x); }

// Every label before any row is written (the labels are on the host here).
fastffn_status check_labels(const char* entry, const fastffn_cross_entropy_args& a,
                            const int64_t* labels) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t y = labels[r];
    FASTFFN_CHECK_ARG(y == a.ignore_index || (y >= 0 && y < a.vocab), entry,
                      "labels holds %lld (row %lld of this call), outside the vocabulary [0, %lld) "
                      "and not ignore_index (%lld)", (long long)y, (long long)r, (long long)a.vocab,
                      (long long)a.ignore_index);
  }
  return fastffn::ok();
}

template <typename T, bool kWithGrad>
void cross_entropy(const fastffn_cross_entropy_args& a, T* logits, const int64_t* labels,
                   float* loss) {
  using C = compute_t<T>;
  const int64_t vocab = a.vocab;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(a.rows * vocab))
  for (int64_t r = 0; r < a.rows; ++r) {
    T* x = logits + r * a.row_stride;
    const int64_t y = labels[r];
    if (y == a.ignore_index) {
      loss[r] = 0.f;
      if constexpr (kWithGrad) {
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) x[j] = store<T>(C(0));
      }
      continue;
    }
    // NaN logits are skipped by the max and reach the sum (NaN loss); -inf ones add exp(-inf) = 0.
    C m = -std::numeric_limits<C>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < vocab; ++j) {
      const C v = to_float(x[j]);
      m = v > m ? v : m;
    }
    C sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < vocab; ++j) sum += exp_of(to_float(x[j]) - m);
    const C x_label = to_float(x[y]);
    const C row_loss = m + log_of(sum) - x_label;
    loss[r] = static_cast<float>(row_loss);
    if constexpr (kWithGrad) {
      if (!(row_loss > 0)) {  // dropped from PaddleNLP's mean: no gradient
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) x[j] = store<T>(C(0));
        continue;
      }
      const C scale = static_cast<C>(a.grad_scale);
      const C p_scale = scale / sum;
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) x[j] = store<T>(exp_of(to_float(x[j]) - m) * p_scale);
      x[y] = store<T>(exp_of(x_label - m) * p_scale - scale);  // softmax - onehot, one rounding
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_cross_entropy_cpu(fastffn_cross_entropy_args args, void* logits,
                                                    const int64_t* labels, float* loss) {
  FASTFFN_TRY_STATUS(fastffn::check_cross_entropy(__func__, args, logits, labels, loss, true));
  FASTFFN_TRY_STATUS(check_labels(__func__, args, labels));
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = args.with_grad ? cross_entropy<T, true> : cross_entropy<T, false>;
    run(args, static_cast<T*>(logits), labels, loss);
  });
}
