// y = x W^T (+ bias) for float32 x and a weight kept as small integers in blocks: the fast path behind
// quantization="gguf" and "int8" (quant_blocks.py packs the weights; quant_linear.py builds this file and registers
// its ops milestones::quant_linear and milestones::quant_silu_mul).
//
// A decode step at batch 1 reads every weight once, so it runs at the speed of memory; a weight of 4 or 8 bits is a
// fraction of a float32's 32, and the step reads that fraction of the bytes. The price is arithmetic: the small
// integers are turned into float32 in registers, as they are used, and never stored as floats. Three formats:
// Like panel_linear.cpp, the weight comes packed in panels of 16 output columns, so that for each k the 16 weights
// of a panel are side by side: a block of 32 k of a panel holds its 16 columns' scales (and minimums), then the
// 32 x 16 integers. Q4_1 keeps two k in a byte: the byte of column c for the pair of k (2j, 2j + 1) holds k = 2j in
// its low 4 bits and 2j + 1 in its high 4 bits, so one load and a widening give 16 bytes as 16 integers, a mask
// gives k = 2j's 16 weights and a shift k = 2j + 1's.
//
// The weights the file stands for are d * q + m (Q8_0: d * q), exactly the float32 weights transformers makes when
// it de-quantizes the file (the chain's weights), but the kernel never makes them: a block's share of x . w is
// d * (x . q) + m * sum(x) over the block's 32 k (Q8_0: d * (x . q)), the factored form llama.cpp uses, so each
// weight costs one fused multiply-add instead of two. That rounds otherwise than x . (d * q + m): the outputs are
// within float32's summation bound of the exact product, not panel_linear's over the de-quantized weights bit for
// bit (tests/kernels/test_quant_linear.py), and the chain's tokens agree (tests/test_quantization.py). The order is
// fixed: within a block in order of k, the blocks in order, the same in every tile, thread and vector width
// (AVX-512, AVX2), so a row's outputs do not depend on its batch. Built without -ffast-math, which would reorder.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 16;  // output columns per packed panel: one vector of 16 floats (two on AVX2)
constexpr int64_t BLOCK = 32;  // k per block: GGUF's blocks, and the int8 panels' unit
#if defined(__AVX512F__)
constexpr int TILE_ROWS = 12;  // 12 sums of one vector each, a weight and a broadcast in 32 registers
#else
constexpr int TILE_ROWS = 6;  // AVX2: each sum takes two of the 16 registers
#endif

typedef float floatx16 __attribute__((vector_size(64)));

enum class Format : int64_t { Q4_1 = 0, Q8_0 = 1, INT8 = 2 };

// 16 float16 numbers (a panel's scales or minimums) as float32: exact.
inline floatx16 load_halves(const uint8_t* p) {
  floatx16 v;
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  std::memcpy(&v, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &high, 32);
#else
  for (int c = 0; c < PANEL; ++c) {
    c10::Half h;
    std::memcpy(&h, p + 2 * c, 2);
    v[c] = float(h);
  }
#endif
  return v;
}

// --8<-- [start:widen]
// A Q4_1 pair of k: 16 bytes, column c's byte holding k = 2j in its low 4 bits and 2j + 1 in its high 4, as two
// vectors of 16 floats (exact). AVX-512 widens the 16 bytes to 16 integers in one instruction, AVX2 in two halves.
inline void nibbles(const uint8_t* p, floatx16& low, floatx16& high) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = (floatx16)_mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
  high = (floatx16)_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
#elif defined(__AVX2__)
  __m256 halves[2][2];  // [low, high][columns 0-7, 8-15]
  for (int h = 0; h < 2; ++h) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    halves[0][h] = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15)));
    halves[1][h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
  }
  std::memcpy(&low, halves[0], sizeof low);
  std::memcpy(&high, halves[1], sizeof high);
#else
  for (int c = 0; c < PANEL; ++c) {
    low[c] = float(p[c] & 15);
    high[c] = float(p[c] >> 4);
  }
#endif
}

