// y = x W^T (+ bias) for float32 or bfloat16 x and W, summed in float32: the fast path behind
// linear_backend="cpp" (panel_linear.py packs the weights, builds this file and registers its ops
// milestones::panel_linear and milestones::panel_silu_mul, a gated MLP's gate and up in one call).
//
// A decode step at batch 1 reads every weight once and does two flops with it, so it runs at the
// speed of memory: the kernel's job is to keep the memory busy. The weight comes packed in panels of
// 16 output columns, [panels, in_features, 16] (panel_linear.py packs it once, at load time): for
// each k, the 16 weights of a panel sit side by side, so the kernel reads the weight straight
// through, front to back, once per tile of rows. It takes one x[r][k], broadcast, times the 16
// weights of k, into the sums of 16 outputs -- the shape of a BLAS inner kernel. A single row (a
// decode at batch 1) takes four panels at once, so that eight sums are under way while the memory
// streams the weights in.
//
// In float32 a panel's 16 weights of one k are stored even columns first, then odd (0 2 4 .. 14,
// 1 3 .. 15), the order the sums are kept in. In bfloat16 they are stored in column order, half
// the bytes, and that is what makes bfloat16 faster on a CPU. A CPU with AVX-512 BF16 or AMX
// multiplies bfloat16 in hardware; on one without (AVX2, a laptop's NEON) torch's bfloat16 product
// falls back to slow generic code. This kernel needs no bfloat16 instruction: a bfloat16 number is
// the top 16 bits of a float32, so it is widened exactly as it is loaded. Read as eight 32-bit
// words, a bfloat16 panel's k holds an even column in each word's low half and the next odd column
// in its high half, so a shift left by 16 gives the 8 even columns as floats and a mask the 8 odd
// ones, without shuffling.
//
// A CPU with AVX-512 BF16 (and a build for it, -march=native) has an instruction that does the
// widening and two multiply-adds in one: vdpbf16ps takes 16 float32 sums, 32 bfloat16 weights and
// 32 bfloat16 inputs and adds to each sum the products of one pair of k. There a bfloat16 weight
// is packed in pairs, [panels, k / 2, 16 columns x 2 k], and the input stays bfloat16; every
// output is summed pair by pair, in the instruction's own fixed order (flushing subnormal numbers
// to zero, as it does), then rounded once to bfloat16.
//
// Every output is the sum of x[k] * w[k] for k = 0, 1, 2, ... in that order, in float32 (each
// product fused into the sum; with pairs, one pair of k after another), then the bias (and in
// bfloat16 one rounding). The number of rows, the tiling and the thread do not change that order,
// so a row's result does not depend on the batch it came in: a request gets the same numbers alone
// or among sixty others ("batch invariant"). Built without -ffast-math, which would reorder sums.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 16;  // output columns per packed panel: two vectors of 8 floats
constexpr int TILE_ROWS = 6;   // 6 rows x 2 vectors: 12 sums, 2 weight vectors and a broadcast in 16 registers

typedef float floatx8 __attribute__((vector_size(32)));
typedef uint32_t uintx8 __attribute__((vector_size(32)));

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a 32-bit word holds its first bfloat16 in its low half");

inline floatx8 load(const float* p) {
  floatx8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One k of a panel: its 16 weights, as the float32 sums of its even and of its odd columns want them.
// bfloat16 (the packed weight): 8 32-bit words, each holding column 2j in its low half and 2j + 1 in its
// high half; a bfloat16 is the top half of a float32, so a shift and a mask widen them exactly.
inline void load_columns(const c10::BFloat16* p, floatx8& even, floatx8& odd) {
  uintx8 words;
  std::memcpy(&words, p, sizeof words);
  const uintx8 low = words << 16, high = words & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof even);
  std::memcpy(&odd, &high, sizeof odd);
}

// float32 (a packed float32 weight, or a bfloat16 panel widened once for many rows): the even columns' 8 floats,
// then the odd columns'.
inline void load_columns(const float* p, floatx8& even, floatx8& odd) {
  even = load(p);
  odd = load(p + 8);
}

