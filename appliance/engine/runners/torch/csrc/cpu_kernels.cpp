// The torch runner's CPU kernels: decode attention, and the small per-row operations around a
// layer's matmuls (RMSNorm, RoPE, SwiGLU). Every one computes a row on its own, in a fixed order
// of arithmetic, so a row's result never depends on the rows beside it or on the thread count:
// the runner's exactness properties (a verify equals its steps; a prompt row's result whatever
// chunk it sits in) by construction. probe.check_exact and cache.invariance still prove them.
//
// Decode attention (`attend`): each query row attends over exactly its own keys, 0 .. its
// position, in fixed 256-key blocks (flash-decoding).
//
// Layout: q [T, H, E] float32, row t at position start + t; k, v: one slot of one layer,
// [G, n_ctx, E] (positions contiguous, E contiguous), bfloat16 or float32; query head h reads
// KV head h / (H / G). Result [T, H * E] float32.
//
// Per work item (row t, KV head g, key block b), for the H/G query heads sharing the KV head:
// scores against the block's keys (per key, 16-lane products summed over E's chunks, the lanes
// then added in a fixed tree), their max, exp (a vectorisable Cephes polynomial), their sum and
// the exp-weighted sum of V rows. A row's blocks are then combined in block order:
// M = max m_b, S = sum s_b e^(m_b - M), O = sum o_b e^(m_b - M) / S.
//
// Measured on a 2-core Zen 5 (AVX-512), 9 query heads on 3 KV heads of 64, bfloat16 KV, one
// row: 15 µs at 511 keys and 188 µs at 8,000 on 2 threads; the first version (one key at a
// time, each key's lanes summed alone, a single FMA chain) took 4.5x that.
//
// It includes the few ATen and pybind headers it uses, not <torch/extension.h> (all of torch's
// C++ API): the first build takes ~10 s instead of ~26 s on 2 cores, parsing headers included.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int64_t BLOCK = 256;

// GCC/Clang vector extensions: 16 floats, compiled to AVX-512, 2 x AVX2 or 4 x SSE as the
// target allows (the same arithmetic, in the same order, on a given build).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline vf load(const uint16_t* p) {   // bfloat16: the high half of a float32
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline float hsum(vf x) {   // a fixed tree: lanes l and l + w added, w = 8, 4, 2, 1
  float a[LANES];
  store(a, x);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
}

