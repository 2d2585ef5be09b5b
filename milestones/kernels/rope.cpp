// RoPE and the KV write in one call: the CPU half of fused layers (fused_layers.py; rope.py builds this file and
// registers its op milestones::rope_and_write_kv; triton_fused.py is the CUDA half).
//
// The lesson rotates q and k with about eight torch operators (two products, a negation, a concatenation, a sum,
// for each) and writes k and v with two more, each a trip through torch's dispatcher for a few hundred numbers.
// This does the same arithmetic in one call, token by token: each (i, i + dim/2) pair of q's and k's heads rotated
// as x * cos + rotate_half(x) * sin, each product and the sum rounded to the input's dtype, as torch's operators
// round them (no fused multiply-add: built with -ffp-contract=off), so the outputs are the lesson's bit for bit;
// q returned, k and v written to their slots in the cache (slot = block * block_size + offset).

#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// One head of one token, rotated into `out` (dim numbers, contiguous).
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[i + half]);
    // x * cos + cat(-x2, x1) * sin, each operator rounding to T
    const T a = round_to<T>(lo * static_cast<float>(cos[i])), b = round_to<T>(-hi * static_cast<float>(sin[i]));
    const T c = round_to<T>(hi * static_cast<float>(cos[i + half])), d = round_to<T>(lo * static_cast<float>(sin[i + half]));
    out[i] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
    out[i + half] = round_to<T>(static_cast<float>(c) + static_cast<float>(d));
  }
}

template <typename T>
void rope_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
               const torch::Tensor& sin, torch::Tensor& pool_k, torch::Tensor& pool_v, const int64_t* slots,
               torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2), half = dim / 2;
  const int64_t block_size = pool_k.size(2);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T *pk = pool_k.data_ptr<T>(), *pv = pool_v.data_ptr<T>(), *op = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t) {
      const T* c = cp + t * cos.stride(0);
      const T* s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h)
        rotate(qp + t * q.stride(0) + h * q.stride(1), c, s, op + t * out.stride(0) + h * out.stride(1), half);
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at_k = block * pool_k.stride(0) + h * pool_k.stride(1) + offset * pool_k.stride(2);
        const int64_t at_v = block * pool_v.stride(0) + h * pool_v.stride(1) + offset * pool_v.stride(2);
        rotate(kp + t * k.stride(0) + h * k.stride(1), c, s, pk + at_k, half);
        const T* value = vp + t * v.stride(0) + h * v.stride(1);
        for (int64_t i = 0; i < dim; ++i) pv[at_v + i] = value[i];
      }
    }
  });
}

}  // namespace

torch::Tensor rope_and_write_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                                torch::Tensor sin, torch::Tensor pool_k, torch::Tensor pool_v, torch::Tensor slots) {
  for (const auto& t : {q, k, v, cos, sin, pool_k, pool_v, slots})
    TORCH_CHECK(t.device().is_cpu(), "rope_and_write_kv runs on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "rope_and_write_kv takes float32 or bfloat16, got ", q.scalar_type());
  for (const auto& t : {k, v, cos, sin, pool_k, pool_v})
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "q, k, v, cos, sin and the cache must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q [n, heads, dim] and k, v [n, kv_heads, dim] with an even dim, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t n = q.size(0), dim = q.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == n && cos.size(1) == dim,
              "cos and sin are [n, dim] (each token's angles), got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(pool_k.dim() == 4 && pool_k.sizes() == pool_v.sizes() && pool_k.size(1) == k.size(1) &&
                  pool_k.size(3) == dim,
              "the cache pools are [blocks, kv_heads, block_size, dim] with k's kv heads, got ", pool_k.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == n,
              "slots: one int64 slot per token, got ", slots.sizes(), " ", slots.scalar_type());
  for (const auto& t : {q, k, v, cos, sin, pool_k, pool_v})
    TORCH_CHECK(t.stride(-1) == 1, "each head's dim numbers must be contiguous");
  const torch::Tensor slot_values = slots.contiguous();
  const int64_t num_slots = pool_k.size(0) * pool_k.size(2);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot_values.data_ptr<int64_t>()[t] >= 0 && slot_values.data_ptr<int64_t>()[t] < num_slots, "slot ",
                slot_values.data_ptr<int64_t>()[t], " of token ", t, " is outside the cache's ", num_slots, " slots");
  torch::Tensor out = torch::empty({n, q.size(1), dim}, q.options());
  if (q.scalar_type() == at::kFloat)
    rope_rows<float>(q, k, v, cos, sin, pool_k, pool_v, slot_values.data_ptr<int64_t>(), out);
  else
    rope_rows<c10::BFloat16>(q, k, v, cos, sin, pool_k, pool_v, slot_values.data_ptr<int64_t>(), out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(milestones, m) {
  m.def("rope_and_write_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) pool_k, "
        "Tensor(b!) pool_v, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(milestones, CPU, m) { m.impl("rope_and_write_kv", &rope_and_write_kv); }