// One output: the float32 sum, plus its bias (if any), rounded once to the output's dtype (bfloat16: to nearest even,
// as torch rounds).
template <typename O>
inline void store(O* out, int64_t c, float sum, const float* bias) {
  out[c] = O(bias ? sum + bias[c] : sum);
}

// --8<-- [start:tile]
// Part of the next panel for a tile to ask for while it works: a line (one k) every `every` k, from `next` on, into
// the L2 cache only or into L1 as well. A hint: it changes no number.
template <typename W>
struct Ahead {
  const W* next = nullptr;
  int64_t every = 1;
  bool l2_only = false;
  int64_t countdown = every;

  void tick() {  // once per k
    if (!next || --countdown) return;
    if (l2_only)
      __builtin_prefetch(next, 0, 2);
    else
      __builtin_prefetch(next, 0, 3);
    next += PANEL;
    countdown = every;
  }
};

// out[r][0:cols] = x[r] . panels (+ bias) for ROWS rows of x (float, k long) against PANELS consecutive panels, each
// [k, 16] (float or bfloat16, panel_stride apart); cols counts the valid columns of all of them. A tile of one panel
// may be handed part of the next panel to ask for meanwhile.
template <int ROWS, int PANELS, typename W, typename O>
void multiply_tile(const float* x, int64_t k, const W* panels, int64_t panel_stride, O* out, int64_t out_stride,
                   int64_t cols, const float* bias, Ahead<W> ahead = {}) {
  floatx8 sums[ROWS][2 * PANELS] = {};
  for (int64_t i = 0; i < k; ++i) {  // in order of k: every output's sum is the same whatever ROWS and PANELS are
    if constexpr (PANELS == 1) ahead.tick();
    for (int p = 0; p < PANELS; ++p) {
      floatx8 even, odd;
      load_columns(panels + p * panel_stride + i * PANEL, even, odd);
      for (int r = 0; r < ROWS; ++r) {
        const float xr = x[r * k + i];
        sums[r][2 * p] += xr * even;
        sums[r][2 * p + 1] += xr * odd;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < cols; ++c)
      store(out + r * out_stride, c, sums[r][2 * (c / PANEL) + c % 2][c % PANEL / 2], bias);
}
// --8<-- [end:tile]

// multiply_tile<rows, 1> for a number of rows known only at run time (1 to TILE_ROWS).
template <int ROWS = TILE_ROWS, typename W, typename O>
void multiply_rows(const float* x, int64_t rows, int64_t k, const W* panel, int64_t stride, O* out, int64_t n,
                   int64_t cols, const float* bias, Ahead<W> ahead) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return multiply_rows<ROWS - 1>(x, rows, k, panel, stride, out, n, cols, bias, ahead);
  multiply_tile<ROWS, 1>(x, k, panel, stride, out, n, cols, bias, ahead);
}

#if defined(__AVX512F__)
// --8<-- [start:wide_tile]
// 3 to 16 rows, on a CPU with AVX-512: one float32 tile takes them all. Its 32 vector registers hold a panel's 16
// weights of one k as a single vector and a sum of 16 columns for each of up to 16 rows, with room for a broadcast,
// so a decode step of 16 requests reads each panel once, where tiles of 6 rows (6 + 6 + 4) read it three times,
// twice from L2 (a panel of 576 k is 36 KiB, more than L1's 32). x comes transposed, [k, ROWS]: the inputs of one k
// side by side in one cache line, where rows k floats apart can fall in the same few sets of L1 and push each other
// out. Lane j of a sum is column 2j for j < 8 and column 2(j - 8) + 1 from 8 on, the packed order (even columns,
// then odd), and each lane is the same sum, k by k, as multiply_tile's: a row's numbers do not depend on the tile.
// While it works, the tile asks for the next panel, a line a k, into L2 only. (At 2 rows a tile of two vectors a
// row, multiply_tile's, keeps more sums under way and was 3% faster; past 16 rows, tiles of 6.)
constexpr int WIDE_MIN_ROWS = 3;
constexpr int WIDE_TILE_ROWS = 16;
typedef float floatx16 __attribute__((vector_size(64)));

template <int ROWS, typename O>
void multiply_wide_tile(const float* xt, int64_t k, const float* panel, O* out, int64_t out_stride, int64_t cols,
                        const float* bias, Ahead<float> ahead) {
  floatx16 sums[ROWS] = {};
  for (int64_t i = 0; i < k; ++i) {  // in order of k, as every other tile
    ahead.tick();
    floatx16 w;
    std::memcpy(&w, panel + i * PANEL, sizeof w);
    for (int r = 0; r < ROWS; ++r) sums[r] += xt[i * ROWS + r] * w;
  }
  for (int r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < cols; ++c) store(out + r * out_stride, c, sums[r][c % 2 * 8 + c / 2], bias);
}
// --8<-- [end:wide_tile]

// multiply_wide_tile<rows> for a number of rows known only at run time (WIDE_MIN_ROWS to WIDE_TILE_ROWS).
template <int ROWS = WIDE_TILE_ROWS, typename O>
void multiply_wide_rows(const float* xt, int64_t rows, int64_t k, const float* panel, O* out, int64_t n, int64_t cols,
                        const float* bias, Ahead<float> ahead) {
  if constexpr (ROWS > WIDE_MIN_ROWS)
    if (rows < ROWS) return multiply_wide_rows<ROWS - 1>(xt, rows, k, panel, out, n, cols, bias, ahead);
  multiply_wide_tile<ROWS>(xt, k, panel, out, n, cols, bias, ahead);
}

// All m rows (x transposed: [k, m]) against `count` panels, one wide tile a panel.
template <typename O>
void multiply_wide_panels(const float* xt, int64_t m, int64_t k, const float* panels, int64_t count, O* out,
                          int64_t n, int64_t cols, const float* bias) {
  const int64_t stride = k * PANEL;
  for (int64_t p = 0; p < count; ++p) {
    const float* panel = panels + p * stride;
    const float* next = p + 1 < count ? panel + stride : nullptr;
    multiply_wide_rows(xt, m, k, panel, out + p * PANEL, n, std::min<int64_t>(cols - p * PANEL, PANEL),
                       bias ? bias + p * PANEL : nullptr, Ahead<float>{next, 1, true});
  }
}
#endif

// out[:, 0:cols] for all m rows of x against `count` consecutive panels (out's rows are n long; bias from the first).
template <typename W, typename O>
void multiply_panels(const float* x, int64_t m, int64_t k, const W* panels, int64_t count, O* out, int64_t n,
                     int64_t cols, const float* bias) {
  const int64_t stride = k * PANEL;
  int64_t p = 0;
  if (m == 1)  // a decode at batch 1: four panels at once, so that eight independent sums are under way
    for (; p + 4 <= count; p += 4)
      multiply_tile<1, 4>(x, k, panels + p * stride, stride, out + p * PANEL, n,
                          std::min<int64_t>(cols - p * PANEL, 4 * PANEL), bias ? bias + p * PANEL : nullptr);
  // --8<-- [start:ahead]
  // Many rows: each panel is read once per tile of rows, the first time from memory. The CPU's prefetcher does not
  // see the next panel coming until the first tile asks for it, and then the tile waits on memory; so while the
  // tiles work through this panel they ask for the next one, each most of its share (tile at row r: lines from
  // k r / m on, one every ceil(m / rows) k: about one line per m cycles of sums, spread over the panel; faster than
  // that overwhelmed the memory in our trials). With one tile a panel the step goes at memory's own pace: no hint.
  // With a few tiles the lines come quickly, and asked into L1 they push out the panel the tiles are still reading
  // (a panel of 576 k is 36 KiB, an L1 32 KiB): up to 3 tiles they go to L2 only (measured: 12 rows 30% faster
  // than into L1, 64 rows 10% slower). float32 only: a bfloat16 step of many rows widens each panel into a buffer
  // first (multiply, below), one panel a call, so `next` stays null there.
  const bool prefetch = m > TILE_ROWS, l2_only = m <= 3 * TILE_ROWS;
  for (; p < count; ++p) {
    const W* panel = panels + p * stride;
    const int64_t panel_cols = std::min<int64_t>(cols - p * PANEL, PANEL);
    for (int64_t r = 0; r < m; r += TILE_ROWS) {
      const int64_t rows = std::min<int64_t>(TILE_ROWS, m - r);
      const W* next = prefetch && p + 1 < count ? panel + stride + r * k / m * PANEL : nullptr;
      multiply_rows(x + r * k, rows, k, panel, stride, out + r * n + p * PANEL, n, panel_cols,
                    bias ? bias + p * PANEL : nullptr, Ahead<W>{next, (m + rows - 1) / rows, l2_only});
    }
  }
  // --8<-- [end:ahead]
}

// out = x W^T, the panels shared out among the threads. A bfloat16 panel that several tiles of rows read is
// widened to float32 once, into a buffer they then share; otherwise each panel is read straight from the weight.
template <typename W, typename O>
void multiply(const float* x, int64_t m, int64_t k, const W* w_data, int64_t panels, O* out, int64_t n,
              const float* bias) {
  const bool widen_panels = std::is_same_v<W, c10::BFloat16> && m > TILE_ROWS;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, float>)
    if (m >= WIDE_MIN_ROWS && m <= WIDE_TILE_ROWS) {  // one wide tile, x transposed first
      std::vector<float> xt(m * k);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) xt[i * m + r] = x[r * k + i];
      at::parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t end_panel) {
        const int64_t col = first_panel * PANEL;
        multiply_wide_panels(xt.data(), m, k, w_data + first_panel * k * PANEL, end_panel - first_panel, out + col, n,
                             std::min(n, end_panel * PANEL) - col, bias ? bias + col : nullptr);
      });
      return;
    }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t end_panel) {
    if (!widen_panels) {
      const int64_t col = first_panel * PANEL;
      multiply_panels(x, m, k, w_data + first_panel * k * PANEL, end_panel - first_panel, out + col, n,
                      std::min(n, end_panel * PANEL) - col, bias ? bias + col : nullptr);
      return;
    }
    std::vector<float> widened(k * PANEL);
    for (int64_t panel = first_panel; panel < end_panel; ++panel) {
      const int64_t col = panel * PANEL;
      const W* w = w_data + panel * k * PANEL;
      for (int64_t i = 0; i < k * PANEL; i += PANEL) {  // each k: the even columns' 8 floats, then the odd
        floatx8 even, odd;
        load_columns(w + i, even, odd);
        std::memcpy(widened.data() + i, &even, sizeof even);
        std::memcpy(widened.data() + i + 8, &odd, sizeof odd);
      }
      multiply_panels(x, m, k, widened.data(), 1, out + col, n, std::min(PANEL, n - col), bias ? bias + col : nullptr);
    }
  });
}

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DOT = true;
constexpr int PAIR_TILE_ROWS = 8;  // 8 rows x 2 panels: 16 sums of 16 floats in the 32 registers of AVX-512