// 16 vectors -> one: lane l holds the sum of acc[l]'s lanes (a fixed tree, see block_item)
inline vf hsum16(const vf* acc) {
  vf t[8], u[4], v[2];
  for (int m = 0; m < 8; ++m)
    t[m] = __builtin_shufflevector(acc[m], acc[m + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(acc[m], acc[m + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m)
    u[m] = __builtin_shufflevector(t[m], t[m + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(t[m], t[m + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)
    v[m] = __builtin_shufflevector(u[m], u[m + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(u[m], u[m + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// e^x for x <= 0 (softmax arguments after the max is subtracted): Cephes' expf, branch-free
inline vf exp_nonpos(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vf t = x * 1.44269504088896341f + 12582912.0f;   // adding 1.5 * 2^23 rounds to an integer
  const vf n = t - 12582912.0f;
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const vf z = r * r;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * reinterpret_cast<vf>(bits);
}
inline float exp_nonpos(float x) {
  float a[LANES];
  store(a, exp_nonpos(splat(x)));
  return a[0];
}

// One (row, KV head, key block) item: partial max m[i], sum s[i] and unnormalised output o[i][E]
// for the `per` (at most 16) query heads i sharing this KV head. E is a multiple of 16, at most
// 256. Keys past j1 are never read: the last group of 16 repeats key j0 + j in its unused lanes
// and those lanes' scores are dropped.
template <typename KT>
void block_item(const float* q, int64_t per, int64_t e_dim, const KT* k, const KT* v, int64_t j0, int64_t j1,
                float* m, float* s, float* o) {
  const int64_t n = j1 - j0, chunks = e_dim / LANES;
  float scores[16 * BLOCK + LANES];   // per <= 16
  vf qv[16 * 16], ov[16 * 16], row[16];
  for (int64_t i = 0; i < per; ++i)
    for (int64_t c = 0; c < chunks; ++c) qv[i * chunks + c] = load(q + i * e_dim + c * LANES);
  // scores, 16 keys at a time: each key's products summed over E's 16-wide chunks, then the 16
  // keys' lanes summed in one tree of shuffles (hsum16), key l's sum landing in lane l; a key's
  // sum is the same arithmetic whichever keys share its 16
  vf keys[LANES][16];
  for (int64_t j = 0; j < n; j += LANES) {
    const int64_t w = std::min<int64_t>(LANES, n - j);
    for (int64_t l = 0; l < LANES; ++l) {
      const KT* kr = k + (j0 + j + (l < w ? l : 0)) * e_dim;
      for (int64_t c = 0; c < chunks; ++c) keys[l][c] = load(kr + c * LANES);
    }
    for (int64_t i = 0; i < per; ++i) {
      const vf* qi = qv + i * chunks;
      vf acc[LANES];
      for (int l = 0; l < LANES; ++l) {
        vf x = qi[0] * keys[l][0];
        for (int64_t c = 1; c < chunks; ++c) x += qi[c] * keys[l][c];
        acc[l] = x;
      }
      store(scores + i * BLOCK + j, hsum16(acc));
    }
  }
  for (int64_t i = 0; i < per; ++i) {
    float* sc = scores + i * BLOCK;
    float mx = sc[0];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, sc[j]);
    for (int64_t j = n; j < (n + LANES - 1) / LANES * LANES; ++j) sc[j] = 0.0f;   // lanes past the block's keys: finite, and zeroed below
    vf acc{};
    for (int64_t j = 0; j < n; j += LANES) {
      vf p = exp_nonpos(load(sc + j) - mx);
      for (int l = 0; l < LANES; ++l)
        if (j + l >= n) p[l] = 0.0f;
      store(sc + j, p);
      acc += p;
    }
    m[i] = mx;
    s[i] = hsum(acc);
    for (int64_t c = 0; c < chunks; ++c) ov[i * chunks + c] = vf{};
  }
  for (int64_t j = 0; j < n; ++j) {
    const KT* vr = v + (j0 + j) * e_dim;
    for (int64_t c = 0; c < chunks; ++c) row[c] = load(vr + c * LANES);
    for (int64_t i = 0; i < per; ++i) {
      const vf p = splat(scores[i * BLOCK + j]);
      for (int64_t c = 0; c < chunks; ++c) ov[i * chunks + c] += p * row[c];
    }
  }
  for (int64_t i = 0; i < per; ++i)
    for (int64_t c = 0; c < chunks; ++c) store(o + i * e_dim + c * LANES, ov[i * chunks + c]);
}

template <typename KT>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start, double scale, at::Tensor& out) {
  // q [T, H, E], heads and E contiguous; its rows may be strided (Q inside a row of Q, K, V)
  const int64_t t_rows = q.size(0), h = q.size(1), e_dim = q.size(2), g = k.size(0);
  const int64_t per = h / g, head_stride = k.stride(0), q_stride = q.stride(0);
  const float* qp = q.data_ptr<float>();
  const KT* kp = reinterpret_cast<const KT*>(k.data_ptr());
  const KT* vp = reinterpret_cast<const KT*>(v.data_ptr());
  float* op = out.data_ptr<float>();
  // the items: every (row, KV head, key block), rows in order
  std::vector<int64_t> first(t_rows + 1, 0);
  for (int64_t t = 0; t < t_rows; ++t) first[t + 1] = first[t] + g * ((start + t) / BLOCK + 1);
  const int64_t n_items = first[t_rows], part = per * (e_dim + 2);
  std::vector<float> parts(n_items * part);
  std::vector<float> qs(t_rows * h * e_dim);
  for (int64_t t = 0; t < t_rows; ++t)
    for (int64_t x = 0; x < h * e_dim; ++x) qs[t * h * e_dim + x] = static_cast<float>(qp[t * q_stride + x] * static_cast<float>(scale));
  at::parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t t = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t nb = (start + t) / BLOCK + 1, local = it - first[t], gi = local / nb, b = local % nb;
      const int64_t j0 = b * BLOCK, j1 = std::min((b + 1) * BLOCK, start + t + 1);
      float* pp = parts.data() + it * part;
      block_item<KT>(qs.data() + (t * h + gi * per) * e_dim, per, e_dim, kp + gi * head_stride,
                     vp + gi * head_stride, j0, j1, pp, pp + per, pp + 2 * per);
    }
  });
  at::parallel_for(0, t_rows * g, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t t = x / g, gi = x % g, nb = (start + t) / BLOCK + 1;
      const float* base = parts.data() + (first[t] + gi * nb) * part;
      for (int64_t i = 0; i < per; ++i) {
        float mx = base[i];
        for (int64_t b = 1; b < nb; ++b) mx = std::max(mx, base[b * part + i]);
        float total = 0.0f;
        float* dst = op + (t * h + gi * per + i) * e_dim;
        std::fill(dst, dst + e_dim, 0.0f);
        for (int64_t b = 0; b < nb; ++b) {
          const float* pb = base + b * part;
          const float w = exp_nonpos(pb[i] - mx);
          total += pb[per + i] * w;
          const float* ob = pb + 2 * per + i * e_dim;
          for (int64_t e = 0; e < e_dim; ++e) dst[e] += ob[e] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t e = 0; e < e_dim; ++e) dst[e] *= inv;
      }
    }
  });
}

}  // namespace

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "attend: q must be [T, H, E] float32, heads and E contiguous");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.strides() == v.strides(), "attend: k and v must be [G, L, E] alike");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
              "attend: k and v must be bfloat16 or float32");
  const int64_t t_rows = q.size(0), h = q.size(1), e_dim = q.size(2), g = k.size(0);
  TORCH_CHECK(k.size(2) == e_dim && k.stride(2) == 1 && k.stride(1) == e_dim, "attend: k's positions must be contiguous rows of E");
  TORCH_CHECK(g > 0 && h % g == 0, "attend: query heads must be a multiple of KV heads");
  TORCH_CHECK(e_dim % LANES == 0 && e_dim <= 256, "attend: the head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(h / g <= 16, "attend: at most 16 query heads per KV head");
  TORCH_CHECK(start >= 0 && start + t_rows <= k.size(1), "attend: rows past the KV given");
  at::Tensor out = at::empty({t_rows, h * e_dim}, q.options());
  if (t_rows == 0) return out;
  if (k.scalar_type() == at::kBFloat16) run<uint16_t>(q, k, v, start, scale, out);
  else run<float>(q, k, v, start, scale, out);
  return out;
}


