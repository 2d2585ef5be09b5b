// RMSNorm of each row in one call: the eager fast path behind linear_backend="cpp" (rms_norm.py builds this file
// and registers its op milestones::rms_norm).
//
// The lesson's RMSNorm is six torch operators (square, mean, add, rsqrt, two products), each a trip through
// torch's dispatcher that costs more than its arithmetic on a row of 576 numbers; a decode step runs 61 of them.
// This does the same arithmetic in one call, row by row: the row's squares summed in float32 (16 running sums,
// then added in one fixed order), divided by the row's length, plus eps, one over the square root; each number
// times that, rounded to the input's dtype, times the weight (in float32, rounded once more). The order does not
// depend on how many rows come together: a row gets the same bits alone or in a batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int LANES = 16;

template <typename T>
void normalize_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const T* row = x + r * dim;
      float sums[LANES] = {};
      int64_t i = 0;
      for (; i + LANES <= dim; i += LANES)
        for (int j = 0; j < LANES; ++j) {
          const float v = static_cast<float>(row[i + j]);
          sums[j] += v * v;
        }
      for (int j = 0; i + j < dim; ++j) {
        const float v = static_cast<float>(row[i + j]);
        sums[j] += v * v;
      }
      float total = 0.0f;
      for (int j = 0; j < LANES; ++j) total += sums[j];
      const float scale = 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
      T* target = out + r * dim;
      for (int64_t k = 0; k < dim; ++k) {
        const T h = static_cast<T>(static_cast<float>(row[k]) * scale);
        target[k] = static_cast<T>(static_cast<float>(weight[k]) * static_cast<float>(h));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm takes x and weight both in float32 or both in bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "the weight must be a vector as long as x's last dimension (", x.size(-1), "), got ", weight.sizes());
  const int64_t dim = x.size(-1);
  const torch::Tensor rows = x.contiguous();
  const torch::Tensor w = weight.contiguous();
  torch::Tensor out = torch::empty_like(rows);
  const int64_t count = dim == 0 ? 0 : rows.numel() / dim;
  if (x.scalar_type() == at::kFloat)
    normalize_rows(rows.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), count, dim,
                   static_cast<float>(eps));
  else
    normalize_rows(rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                   count, dim, static_cast<float>(eps));
  return out;
}

TORCH_LIBRARY_FRAGMENT(milestones, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(milestones, CPU, m) { m.impl("rms_norm", &rms_norm); }