// --8<-- [start:pair_tile]
// out[r][0:cols] = x[r] . panels (+ bias) for ROWS rows of x (bfloat16, `pairs` 32-bit words of two k each a row)
// against PANELS consecutive panels packed in pairs ([pairs, 16 columns x 2 k], panel_stride apart).
template <int ROWS, int PANELS>
void multiply_pair_tile(const uint32_t* x, int64_t pairs, const c10::BFloat16* panels, int64_t panel_stride,
                        c10::BFloat16* out, int64_t out_stride, int64_t cols, const float* bias) {
  __m512 sums[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS; ++p) sums[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {  // in order of pairs of k, whatever ROWS and PANELS are
    for (int p = 0; p < PANELS; ++p) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panels + p * panel_stride + i * 2 * PANEL);
      for (int r = 0; r < ROWS; ++r)
        sums[r][p] = _mm512_dpbf16_ps(sums[r][p], w, (__m512bh)_mm512_set1_epi32(x[r * pairs + i]));
    }
  }
  alignas(64) float lanes[PANEL];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS && p * PANEL < cols; ++p) {
      _mm512_store_ps(lanes, sums[r][p]);
      for (int64_t c = 0; c < std::min<int64_t>(PANEL, cols - p * PANEL); ++c)
        store(out + r * out_stride + p * PANEL, c, lanes[c], bias ? bias + p * PANEL : nullptr);
    }
}
// --8<-- [end:pair_tile]