// ---- the rest of a layer's small operations, row by row ---------------------------------------
// Each row's arithmetic is fixed (lanes over 16-wide chunks, a fixed tree, then a scalar tail),
// so a row's result never depends on the rows beside it or on the thread count, in a decode
// step or a prompt chunk alike. One call replaces torch's several ops and their dispatch.

namespace {

inline uint16_t to_bf16(float f) {   // round to nearest even, as torch's conversion; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]); }

template <typename OT>
void rms_rows(const float* x, int64_t x_stride, const float* w, int64_t c_dim, float eps, OT* out, int64_t lo, int64_t hi) {
  std::vector<float> y(c_dim);
  const int64_t body = c_dim / LANES * LANES;
  for (int64_t r = lo; r < hi; ++r) {
    const float* xr = x + r * x_stride;
    vf acc{};
    for (int64_t c = 0; c < body; c += LANES) { const vf a = load(xr + c); acc += a * a; }
    float ss = hsum(acc);
    for (int64_t c = body; c < c_dim; ++c) ss += xr[c] * xr[c];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(c_dim) + eps);
    for (int64_t c = 0; c < body; c += LANES) store(y.data() + c, load(xr + c) * scale * load(w + c));
    for (int64_t c = body; c < c_dim; ++c) y[c] = xr[c] * scale * w[c];
    store_row(out + r * c_dim, y.data(), c_dim);
  }
}


// ---- the int4 matmul: y = x W^T, W as 4-bit codes with a scale and a zero per 32 of a row ------
// W's rows are packed in tiles of 16 (qlinear.pack_tiles): for each group of 32 inputs, 256
// bytes holding the 16 rows' codes as bfloat16 pairs want them, (row n, input 2p + t) at word
// 2n + t of pair p's vector, pairs 2j and 2j + 1 in the low and high nibbles of 32 bytes; then
// the group's 16 scales and 16 zeros (bfloat16, as torch's int4 kernel keeps them). A code q
// widens to the bfloat16 128 + q by one bitwise op ((x & 15) | 0x4300), and one dot-product
// instruction (vdpbf16ps) takes a pair of inputs for all 16 rows at once, the lanes being the
// rows: no sums across lanes. Per group, with s the scale, z the zero and A the 32 inputs:
//   sum_k ((q_k - 8) s + z) A_k = s sum_k (128 + q_k) A_k + (z - 136 s) sum_k A_k
// in float32 (products of bfloat16 values are exact). Each output is computed alone, in one
// order whatever the rows in the call or the threads: a k-row verify gives each row its
// one-row step's bits, and a prompt row its bits in any chunk. Measured against torch's
// _weight_int4pack_mm_for_cpu on this model's shapes (2 threads): about half its time at 1 row
// and at 512.
//
// Wider codes (Q5_0/Q5_1/Q5_K: 5 bits, Q6_K: 6 bits) take HB more bits per code from a second
// plane, HB * 64 bytes a group: chunk c of 32 bytes holds pair vector c * (8 / HB) + i in bits
// [i HB, (i + 1) HB) of each byte; they widen into bits 4.. of the same bfloat16 (128 + q is
// exact up to q = 127). With G16 (Q6_K's scales are per 16 weights) a group has two halves,
// pairs 0-7 and 8-15, each with its own 16 scales and zeros: 64 bfloat16 a group (s, z of the
// first half, then of the second) and the input sums per 16.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool INT4_NATIVE = true;
constexpr int INT4_ROWS = 8;   // input rows served by one dequantized group before the next rows

inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <int HB>
inline void widen_high(const uint8_t* h, __m512i* w) {
  if constexpr (HB > 0) {
    constexpr int per = 8 / HB;
    const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(((1 << HB) - 1) << 4));
    for (int c = 0; c < 2 * HB; ++c) {
      const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32 * c)));
      for (int i = 0; i < per; ++i) {
        const int shift = 4 - i * HB;
        const __m512i moved = shift >= 0 ? _mm512_slli_epi16(x, shift) : _mm512_srli_epi16(x, -shift);
        w[c * per + i] = _mm512_ternarylogic_epi32(moved, mask, w[c * per + i], 0xEA);   // (moved & mask) | w
      }
    }
  }
}