// 16 signed bytes (Q8_0's or int8's weights of one k) as 16 floats (exact).
inline floatx16 signed_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (floatx16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  __m256 halves[2];
  for (int h = 0; h < 2; ++h)
    halves[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
  floatx16 v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  floatx16 v;
  for (int c = 0; c < PANEL; ++c) v[c] = float(static_cast<int8_t>(p[c]));
  return v;
#endif
}
// --8<-- [end:widen]

// --8<-- [start:blocks]
// One block of 32 k of one panel: its integers as float32, a pair of k at a time (q0 for k = 2j, q1 for 2j + 1, exact),
// and what turns a block's sum of x * q into its share of x . w (`finish`): d * sum + m * sum(x) for Q4_1, d * sum for
// Q8_0, the sum itself for int8 (whose scale is the column's, applied at the end).
template <Format F>
struct Block;

template <>
struct Block<Format::Q4_1> {
  static constexpr int64_t BYTES = 4 * PANEL + BLOCK * PANEL / 2;  // 16 scales, 16 minimums, 32 x 16 nibbles: 320
  floatx16 d, m;
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : d(load_halves(block)), m(load_halves(block + 2 * PANEL)), q(block + 4 * PANEL) {}
  void pair(int64_t j, floatx16& q0, floatx16& q1) const { nibbles(q + j * PANEL, q0, q1); }
  void finish(floatx16& sum, const floatx16& dot, float x_sum) const {
    sum += d * dot;
    sum += m * x_sum;
  }
};

template <>
struct Block<Format::Q8_0> {
  static constexpr int64_t BYTES = 2 * PANEL + BLOCK * PANEL;  // 16 scales, 32 x 16 signed bytes: 544
  floatx16 d;
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : d(load_halves(block)), q(block + 2 * PANEL) {}
  void pair(int64_t j, floatx16& q0, floatx16& q1) const {
    q0 = signed_bytes(q + 2 * j * PANEL);
    q1 = signed_bytes(q + (2 * j + 1) * PANEL);
  }
  void finish(floatx16& sum, const floatx16& dot, float) const { sum += d * dot; }
};

template <>
struct Block<Format::INT8> {
  static constexpr int64_t BYTES = BLOCK * PANEL;  // 32 x 16 signed bytes; the column's scale comes at the end
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : q(block) {}
  void pair(int64_t j, floatx16& q0, floatx16& q1) const {
    q0 = signed_bytes(q + 2 * j * PANEL);
    q1 = signed_bytes(q + (2 * j + 1) * PANEL);
  }
  void finish(floatx16& sum, const floatx16& dot, float) const { sum += dot; }
};
// --8<-- [end:blocks]

// One output: the float32 sum (int8: times the column's scale), plus its bias (if any).
inline void store(float* out, int64_t c, float sum, const float* scale, const float* bias) {
  const float scaled = scale ? sum * scale[c] : sum;
  out[c] = bias ? scaled + bias[c] : scaled;
}

template <int ROWS, int PANELS>
void store_tile(const floatx16 (&sums)[ROWS][PANELS], float* out, int64_t out_stride, int64_t cols,
                const float* scale, const float* bias) {
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS; ++p)
      for (int64_t c = 0; c < std::min<int64_t>(PANEL, cols - p * PANEL); ++c)
        store(out + r * out_stride + p * PANEL, c, sums[r][p][c], scale ? scale + p * PANEL : nullptr,
              bias ? bias + p * PANEL : nullptr);
}

// --8<-- [start:tile]
// out[r][0:cols] for ROWS rows of x (k floats each) against PANELS consecutive packed panels (panel_stride bytes
// apart). Block by block: the sum of x * q in order of k (one fused multiply-add a k, on the integers as they are),
// then the block's scale and minimum once (`finish`, with the block's sum of x from x_sums). So a Q4_1 weight costs
// one multiply-add, not two (d * q + m, then x * w): x . w = d (x . q) + m sum(x), the factored form llama.cpp uses.
template <Format F, int ROWS, int PANELS>
void multiply_tile(const float* x, const float* x_sums, int64_t k, const uint8_t* panels, int64_t panel_stride,
                   float* out, int64_t out_stride, int64_t cols, const float* scale, const float* bias) {
  floatx16 sums[ROWS][PANELS] = {};
  const int64_t num_blocks = k / BLOCK;
  for (int64_t b = 0; b < num_blocks; ++b) {
    Block<F> blocks[PANELS];
    for (int p = 0; p < PANELS; ++p) blocks[p] = Block<F>(panels + p * panel_stride + b * Block<F>::BYTES);
    floatx16 dots[ROWS][PANELS] = {};
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
      const int64_t i = b * BLOCK + 2 * j;
      for (int p = 0; p < PANELS; ++p) {  // a single row: several panels, so that several sums are under way
        floatx16 q0, q1;
        blocks[p].pair(j, q0, q1);
        for (int r = 0; r < ROWS; ++r) {
          dots[r][p] += x[r * k + i] * q0;
          dots[r][p] += x[r * k + i + 1] * q1;
        }
      }
    }
    for (int p = 0; p < PANELS; ++p)
      for (int r = 0; r < ROWS; ++r) blocks[p].finish(sums[r][p], dots[r][p], x_sums[r * num_blocks + b]);
  }
  store_tile<ROWS, PANELS>(sums, out, out_stride, cols, scale, bias);
}
// --8<-- [end:tile]