// multiply_pair_tile<rows, PANELS> for a number of rows known only at run time (1 to PAIR_TILE_ROWS).
template <int PANELS, int ROWS = PAIR_TILE_ROWS>
void multiply_pair_rows(const uint32_t* x, int64_t rows, int64_t pairs, const c10::BFloat16* panels, int64_t stride,
                        c10::BFloat16* out, int64_t n, int64_t cols, const float* bias) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return multiply_pair_rows<PANELS, ROWS - 1>(x, rows, pairs, panels, stride, out, n, cols, bias);
  multiply_pair_tile<ROWS, PANELS>(x, pairs, panels, stride, out, n, cols, bias);
}

// Every row of x against PANELS consecutive panels (cols valid columns), in tiles of rows.
template <int PANELS>
void multiply_pair_panels(const uint32_t* x, int64_t m, int64_t pairs, const c10::BFloat16* panels, int64_t stride,
                          c10::BFloat16* out, int64_t n, int64_t cols, const float* bias) {
  for (int64_t r = 0; r < m; r += PAIR_TILE_ROWS)
    multiply_pair_rows<PANELS>(x + r * pairs, std::min<int64_t>(PAIR_TILE_ROWS, m - r), pairs, panels, stride,
                               out + r * n, n, cols, bias);
}