inline __m512 pair_dots(const __m512i* w, const int32_t* ar, int p0, int p1) {
  __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
  for (int p = p0; p < p1; p += 4) {
    d0 = _mm512_dpbf16_ps(d0, (__m512bh)w[p], (__m512bh)_mm512_set1_epi32(ar[p]));
    d1 = _mm512_dpbf16_ps(d1, (__m512bh)w[p + 1], (__m512bh)_mm512_set1_epi32(ar[p + 1]));
    d2 = _mm512_dpbf16_ps(d2, (__m512bh)w[p + 2], (__m512bh)_mm512_set1_epi32(ar[p + 2]));
    d3 = _mm512_dpbf16_ps(d3, (__m512bh)w[p + 3], (__m512bh)_mm512_set1_epi32(ar[p + 3]));
  }
  return _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3));
}

template <int HB, bool G16>
void int4_tile(const uint16_t* a, int64_t k, int64_t m0, int64_t nr, const uint8_t* pk, const uint8_t* hi,
               const uint16_t* sz, const float* sa, int64_t groups, float* y, int64_t n, int64_t col0) {
  const __m512i low = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  constexpr int SZ = G16 ? 64 : 32, HALVES = G16 ? 2 : 1;
  __m512 acc[INT4_ROWS];
  for (int r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = pk + g * 256;
    __m512i w[16];
    for (int j = 0; j < 8; ++j) {
      const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j)));
      w[2 * j] = _mm512_ternarylogic_epi32(x, low, magic, 0xEA);                          // (x & 15) | 0x4300
      w[2 * j + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 4), low, magic, 0xEA);
    }
    widen_high<HB>(hi + g * 64 * HB, w);
    const __m512 s = bf16x16(sz + g * SZ), z = bf16x16(sz + g * SZ + 16);
    const __m512 off = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), s, z);
    if constexpr (!G16) {
      for (int r = 0; r < nr; ++r) {
        const int32_t* ar = reinterpret_cast<const int32_t*>(a + (m0 + r) * k + g * 32);   // the inputs in pairs
        acc[r] = _mm512_fmadd_ps(pair_dots(w, ar, 0, 16), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(sa[(m0 + r) * groups + g]), acc[r]);
      }
    } else {
      const __m512 s2 = bf16x16(sz + g * SZ + 32), z2 = bf16x16(sz + g * SZ + 48);
      const __m512 off2 = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), s2, z2);
      for (int r = 0; r < nr; ++r) {
        const int32_t* ar = reinterpret_cast<const int32_t*>(a + (m0 + r) * k + g * 32);
        const float* sums = sa + (m0 + r) * groups * HALVES + g * HALVES;
        acc[r] = _mm512_fmadd_ps(pair_dots(w, ar, 0, 8), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(sums[0]), acc[r]);
        acc[r] = _mm512_fmadd_ps(pair_dots(w, ar, 8, 16), s2, acc[r]);
        acc[r] = _mm512_fmadd_ps(off2, _mm512_set1_ps(sums[1]), acc[r]);
      }
    }
  }
  for (int r = 0; r < nr; ++r) _mm512_storeu_ps(y + (m0 + r) * n + col0, acc[r]);
}