// multiply_tile<F, rows, 1> for a number of rows known only at run time (1 to TILE_ROWS).
template <Format F, int ROWS = TILE_ROWS>
void multiply_rows(const float* x, const float* x_sums, int64_t rows, int64_t k, const uint8_t* panel, float* out,
                   int64_t n, int64_t cols, const float* scale, const float* bias) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return multiply_rows<F, ROWS - 1>(x, x_sums, rows, k, panel, out, n, cols, scale, bias);
  multiply_tile<F, ROWS, 1>(x, x_sums, k, panel, 0, out, n, cols, scale, bias);
}

// Many rows: one panel's integers made into float32 once ([k, 16], `widened`), then read by every tile of rows, in
// the same order and with the same finish a block as multiply_tile, so a row's outputs do not depend on its batch.
template <Format F, int ROWS>
void multiply_widened(const float* x, const float* x_sums, int64_t k, const uint8_t* panel, const float* widened,
                      float* out, int64_t out_stride, int64_t cols, const float* scale, const float* bias) {
  floatx16 sums[ROWS][1] = {};
  const int64_t num_blocks = k / BLOCK;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const Block<F> block(panel + b * Block<F>::BYTES);
    floatx16 dots[ROWS] = {};
    for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i) {
      floatx16 q;
      std::memcpy(&q, widened + i * PANEL, sizeof q);
      for (int r = 0; r < ROWS; ++r) dots[r] += x[r * k + i] * q;
    }
    for (int r = 0; r < ROWS; ++r) block.finish(sums[r][0], dots[r], x_sums[r * num_blocks + b]);
  }
  store_tile<ROWS, 1>(sums, out, out_stride, cols, scale, bias);
}

template <Format F, int ROWS = TILE_ROWS>
void multiply_widened_rows(const float* x, const float* x_sums, int64_t rows, int64_t k, const uint8_t* panel,
                           const float* widened, float* out, int64_t n, int64_t cols, const float* scale,
                           const float* bias) {
  if constexpr (ROWS > 1)
    if (rows < ROWS)
      return multiply_widened_rows<F, ROWS - 1>(x, x_sums, rows, k, panel, widened, out, n, cols, scale, bias);
  multiply_widened<F, ROWS>(x, x_sums, k, panel, widened, out, n, cols, scale, bias);
}

template <Format F>
void widen_panel(const uint8_t* panel, int64_t k, float* widened) {
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const Block<F> block(panel + b * Block<F>::BYTES);
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
      floatx16 q0, q1;
      block.pair(j, q0, q1);
      std::memcpy(widened + (b * BLOCK + 2 * j) * PANEL, &q0, sizeof q0);
      std::memcpy(widened + (b * BLOCK + 2 * j + 1) * PANEL, &q1, sizeof q1);
    }
  }
}

// Each row's sum of x over each block of 32 k, in order of k: Q4_1's minimum multiplies it (x_sums[r][b]).
std::vector<float> block_sums(const float* x, int64_t m, int64_t k) {
  std::vector<float> sums(m * (k / BLOCK));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / BLOCK; ++b) {
      float sum = 0.0f;
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i) sum += x[r * k + i];
      sums[r * (k / BLOCK) + b] = sum;
    }
  return sums;
}

// --8<-- [start:multiply]
// out = x W^T (x: m rows of k), the panels shared out among the threads: a single row four panels at a time, up to
// TILE_ROWS rows one tile a panel, more rows over each panel's integers made into float32 once.
template <Format F>
void multiply(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t panels, float* out, int64_t n,
              const float* scale, const float* bias) {
  const int64_t stride = k / BLOCK * Block<F>::BYTES;
  const std::vector<float> sums = F == Format::Q4_1 ? block_sums(x, m, k) : std::vector<float>(m * (k / BLOCK));
  const float* x_sums = sums.data();
  const int64_t row_sums = k / BLOCK;  // x_sums of one row
  const auto cols = [&](int64_t panel, int64_t count) { return std::min(n - panel * PANEL, count * PANEL); };
  const auto at = [](const float* v, int64_t panel) { return v ? v + panel * PANEL : nullptr; };
  at::parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t end_panel) {
    int64_t p = first_panel;
    if (m == 1)
      for (; p + 4 <= end_panel; p += 4)
        multiply_tile<F, 1, 4>(x, x_sums, k, w + p * stride, stride, out + p * PANEL, n, cols(p, 4), at(scale, p),
                               at(bias, p));
    if (m <= TILE_ROWS) {
      for (; p < end_panel; ++p)
        multiply_rows<F>(x, x_sums, m, k, w + p * stride, out + p * PANEL, n, cols(p, 1), at(scale, p), at(bias, p));
      return;
    }
    std::vector<float> widened(k * PANEL);
    for (; p < end_panel; ++p) {
      widen_panel<F>(w + p * stride, k, widened.data());
      for (int64_t r = 0; r < m; r += TILE_ROWS)
        multiply_widened_rows<F>(x + r * k, x_sums + r * row_sums, std::min<int64_t>(TILE_ROWS, m - r), k,
                                 w + p * stride, widened.data(), out + r * n + p * PANEL, n, cols(p, 1),
                                 at(scale, p), at(bias, p));
    }
  });
}
// --8<-- [end:multiply]

