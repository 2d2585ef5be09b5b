// Decode attention for many requests at once, compiled: the fast path behind
// attention_backend="cpp" (decode_attention.py builds it and registers it as the
// torch op milestones::decode_attention).
//
// Every request in the call has exactly one new query token, which sees its
// whole cached context. torch on the CPU spends most of that time between
// operators: a per-request bmm / softmax / bmm is a few microseconds of work and
// tens of microseconds of dispatch, and its matrices (3 query rows against a
// kv head) are too thin for BLAS to stream the cache at memory speed. Here one
// call does every (request, kv head) pair: read the keys once for the scores,
// softmax them, read the values once for the weighted sum, in float32. A cache in
// bfloat16 is read as it is (half the bytes) and widened as it is loaded.
//
// The cache is addressed through a block table, so the same kernel serves m2
// (one block per request: its whole slot) and m3 (blocks of block_size tokens
// anywhere in the pool); keys are read where they are, never gathered.
//
// Blocks anywhere in the pool cost a stream: the CPU's own prefetcher follows a
// run of reads only within a 4 KiB page, and a block of 16 float32 keys of one
// head is a page's size, so with a request's blocks scattered (as m3's block
// manager leaves them once requests grow side by side) every block would start
// with a wait on memory. So each loop asks for the row PREFETCH_AHEAD positions
// on, through the block table, while it works on this one.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// --8<-- [start:prefetch]
constexpr int64_t PREFETCH_AHEAD = 32;  // positions: far enough to hide memory's latency (measured: kernels.md)

// Ask for one cached row (dim values of T) to be brought nearer; it changes no number. A float32 row
// (four lines at head size 64) is asked into L2 only (locality 2: prefetcht1 on x86), which measured a
// fifth faster on scattered blocks than into L1; a bfloat16 row (two lines) into L1, where L2 measured
// slower on contiguous blocks (kernels.md).
template <typename T>
static inline void prefetch_row(const T* row, int64_t dim) {
  constexpr int LOCALITY = sizeof(T) == 4 ? 2 : 3;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, LOCALITY);
}
// --8<-- [end:prefetch]

// --8<-- [start:kernel]
// q: [n, heads, dim]; k, v: [num_blocks, kv_heads, block_size, dim] (any strides, dim contiguous);
// block_tables: [n, max_blocks] (int64); context_lens: [n] (int64). Returns [n, heads, dim].
// T is float or c10::BFloat16: what is stored; every sum is in float.
template <typename T, int64_t FIXED_DIM>  // FIXED_DIM 0: the head size is only known at run time
static void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, float scale,
                   torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = FIXED_DIM ? FIXED_DIM : q.size(2);
  const int64_t kv_heads = k.size(1), block_size = k.size(2), group = heads / kv_heads;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lengths = context_lens.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  const int64_t k_block = k.stride(0), k_head = k.stride(1), k_pos = k.stride(2);
  const int64_t v_block = v.stride(0), v_head = v.stride(1), v_pos = v.stride(2);

  // One task per (request, kv head): its `group` query heads share the keys and values read.
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t first_task, int64_t end_task) {
    std::vector<float> scores;                 // [group, context_len]
    std::vector<float> queries(group * dim);   // the group's query heads, widened to float
    std::vector<float> outputs(group * dim);   // their weighted sums, in float
    for (int64_t task = first_task; task < end_task; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads, len = lengths[i];
      const int64_t* table = tables + i * table_width;
      auto key_at = [&](int64_t t) {  // where position t's key sits in the pool
        return k_data + table[t / block_size] * k_block + h * k_head + (t % block_size) * k_pos;
      };
      auto value_at = [&](int64_t t) {
        return v_data + table[t / block_size] * v_block + h * v_head + (t % block_size) * v_pos;
      };
      const T* query_in = q_data + (i * heads + h * group) * dim;
      for (int64_t d = 0; d < group * dim; ++d) queries[d] = static_cast<float>(query_in[d]);
      scores.resize(group * len);

      for (int64_t t = 0; t < len; ++t) {  // scores = q . k for every cached position
        if (t + PREFETCH_AHEAD < len) prefetch_row(key_at(t + PREFETCH_AHEAD), dim);
        const T* key = key_at(t);
        for (int64_t g = 0; g < group; ++g) {
          const float* query = queries.data() + g * dim;
          float dot = 0.f;
          for (int64_t d = 0; d < dim; ++d) dot += query[d] * static_cast<float>(key[d]);
          scores[g * len + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax over the context, per query head
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - top));
        for (int64_t t = 0; t < len; ++t) s[t] /= sum;
      }
      std::fill(outputs.begin(), outputs.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // out = sum of p * v
        if (t + PREFETCH_AHEAD < len) prefetch_row(value_at(t + PREFETCH_AHEAD), dim);
        const T* value = value_at(t);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* output = outputs.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) output[d] += p * static_cast<float>(value[d]);
        }
      }
      T* output_out = out_data + (i * heads + h * group) * dim;
      for (int64_t d = 0; d < group * dim; ++d) output_out[d] = static_cast<T>(outputs[d]);
    }
  });
}
// --8<-- [end:kernel]

template <typename T>
static void attend_any_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, float scale,
                           torch::Tensor& out) {
  switch (q.size(2)) {  // the common head sizes get a loop the compiler can unroll
    case 64: attend<T, 64>(q, k, v, block_tables, context_lens, scale, out); break;
    case 128: attend<T, 128>(q, k, v, block_tables, context_lens, scale, out); break;
    default: attend<T, 0>(q, k, v, block_tables, context_lens, scale, out);
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention takes float32 or bfloat16 tensors, q, k and v in the same dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(),
              "q: [n, heads, dim]; k, v: [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(k.size(1) > 0 && k.size(3) == q.size(2) && q.size(1) % k.size(1) == 0,
              "head sizes differ, or heads is not a multiple of kv_heads");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "the last dimension of k and v must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "tables and lengths are int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "one block table row and one context length per query");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t* lengths = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  // Plain loops: torch reductions here would cost more than they check.
  for (int64_t i = 0; i < context_lens.numel(); ++i)
    TORCH_CHECK(lengths[i] >= 1 && lengths[i] <= block_tables.size(1) * k.size(2),
                "every context holds at least one token, and no more than its block table covers");
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tables[i] >= 0 && tables[i] < k.size(0), "a block table names a block outside the cache");
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    attend_any_dim<c10::BFloat16>(q, k, v, block_tables, context_lens, s, out);
  else
    attend_any_dim<float>(q, k, v, block_tables, context_lens, s, out);
  return out;
}

// A dispatcher op rather than a Python binding, so that torch.compile sees one opaque call
// (its shape rule, the "fake" implementation, is registered in decode_attention.py).
TORCH_LIBRARY(milestones, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor context_lens, float scale)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(milestones, CPU, m) { m.impl("decode_attention", &decode_attention); }