// each row's sum of each group of `width` (32 or 16) inputs, in a fixed order
void group_sums(const uint16_t* a, int64_t m, int64_t k, int64_t width, float* out) {
  const int64_t groups = k / width;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 v = width == 32 ? _mm512_add_ps(bf16x16(a + r * k + g * 32), bf16x16(a + r * k + g * 32 + 16))
                                   : bf16x16(a + r * k + g * 16);
      vf x;
      std::memcpy(&x, &v, sizeof x);
      out[r * groups + g] = hsum(x);
    }
}
#else
// elsewhere, the same arithmetic one value at a time: correct and row-invariant, but slow, so
// the runner multiplies with torch's int4 kernel there (int4_native() is false); it lets the
// tests check the layout and the formula on any CPU
constexpr bool INT4_NATIVE = false;
constexpr int INT4_ROWS = 8;

inline float bf16_value(uint16_t h) { const uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }

template <int HB, bool G16>
void int4_tile(const uint16_t* a, int64_t k, int64_t m0, int64_t nr, const uint8_t* pk, const uint8_t* hi,
               const uint16_t* sz, const float* sa, int64_t groups, float* y, int64_t n, int64_t col0) {
  constexpr int SZ = G16 ? 64 : 32, HALVES = G16 ? 2 : 1;
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < 16; ++c) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = pk + g * 256;
        float dot[2] = {0.0f, 0.0f};
        for (int p = 0; p < 16; ++p)      // pair p: its byte holds the codes of pairs 2j and 2j + 1
          for (int t = 0; t < 2; ++t) {
            const uint8_t byte = b[32 * (p / 2) + 2 * c + t];
            int q = p % 2 ? byte >> 4 : byte & 15;
            if (HB > 0) {
              const int per = HB > 0 ? 8 / HB : 1;
              const uint8_t hb = hi[g * 64 * HB + 32 * (p / per) + 2 * c + t];
              q |= ((hb >> ((p % per) * HB)) & ((1 << HB) - 1)) << 4;
            }
            dot[G16 && p >= 8] += (128.0f + static_cast<float>(q)) * bf16_value(a[(m0 + r) * k + g * 32 + 2 * p + t]);
          }
        for (int h = 0; h < HALVES; ++h) {
          const float s = bf16_value(sz[g * SZ + 32 * h + c]), z = bf16_value(sz[g * SZ + 32 * h + 16 + c]);
          acc = std::fma(dot[h], s, acc);
          acc = std::fma(std::fma(-136.0f, s, z), sa[(m0 + r) * groups * HALVES + g * HALVES + h], acc);
        }
      }
      y[(m0 + r) * n + col0 + c] = acc;
    }
}

