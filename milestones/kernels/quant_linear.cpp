// y = x W^T (+ bias) for float32 x and a weight kept as small integers in blocks: the fast path behind
// quantization="gguf" and "int8" (quant_blocks.py packs the weights; quant_linear.py builds this file and registers
// its ops milestones::quant_linear and milestones::quant_silu_mul).
//
// A decode step at batch 1 reads every weight once, so it runs at the speed of memory; a weight of 4 or 8 bits is a
// fraction of a float32's 32, and the step reads that fraction of the bytes. The price is arithmetic: each weight
// is turned back into a float32 in registers, as it is used, and never stored as one. Three formats:
//
//   Q4_1 (GGUF): 32 weights share a scale d and a minimum m (float16 each); weight = d * q + m, q in 0..15 (4 bits).
//   Q8_0 (GGUF): 32 weights share a scale d (float16); weight = d * q, q in -128..127 (8 bits).
//   int8 (made at load time): one scale per output column; y = scale * (x . q), q in -127..127.
//
// Like panel_linear.cpp, the weight comes packed in panels of 16 output columns, so that for each k the 16 weights
// of a panel are side by side: a block of 32 k of a panel holds its 16 columns' scales (and minimums), then the
// 32 x 16 integers. Q4_1 keeps two k in a byte: the byte of column c for the pair of k (2j, 2j + 1) holds k = 2j in
// its low 4 bits and 2j + 1 in its high 4 bits, so one load and a widening give 16 bytes as 16 integers, a mask
// gives k = 2j's 16 weights and a shift k = 2j + 1's.
//
// In Q4_1 and Q8_0, d * q needs at most 19 bits of mantissa, so it is exact in float32, and d * q + m rounds once:
// the weight made in a register is exactly the float32 weight transformers makes when it de-quantizes the file (the
// chain's weights). The kernel then sums x[k] * w[k] in order of k, one fused multiply-add each, as panel_linear's
// float32 path does: its outputs are panel_linear's over the de-quantized weights, bit for bit, whatever the batch
// (batch invariant), and the tiles, threads and the vector width (AVX-512, AVX2) change nothing. Built without
// -ffast-math, which would reorder the sums.

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
// One block of 32 k of one panel, made into float32 weights a pair of k at a time: w0 for k = 2j, w1 for 2j + 1.
template <Format F>
struct Block;

template <>
struct Block<Format::Q4_1> {
  static constexpr int64_t BYTES = 4 * PANEL + BLOCK * PANEL / 2;  // 16 scales, 16 minimums, 32 x 16 nibbles: 320
  floatx16 d, m;
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : d(load_halves(block)), m(load_halves(block + 2 * PANEL)), q(block + 4 * PANEL) {}
  void pair(int64_t j, floatx16& w0, floatx16& w1) const {
    nibbles(q + j * PANEL, w0, w1);
    w0 = d * w0 + m;  // d * q is exact, so this rounds once, fused or not
    w1 = d * w1 + m;
  }
};

template <>
struct Block<Format::Q8_0> {
  static constexpr int64_t BYTES = 2 * PANEL + BLOCK * PANEL;  // 16 scales, 32 x 16 signed bytes: 544
  floatx16 d;
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : d(load_halves(block)), q(block + 2 * PANEL) {}
  void pair(int64_t j, floatx16& w0, floatx16& w1) const {
    w0 = d * signed_bytes(q + 2 * j * PANEL);  // exact
    w1 = d * signed_bytes(q + (2 * j + 1) * PANEL);
  }
};

template <>
struct Block<Format::INT8> {
  static constexpr int64_t BYTES = BLOCK * PANEL;  // 32 x 16 signed bytes; the column's scale comes at the end
  const uint8_t* q;
  Block() = default;
  explicit Block(const uint8_t* block) : q(block) {}
  void pair(int64_t j, floatx16& w0, floatx16& w1) const {
    w0 = signed_bytes(q + 2 * j * PANEL);
    w1 = signed_bytes(q + (2 * j + 1) * PANEL);
  }
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
// apart), the weights made in registers block by block. Every sum goes in order of k, one fused multiply-add a k.
template <Format F, int ROWS, int PANELS>
void multiply_tile(const float* x, int64_t k, const uint8_t* panels, int64_t panel_stride, float* out,
                   int64_t out_stride, int64_t cols, const float* scale, const float* bias) {
  floatx16 sums[ROWS][PANELS] = {};
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    Block<F> blocks[PANELS];
    for (int p = 0; p < PANELS; ++p) blocks[p] = Block<F>(panels + p * panel_stride + b * Block<F>::BYTES);
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
      const int64_t i = b * BLOCK + 2 * j;
      for (int p = 0; p < PANELS; ++p) {  // a single row: several panels, so that several sums are under way
        floatx16 w0, w1;
        blocks[p].pair(j, w0, w1);
        for (int r = 0; r < ROWS; ++r) {
          sums[r][p] += x[r * k + i] * w0;
          sums[r][p] += x[r * k + i + 1] * w1;
        }
      }
    }
  }
  store_tile<ROWS, PANELS>(sums, out, out_stride, cols, scale, bias);
}
// --8<-- [end:tile]