// out = x W^T for bfloat16 pairs, the panels shared out among the threads: a single row four panels at a time
// (memory-bound: eight sums under way), more rows two panels at a time (16 sums), the rest one.
void multiply_pairs(const uint32_t* x, int64_t m, int64_t pairs, const c10::BFloat16* w_data, int64_t panels,
                    c10::BFloat16* out, int64_t n, const float* bias) {
  const int64_t stride = pairs * 2 * PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t first_panel, int64_t end_panel) {
    int64_t p = first_panel;
    const auto cols = [&](int64_t panel, int64_t count) { return std::min(n - panel * PANEL, count * PANEL); };
    const auto bias_at = [&](int64_t panel) { return bias ? bias + panel * PANEL : nullptr; };
    if (m == 1)
      for (; p + 4 <= end_panel; p += 4)
        multiply_pair_tile<1, 4>(x, pairs, w_data + p * stride, stride, out + p * PANEL, n, cols(p, 4), bias_at(p));
    for (; p + 2 <= end_panel; p += 2)
      multiply_pair_panels<2>(x, m, pairs, w_data + p * stride, stride, out + p * PANEL, n, cols(p, 2), bias_at(p));
    for (; p < end_panel; ++p)
      multiply_pair_panels<1>(x, m, pairs, w_data + p * stride, stride, out + p * PANEL, n, cols(p, 1), bias_at(p));
  });
}
#else
constexpr bool HAS_BF16_DOT = false;
#endif

}  // namespace

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed_weight, c10::optional<torch::Tensor> bias,
                           int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed_weight.device().is_cpu(), "panel_linear runs on the CPU");
  const at::ScalarType dtype = packed_weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "panel_linear takes x and weight both in float32 or both in bfloat16, got ", x.scalar_type(), " and ",
              dtype);
  // bfloat16 packed in pairs of k: [panels, in_features / 2 rounded up, 32]; otherwise [panels, in_features, 16].
  const bool paired = dtype == at::kBFloat16 && packed_weight.dim() == 3 && packed_weight.size(2) == 2 * PANEL;
  TORCH_CHECK(packed_weight.dim() == 3 && (packed_weight.size(2) == PANEL || paired) && packed_weight.is_contiguous(),
              "the weight must come packed by panel_linear.pack_weight: [panels, in_features, 16], or in bfloat16 "
              "[panels, in_features / 2, 32] (pairs), contiguous");
  TORCH_CHECK(!paired || HAS_BF16_DOT, "a weight packed in bfloat16 pairs needs a CPU with AVX-512 BF16 (this build "
              "has none): pack it with panel_linear.pack_weight(weight, pairs=False)");
  const int64_t n = out_features, panels = packed_weight.size(0);
  const int64_t k = paired ? x.size(-1) : packed_weight.size(1);
  TORCH_CHECK(n > 0 && (n + PANEL - 1) / PANEL == panels, "out_features (", n, ") does not fit ", panels, " panels");
  TORCH_CHECK(x.dim() >= 1 && (paired ? (k + 1) / 2 == packed_weight.size(1) : x.size(-1) == k),
              "x's last dimension must be the weight's in_features (",
              paired ? "packed in " + std::to_string(packed_weight.size(1)) + " pairs" : std::to_string(k),
              "), got ", x.size(-1));
  TORCH_CHECK(!bias.has_value() || (bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 &&
                                     bias->size(0) == n),
              "the bias is a vector of out_features (", n, ") numbers in the weight's dtype, on the CPU");

  // The bias in float32, added to each float32 sum before the output's one rounding.
  const torch::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* bias_data = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor out = torch::empty(shape, x.options());  // written by the kernel in x's dtype
  const int64_t m = out.numel() / n;
  if (paired) {  // x stays bfloat16, each row padded to whole pairs of k
#if defined(__AVX512BF16__)
    torch::Tensor rows = x.reshape({-1, k}).contiguous();
    if (k % 2) rows = torch::constant_pad_nd(rows, {0, 1});
    multiply_pairs(reinterpret_cast<const uint32_t*>(rows.data_ptr<c10::BFloat16>()), m, (k + 1) / 2,
                   packed_weight.data_ptr<c10::BFloat16>(), panels, out.data_ptr<c10::BFloat16>(), n, bias_data);
#endif
  } else {
    const torch::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();  // bfloat16: widened once
    const float* x_data = rows.data_ptr<float>();
    if (dtype == at::kFloat)
      multiply(x_data, m, k, packed_weight.data_ptr<float>(), panels, out.data_ptr<float>(), n, bias_data);
    else
      multiply(x_data, m, k, packed_weight.data_ptr<c10::BFloat16>(), panels, out.data_ptr<c10::BFloat16>(), n,
               bias_data);
  }
  return out;
}