void group_sums(const uint16_t* a, int64_t m, int64_t k, int64_t width, float* out) {
  const int64_t groups = k / width;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      if (width == 32) {
        vf lo = load(a + r * k + g * 32), hi = load(a + r * k + g * 32 + 16);
        out[r * groups + g] = hsum(lo + hi);
      } else {
        out[r * groups + g] = hsum(load(a + r * k + g * 16));
      }
    }
}
#endif

}  // namespace

// x [N, C] float32 (rows may be strided, C contiguous), w [C] float32 -> x / rms(x) * w, [N, C]
// float32 or bfloat16 (the next matmul's operand)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rms_norm: x must be [N, C] float32 on the CPU, C contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: w must be [C] float32");
  const int64_t n = x.size(0), c_dim = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({n, c_dim}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    if (bf16) rms_rows(xp, stride, wp, c_dim, static_cast<float>(eps), reinterpret_cast<uint16_t*>(out.data_ptr()), lo, hi);
    else rms_rows(xp, stride, wp, c_dim, static_cast<float>(eps), out.data_ptr<float>(), lo, hi);
  });
  return out;
}

// RoPE in place: x [N, heads, E] float32 (E contiguous), rot [N, dim / 2, 2] float32 (cos, sin
// of each pair's angle); the first `dim` of each head rotated, pairs adjacent (x0, x1) or, with
// neox, half the rotated part apart (x0, x_{dim/2}). (a, b) -> (a cos - b sin, a sin + b cos).
void rope_(at::Tensor& x, const at::Tensor& rot, int64_t dim, bool neox) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "rope_: x must be [N, heads, E] float32 on the CPU, E contiguous");
  TORCH_CHECK(rot.scalar_type() == at::kFloat && rot.is_contiguous() && rot.numel() == x.size(0) * dim,
              "rope_: rot must be [N, dim / 2, 2] float32, contiguous");
  TORCH_CHECK(dim % 2 == 0 && dim <= x.size(2), "rope_: the rotated part must be even and within the head");
  const int64_t n = x.size(0), heads = x.size(1), half = dim / 2, s0 = x.stride(0), s1 = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* rp = rot.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* cs = rp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* p = xp + r * s0 + h * s1;
        for (int64_t i = 0; i < half; ++i) {
          float* a = neox ? p + i : p + 2 * i;
          float* b = neox ? p + i + half : p + 2 * i + 1;
          const float c = cs[2 * i], s = cs[2 * i + 1], av = *a, bv = *b;
          *a = av * c - bv * s;
          *b = av * s + bv * c;
        }
      }
    }
  });
}