// multiply_tile<F, rows, 1> for a number of rows known only at run time (1 to TILE_ROWS).
template <Format F, int ROWS = TILE_ROWS>
void multiply_rows(const float* x, int64_t rows, int64_t k, const uint8_t* panel, float* out, int64_t n,
                   int64_t cols, const float* scale, const float* bias) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return multiply_rows<F, ROWS - 1>(x, rows, k, panel, out, n, cols, scale, bias);
  multiply_tile<F, ROWS, 1>(x, k, panel, 0, out, n, cols, scale, bias);
}

// Many rows: one panel's weights made into float32 once ([k, 16], `widened`), then read by every tile of rows, in
// the same order of k. Making a weight costs a few instructions; each of the m rows then costs one.
template <int ROWS>
void multiply_widened(const float* x, int64_t k, const float* widened, float* out, int64_t out_stride,
                      int64_t cols, const float* scale, const float* bias) {
  floatx16 sums[ROWS][1] = {};
  for (int64_t i = 0; i < k; ++i) {
    floatx16 w;
    std::memcpy(&w, widened + i * PANEL, sizeof w);
    for (int r = 0; r < ROWS; ++r) sums[r][0] += x[r * k + i] * w;
  }
  store_tile<ROWS, 1>(sums, out, out_stride, cols, scale, bias);
}

template <int ROWS = TILE_ROWS>
void multiply_widened_rows(const float* x, int64_t rows, int64_t k, const float* widened, float* out, int64_t n,
                           int64_t cols, const float* scale, const float* bias) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return multiply_widened_rows<ROWS - 1>(x, rows, k, widened, out, n, cols, scale, bias);
  multiply_widened<ROWS>(x, k, widened, out, n, cols, scale, bias);
}

template <Format F>
void widen_panel(const uint8_t* panel, int64_t k, float* widened) {
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const Block<F> block(panel + b * Block<F>::BYTES);
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
      floatx16 w0, w1;
      block.pair(j, w0, w1);
      std::memcpy(widened + (b * BLOCK + 2 * j) * PANEL, &w0, sizeof w0);
      std::memcpy(widened + (b * BLOCK + 2 * j + 1) * PANEL, &w1, sizeof w1);
    }
  }
}

// --8<-- [start:multiply]
// out = x W^T (x: m rows of k), the panels shared out among the threads: a single row four panels at a time, up to
// TILE_ROWS rows one tile a panel, more rows over each panel made into float32 once.
template <Format F>
void multiply(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t panels, float* out, int64_t n,
              const float* scale, const float* bias) {
  const int64_t stride = k / BLOCK * Block<F>::BYTES;
  const auto cols = [&](int64_t panel, int64_t count) { return std::min(n - panel * PANEL, count * PANEL); };
  const auto at = [](const float* v, int64_t panel) { return v ? v + panel * PANEL : nullptr; };
  at::parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t end_panel) {
    int64_t p = first_panel;
    if (m == 1)
      for (; p + 4 <= end_panel; p += 4)
        multiply_tile<F, 1, 4>(x, k, w + p * stride, stride, out + p * PANEL, n, cols(p, 4), at(scale, p), at(bias, p));
    if (m <= TILE_ROWS) {
      for (; p < end_panel; ++p)
        multiply_rows<F>(x, m, k, w + p * stride, out + p * PANEL, n, cols(p, 1), at(scale, p), at(bias, p));
      return;
    }
    std::vector<float> widened(k * PANEL);
    for (; p < end_panel; ++p) {
      widen_panel<F>(w + p * stride, k, widened.data());
      for (int64_t r = 0; r < m; r += TILE_ROWS)
        multiply_widened_rows(x + r * k, std::min<int64_t>(TILE_ROWS, m - r), k, widened.data(),
                              out + r * n + p * PANEL, n, cols(p, 1), at(scale, p), at(bias, p));
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