// --8<-- [start:silu_mul]
// SiLU(x G^T) * (x U^T), a gated MLP's activation (its gate and up projections), in one call of the kernel: G and U
// packed as one weight, the gate's panels then up's (panel_linear.py's pack_gate_up), `intermediate` columns each.
// An output's sum does not depend on where its panel sits, so gate and up are the numbers of two separate calls;
// SiLU and the product are torch's own, on tensors of the lesson's shapes, so they round as the lesson does.
torch::Tensor panel_silu_mul(torch::Tensor x, torch::Tensor packed_gate_up, int64_t intermediate) {
  const int64_t half = (intermediate + PANEL - 1) / PANEL * PANEL;  // each padded to whole panels
  TORCH_CHECK(intermediate > 0 && packed_gate_up.dim() == 3 && packed_gate_up.size(0) * PANEL == 2 * half,
              "packed_gate_up must come from panel_linear.pack_gate_up: gate and up, ", intermediate,
              " intermediate columns each");
  const torch::Tensor gate_up = panel_linear(x, packed_gate_up, c10::nullopt, 2 * half);
  // The gate as a tensor of its own (a copy only where several rows interleave it with up): torch's SiLU takes its
  // vectorised path on whole vectors of a contiguous tensor and a scalar one on the rest, which may differ in the
  // last bit, so it must see the lesson's layout.
  return at::silu(gate_up.narrow(-1, 0, intermediate).contiguous()) * gate_up.narrow(-1, half, intermediate);
}
// --8<-- [end:silu_mul]

// Whether this build multiplies bfloat16 pairs in hardware, and so takes bfloat16 weights packed in pairs.
bool panel_linear_bf16_pairs() { return HAS_BF16_DOT; }

// Dispatcher ops, so that torch.compile sees one opaque call each (shape rules registered in panel_linear.py).
TORCH_LIBRARY_FRAGMENT(milestones, m) {
  m.def("panel_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_silu_mul(Tensor x, Tensor packed_gate_up, int intermediate) -> Tensor");
  m.def("panel_linear_bf16_pairs() -> bool", &panel_linear_bf16_pairs);
}

TORCH_LIBRARY_IMPL(milestones, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_silu_mul", &panel_silu_mul);
}