// SwiGLU: gu [N, 2F] float32 (gate then up, as one stacked matmul gives them) -> silu(gate) * up,
// [N, F] float32 or bfloat16 (the down matmul's operand). silu(g) = g / (1 + e^-g), from e^-|g|
// (never overflows)
at::Tensor swiglu(const at::Tensor& gu, bool bf16) {
  TORCH_CHECK(gu.device().is_cpu() && gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "swiglu: gu must be [N, 2F] float32 on the CPU, contiguous");
  const int64_t n = gu.size(0), f = gu.size(1) / 2, body = f / LANES * LANES;
  at::Tensor out = at::empty({n, f}, gu.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* gp = gu.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> y(f);
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = gp + r * 2 * f;
      const float* u = g + f;
      for (int64_t c = 0; c < body; c += LANES) {
        const vf gv = load(g + c), neg = gv < 0.0f ? gv : -gv;
        const vf t = exp_nonpos(neg);            // e^-|g|
        const vf sig = (gv < 0.0f ? t : splat(1.0f)) / (1.0f + t);
        store(y.data() + c, gv * sig * load(u + c));
      }
      for (int64_t c = body; c < f; ++c) {
        const float t = exp_nonpos(-std::fabs(g[c]));
        y[c] = g[c] * ((g[c] < 0.0f ? t : 1.0f) / (1.0f + t)) * u[c];
      }
      if (bf16) store_row(reinterpret_cast<uint16_t*>(out.data_ptr()) + r * f, y.data(), f);
      else store_row(out.data_ptr<float>() + r * f, y.data(), f);
    }
  });
  return out;
}

// A short span's whole attention after the QKV matmul, in one call: RoPE on its Q and K rows
// (in place, `rope_`), K and V stored into the slot at start .. start + T (rounded to the pool's
// dtype as torch's copy rounds), then `attend`, out in float32 or bfloat16 (the output
// matmul's operand). qkv [T, H + 2G, E] float32, contiguous; rot [T, dim / 2, 2]; k, v the
// slot's [G, n_ctx, E]. The same arithmetic as those steps taken one by one.
at::Tensor attend_span(at::Tensor& qkv, const at::Tensor& rot, int64_t rope_dim, bool neox, at::Tensor& k,
                       at::Tensor& v, int64_t start, double scale, int64_t h, bool bf16) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "attend_span: qkv must be [T, H + 2G, E] float32 on the CPU, contiguous");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
              k.scalar_type() == v.scalar_type(), "attend_span: k and v must be [G, n_ctx, E] alike");
  const int64_t t_rows = qkv.size(0), g = k.size(0), e_dim = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == h + 2 * g && k.size(2) == e_dim && k.stride(2) == 1 && k.stride(1) == e_dim,
              "attend_span: qkv's heads must be H query heads, then the pool's G K and G V heads");
  TORCH_CHECK(start >= 0 && start + t_rows <= k.size(1), "attend_span: rows past the KV given");
  const bool bf16_kv = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_kv || k.scalar_type() == at::kFloat, "attend_span: k and v must be bfloat16 or float32");
  at::Tensor qk = qkv.narrow(1, 0, h + g);
  rope_(qk, rot, rope_dim, neox);
  const float* src = qkv.data_ptr<float>();
  for (int64_t t = 0; t < t_rows; ++t)
    for (int64_t gi = 0; gi < g; ++gi)
      for (int which = 0; which < 2; ++which) {
        const float* row = src + (t * (h + 2 * g) + h + which * g + gi) * e_dim;
        const int64_t at = gi * k.stride(0) + (start + t) * e_dim;
        if (bf16_kv) store_row(reinterpret_cast<uint16_t*>((which ? v : k).data_ptr()) + at, row, e_dim);
        else store_row((which ? v : k).data_ptr<float>() + at, row, e_dim);
      }
  at::Tensor out = attend(qkv.narrow(1, 0, h), k, v, start, scale);
  return bf16 ? out.to(at::kBFloat16) : out;
}