int64_t block_bytes(Format format) {
  switch (format) {
    case Format::Q4_1: return Block<Format::Q4_1>::BYTES;
    case Format::Q8_0: return Block<Format::Q8_0>::BYTES;
    default: return Block<Format::INT8>::BYTES;
  }
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed_weight, c10::optional<torch::Tensor> scale,
                           c10::optional<torch::Tensor> bias, int64_t out_features, int64_t format_code) {
  TORCH_CHECK(format_code >= 0 && format_code <= 2, "format must be 0 (Q4_1), 1 (Q8_0) or 2 (int8), got ",
              format_code);
  const Format format = static_cast<Format>(format_code);
  TORCH_CHECK(x.device().is_cpu() && packed_weight.device().is_cpu(), "quant_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear takes float32 x, got ", x.scalar_type());
  TORCH_CHECK(packed_weight.scalar_type() == at::kByte && packed_weight.dim() == 3 && packed_weight.is_contiguous() &&
                  packed_weight.size(2) == block_bytes(format),
              "the weight must come packed by quantized.py: uint8 [panels, in_features / 32, ", block_bytes(format),
              "], contiguous");
  const int64_t n = out_features, panels = packed_weight.size(0), k = packed_weight.size(1) * BLOCK;
  TORCH_CHECK(n > 0 && (n + PANEL - 1) / PANEL == panels, "out_features (", n, ") does not fit ", panels, " panels");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x's last dimension must be the weight's in_features (", k, "), got ",
              x.size(-1));
  TORCH_CHECK(scale.has_value() == (format == Format::INT8), "int8 weights take a scale per column, GGUF's none");
  for (const auto& v : {scale, bias})
    TORCH_CHECK(!v.has_value() || (v->device().is_cpu() && v->scalar_type() == at::kFloat && v->dim() == 1 &&
                                   v->size(0) >= n && v->is_contiguous()),
                "a scale or bias is a contiguous float32 vector of out_features (", n, ") numbers, on the CPU");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor out = torch::empty(shape, x.options());
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = out.numel() / n;
  const float* scale_data = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const auto run = [&](auto kernel) {
    kernel(rows.data_ptr<float>(), m, k, packed_weight.data_ptr<uint8_t>(), panels, out.data_ptr<float>(), n,
           scale_data, bias_data);
  };
  switch (format) {
    case Format::Q4_1: run(multiply<Format::Q4_1>); break;
    case Format::Q8_0: run(multiply<Format::Q8_0>); break;
    case Format::INT8: run(multiply<Format::INT8>); break;
  }
  return out;
}

// SiLU(x G^T) * (x U^T), a gated MLP's activation, in one call: G and U packed as one weight, the gate's panels then
// up's (quantized.py), `intermediate` columns each, as panel_linear's panel_silu_mul.
torch::Tensor quant_silu_mul(torch::Tensor x, torch::Tensor packed_gate_up, c10::optional<torch::Tensor> scale,
                             int64_t intermediate, int64_t format_code) {
  const int64_t half = (intermediate + PANEL - 1) / PANEL * PANEL;  // each padded to whole panels
  TORCH_CHECK(intermediate > 0 && packed_gate_up.dim() == 3 && packed_gate_up.size(0) * PANEL == 2 * half,
              "packed_gate_up must come from quantized.py: gate and up, ", intermediate, " intermediate columns each");
  const torch::Tensor gate_up = quant_linear(x, packed_gate_up, scale, c10::nullopt, 2 * half, format_code);
  return at::silu(gate_up.narrow(-1, 0, intermediate).contiguous()) * gate_up.narrow(-1, half, intermediate);
}

TORCH_LIBRARY_FRAGMENT(milestones, m) {
  m.def("quant_linear(Tensor x, Tensor packed_weight, Tensor? scale, Tensor? bias, int out_features, int format) "
        "-> Tensor");
  m.def("quant_silu_mul(Tensor x, Tensor packed_gate_up, Tensor? scale, int intermediate, int format) -> Tensor");
}

TORCH_LIBRARY_IMPL(milestones, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_silu_mul", &quant_silu_mul);
}
