// RMSNorm of each row in one call: the eager fast path behind linear_backend="cpp" (rms_norm.py builds this file
// and registers its ops milestones::rms_norm and milestones::add_rms_norm, the second for fused layers).
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

template <typename T>
void add_rows(const T* x, const T* residual, T* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i)  // rounded to T once, as torch's x + residual is
    out[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm takes x and weight both in float32 or both in bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "the weight must be a vector as long as x's last dimension (", x.size(-1), "), got ", weight.sizes());
}

void normalize(const torch::Tensor& rows, const torch::Tensor& weight, torch::Tensor& out, double eps) {
  const int64_t dim = rows.size(-1);
  const torch::Tensor w = weight.contiguous();
  const int64_t count = dim == 0 ? 0 : rows.numel() / dim;
  if (rows.scalar_type() == at::kFloat)
    normalize_rows(rows.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), count, dim,
                   static_cast<float>(eps));
  else
    normalize_rows(rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                   count, dim, static_cast<float>(eps));
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_inputs(x, weight);
  const torch::Tensor rows = x.contiguous();
  torch::Tensor out = torch::empty_like(rows);
  normalize(rows, weight, out, eps);
  return out;
}

// The skip connection and the next norm in one call: sum = x + residual (what the layer carries on), and its norm.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                       double eps) {
  check_inputs(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.device().is_cpu(),
              "add_rms_norm's residual must have x's shape and dtype, got ", residual.sizes(), " and ", x.sizes());
  const torch::Tensor a = x.contiguous(), b = residual.contiguous();
  torch::Tensor sum = torch::empty_like(a);
  if (a.scalar_type() == at::kFloat)
    add_rows(a.data_ptr<float>(), b.data_ptr<float>(), sum.data_ptr<float>(), a.numel());
  else
    add_rows(a.data_ptr<c10::BFloat16>(), b.data_ptr<c10::BFloat16>(), sum.data_ptr<c10::BFloat16>(), a.numel());
  torch::Tensor out = torch::empty_like(sum);
  normalize(sum, weight, out, eps);
  return {out, sum};
}

TORCH_LIBRARY_FRAGMENT(milestones, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(milestones, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