// x [M, K] bfloat16 (contiguous), packed [N / 16, K / 32, 256] uint8, high [N / 16, K / 32, 64 hbits]
// uint8 (empty for hbits 0) and sz [N / 16, K / 32, 2 or 4 (group 16), 16] bfloat16 from
// qlinear.pack_tiles -> x W^T, [M, N] float32. Fast on AVX512-BF16 (int4_native()).
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& sz,
                        int64_t hbits, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 32 == 0,
              "int4_matmul: x must be [M, K] bfloat16 on the CPU, contiguous, K a multiple of 32");
  TORCH_CHECK((hbits == 0 || hbits == 1 || hbits == 2) && (group == 32 || group == 16),
              "int4_matmul: codes of 4, 5 or 6 bits in groups of 32 or 16");
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, tiles = packed.size(0), n = tiles * 16;
  const int64_t halves = group == 16 ? 2 : 1;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) == groups &&
              packed.size(2) == 256, "int4_matmul: packed must be [N / 16, K / 32, 256] uint8 for x's K");
  TORCH_CHECK(sz.dim() == 4 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.size(0) == tiles &&
              sz.size(1) == groups && sz.size(2) == 2 * halves && sz.size(3) == 16,
              "int4_matmul: sz must be [N / 16, K / 32, 2 (4 for groups of 16), 16] bfloat16");
  TORCH_CHECK(hbits == 0 || (high.dim() == 3 && high.scalar_type() == at::kByte && high.is_contiguous() &&
                             high.size(0) == tiles && high.size(1) == groups && high.size(2) == 64 * hbits),
              "int4_matmul: high must be [N / 16, K / 32, 64 * hbits] uint8");
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> sums(m * groups * halves);
  group_sums(xp, m, k, 32 / halves, sums.data());
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const uint8_t* hp = hbits ? high.data_ptr<uint8_t>() : nullptr;
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  float* yp = y.data_ptr<float>();
  auto tile = hbits == 0 ? (halves == 2 ? &int4_tile<0, true> : &int4_tile<0, false>)
            : hbits == 1 ? (halves == 2 ? &int4_tile<1, true> : &int4_tile<1, false>)
                         : (halves == 2 ? &int4_tile<2, true> : &int4_tile<2, false>);
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t m0 = 0; m0 < m; m0 += INT4_ROWS)
        tile(xp, k, m0, std::min<int64_t>(INT4_ROWS, m - m0), pk + t * groups * 256, hp ? hp + t * groups * 64 * hbits : nullptr,
             szp + t * groups * 32 * halves, sums.data(), groups, yp, n, t * 16);
  });
  return y;
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz) {
  return quant_matmul(x, packed, at::Tensor(), sz, 0, 32);
}

bool int4_native() { return INT4_NATIVE; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "exact per-row decode attention over one slot's KV (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm row by row (CPU), float32 or bfloat16 out");
  m.def("rope_", &rope_, "RoPE in place (CPU)");
  m.def("attend_span", &attend_span, "a short span's RoPE, KV store and attention in one call (CPU)");
  m.def("int4_matmul", &int4_matmul, "x W^T, W int4 in tiles of 16 rows (qlinear.pack_tiles), each output alone (CPU)");
  m.def("quant_matmul", &quant_matmul, "int4_matmul for codes of 5 or 6 bits (a second plane) and scales per 16 (CPU)");
  m.def("int4_native", &int4_native, "whether int4_matmul runs on AVX512-BF16 (else a slow portable loop)");
  m.def("swiglu", &swiglu, "silu(gate) * up row by row (CPU), float32 or bfloat16 out");
}
