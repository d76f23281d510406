// Decode attention over a paged KV cache, read where it lies (CPU). Built on first use by
// moeflow/model/extension.py; the Python oracle is gathered_decode_attention in paged_attention.py.
//
// One query token per request attends to its context_lens[b] cached keys, found through its block
// table: slot = block_tables[b][pos / block_size] * block_size + pos % block_size. A work item is
// (request, kv head): the G = Hq / Hkv query heads of a group share every key and value row, so
// each row comes from memory once. Keys go by in tiles of TILE tokens under an online softmax
// (running max m, sum l, unnormalized output acc), accumulated in float32 whatever the storage.
// Legend: B requests, Hq / Hkv query / kv heads, Dk / Dv key / value dims, N cache slots.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

// NOTE: GCC vector extensions, not intrinsics: one source for every x86 level -march=native picks
// (8 floats = one AVX2 register, two SSE ones) and for other architectures.
constexpr int64_t W = 8;      // floats per vector
constexpr int64_t TILE = 16;  // keys per online-softmax step: two vectors of scores per head
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
inline float hsum(vf v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
inline int64_t round_up(int64_t n) { return (n + W - 1) / W * W; }

// exp(x) for x <= 0: Cephes' expf polynomial (about 1 ulp); x below -87 (exp underflows) is clamped.
inline vf vexp(vf x) {
  x = x < -87.f ? splat(-87.f) : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);  // truncates toward zero: step down to floor for negatives
  n += (__builtin_convertvector(n, vf) > fx);  // a true comparison is -1
  vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln2, ln2 split in two for precision
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  vi e = (n + 127) << 23;  // 2^n
  vf pow2n;
  std::memcpy(&pow2n, &e, sizeof pow2n);
  return y * pow2n;
}

// One row of n values as float32, zero-padded to np (a multiple of W); float rows of a whole
// number of vectors are read in place.
inline void to_float(const float* src, float* dst, int64_t n, int64_t np) {
  std::memcpy(dst, src, n * sizeof(float));
  std::fill(dst + n, dst + np, 0.f);
}
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n, int64_t np) {
  int64_t d = 0;
  for (; d + W <= n; d += W) {  // bf16 is the top half of a float32
    vh h;
    std::memcpy(&h, src + d, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    std::memcpy(dst + d, &u, sizeof u);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + n, dst + np, 0.f);
}
inline void to_float(const c10::Half* src, float* dst, int64_t n, int64_t np) {
  // NOTE: scalar conversion: float16 caches are rare on CPU (no native compute here)
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + n, dst + np, 0.f);
}
template <typename T>
inline const float* row(const T* src, float* buf, int64_t n, int64_t np) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == np) return src;
  }
  to_float(src, buf, n, np);
  return buf;
}

template <typename T>
struct Problem {
  const T* k;  // [N, Hkv, Dk] strided
  const T* v;  // [N, Hkv, Dv] strided
  int64_t k_token, k_head, v_token, v_head;  // strides, in elements
  bool v_in_k;  // v is the first Dv columns of k's rows (MLA's latent): convert each row once
  const float* q;  // [B, Hq, Dk] float32, contiguous
  const int32_t* tables;  // [B, table_stride]
  int64_t table_stride;
  const int32_t* lens;  // [B]
  int64_t block_size, hq, hkv, group, dk, dv, dkp, dvp;
  float scale;
  float* out;  // [B, Hq, Dv] float32, contiguous
};

// Per-thread scratch, all float32: the group's scaled queries, accumulators, converted rows, a zero
// row (what the rows of a tile past the context point at), scores, running max and sum.
struct Scratch {
  std::vector<float> q, acc, k, v, zero, s, m, l;
  Scratch(int64_t g, int64_t dkp, int64_t dvp)
      : q(g * dkp), acc(g * dvp), k(TILE * dkp), v(TILE * dvp), zero(std::max(dkp, dvp)), s(g * TILE), m(g), l(g) {}
};

// Eight vectors -> the vector of their eight horizontal sums (a transposing tree of pairwise adds).
inline vf hsum8(const vf* a) {
  auto hadd = [](vf x, vf y) {  // [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7], as vhaddps
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  vf t0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // sums of a0..a3: low halves, then high halves
  vf t1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// s[g * TILE + j] = q_g . k_j: eight keys at a time, eight independent accumulators (an FMA's
// latency is four cycles; one accumulator would stall on it).
inline void scores(const float* q, const float* const* kr, int64_t group, int64_t dp, float* s) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dp;
    for (int64_t j0 = 0; j0 < TILE; j0 += 8) {
      vf a[8] = {};
      for (int64_t d = 0; d < dp; d += W) {
        const vf qv = load(qg + d);
        for (int t = 0; t < 8; ++t) a[t] += qv * load(kr[j0 + t] + d);
      }
      store(s + g * TILE + j0, hsum8(a));
    }
  }
}

// acc[h] += sum_j p[h * TILE + j] * v_j over HB heads and CB vectors of the value dim from d:
// HB * CB accumulators stay in registers through the tile.
template <int HB, int CB>
inline void accumulate_block(const float* p, const float* const* vr, int64_t d, int64_t dp, float* acc) {
  vf a[HB][CB];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) a[h][c] = load(acc + h * dp + d + c * W);
  for (int64_t j = 0; j < TILE; ++j) {
    vf v[CB];
    for (int c = 0; c < CB; ++c) v[c] = load(vr[j] + d + c * W);
    for (int h = 0; h < HB; ++h) {
      const vf ph = splat(p[h * TILE + j]);
      for (int c = 0; c < CB; ++c) a[h][c] += ph * v[c];
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) store(acc + h * dp + d + c * W, a[h][c]);
}

template <int HB>
inline void accumulate_heads(const float* p, const float* const* vr, int64_t dp, float* acc) {
  constexpr int CB = 8 / HB;  // eight accumulators
  int64_t d = 0;
  for (; d + CB * W <= dp; d += CB * W) accumulate_block<HB, CB>(p, vr, d, dp, acc);
  for (; d < dp; d += W) accumulate_block<HB, 1>(p, vr, d, dp, acc);
}

inline void accumulate(const float* p, const float* const* vr, int64_t group, int64_t dp, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= group; g += 4) accumulate_heads<4>(p + g * TILE, vr, dp, acc + g * dp);
  for (; g + 2 <= group; g += 2) accumulate_heads<2>(p + g * TILE, vr, dp, acc + g * dp);
  for (; g < group; ++g) accumulate_heads<1>(p + g * TILE, vr, dp, acc + g * dp);
}

// A tile's scores (keys past the context: n..TILE) -> probabilities under the running max; l and
// acc are rescaled when the max grows.
inline void online_softmax(float* s, int64_t n, int64_t group, int64_t dvp, float* m, float* l, float* acc) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * TILE;
    std::fill(sg + n, sg + TILE, kNegInf);
    const vf s0 = load(sg), s1 = load(sg + W);
    const vf mv = s0 > s1 ? s0 : s1;
    float mx = mv[0];
    for (int i = 1; i < W; ++i) mx = std::max(mx, mv[i]);
    const float m_new = std::max(m[g], mx);
    const float alpha = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
    const vf p0 = s0 == kNegInf ? splat(0.f) : vexp(s0 - m_new);
    const vf p1 = s1 == kNegInf ? splat(0.f) : vexp(s1 - m_new);
    store(sg, p0);
    store(sg + W, p1);
    l[g] = l[g] * alpha + hsum(p0 + p1);
    if (alpha != 1.f) {
      float* a = acc + g * dvp;
      for (int64_t d = 0; d < dvp; d += W) store(a + d, load(a + d) * alpha);
    }
    m[g] = m_new;
  }
}

// Cache slots of positions t0 .. t0 + n of one request (one division per tile, not per key).
inline void tile_slots(const int32_t* table, int64_t block_size, int64_t t0, int64_t n, int64_t* slots) {
  int64_t blk = t0 / block_size, off = t0 % block_size;
  int64_t base = static_cast<int64_t>(table[blk]) * block_size;
  for (int64_t j = 0; j < n; ++j) {
    slots[j] = base + off;
    if (++off == block_size && j + 1 < n) {
      off = 0;
      base = static_cast<int64_t>(table[++blk]) * block_size;
    }
  }
}

// NOTE: blocks are scattered, so the hardware prefetcher loses the stream at every block edge:
// ask for the next tile's rows while this one computes.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* slots, int64_t n, int64_t token_stride, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const char* r = reinterpret_cast<const char*>(base + slots[j] * token_stride);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(r + o);
  }
}

template <typename T>
void attend(const Problem<T>& P, int64_t b, int64_t h, Scratch& S) {
  const int64_t group = P.group, dkp = P.dkp, dvp = P.dvp, len = P.lens[b];
  const float* q = P.q + (b * P.hq + h * group) * P.dk;
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < P.dk; ++d) S.q[g * dkp + d] = q[g * P.dk + d] * P.scale;
    std::fill(S.q.begin() + g * dkp + P.dk, S.q.begin() + (g + 1) * dkp, 0.f);
  }
  std::fill(S.acc.begin(), S.acc.end(), 0.f);
  std::fill(S.m.begin(), S.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(S.l.begin(), S.l.end(), 0.f);
  const int32_t* table = P.tables + b * P.table_stride;
  const T* kh = P.k + h * P.k_head;
  const T* vh = P.v + h * P.v_head;
  const float* kr[TILE];
  const float* vr[TILE];
  int64_t slots[TILE], next[TILE];
  if (len > 0) tile_slots(table, P.block_size, 0, std::min(TILE, len), next);
  for (int64_t t0 = 0; t0 < len; t0 += TILE) {
    const int64_t n = std::min(TILE, len - t0);
    std::copy(next, next + n, slots);
    if (t0 + TILE < len) {
      const int64_t n_next = std::min(TILE, len - t0 - TILE);
      tile_slots(table, P.block_size, t0 + TILE, n_next, next);
      prefetch_rows(kh, next, n_next, P.k_token, P.dk);
      if (!P.v_in_k) prefetch_rows(vh, next, n_next, P.v_token, P.dv);
    }
    for (int64_t j = 0; j < TILE; ++j) {
      if (j >= n) {
        kr[j] = vr[j] = S.zero.data();
        continue;
      }
      kr[j] = row(kh + slots[j] * P.k_token, S.k.data() + j * dkp, P.dk, dkp);
      vr[j] = P.v_in_k ? kr[j] : row(vh + slots[j] * P.v_token, S.v.data() + j * dvp, P.dv, dvp);
    }
    scores(S.q.data(), kr, group, dkp, S.s.data());
    online_softmax(S.s.data(), n, group, dvp, S.m.data(), S.l.data(), S.acc.data());
    accumulate(S.s.data(), vr, group, dvp, S.acc.data());
  }
  float* out = P.out + (b * P.hq + h * group) * P.dv;
  for (int64_t g = 0; g < group; ++g) {
    const float inv = len > 0 ? 1.f / S.l[g] : 0.f;  // an empty context attends to nothing: zeros
    for (int64_t d = 0; d < P.dv; ++d) out[g * P.dv + d] = S.acc[g * dvp + d] * inv;
  }
}

template <typename T>
void run(const Problem<T>& P, int64_t num_requests) {
  // longest contexts first, handed out one item at a time: mixed lengths still balance
  std::vector<int64_t> order(num_requests);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return P.lens[a] > P.lens[b]; });
  const int64_t items = num_requests * P.hkv;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    Scratch S(P.group, P.dkp, P.dvp);
    for (int64_t i; (i = next.fetch_add(1)) < items;) attend(P, order[i / P.hkv], i % P.hkv, S);
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "paged_decode_attention: q [B, Hq, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv]; got dims ", q.dim(), ", ",
              k.dim(), ", ", v.dim());
  const int64_t B = q.size(0), hq = q.size(1), dk = q.size(2), N = k.size(0), hkv = k.size(1), dv = v.size(2);
  TORCH_CHECK(k.size(2) == dk, "paged_decode_attention: q has Dk ", dk, ", k has ", k.size(2));
  TORCH_CHECK(v.size(0) == N && v.size(1) == hkv, "paged_decode_attention: k and v must share [N, Hkv]");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "paged_decode_attention: Hq (", hq, ") must be a multiple of Hkv (", hkv, ")");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "paged_decode_attention: k and v dtypes differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "paged_decode_attention: k and v need a contiguous last dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.stride(1) == 1,
              "paged_decode_attention: block_tables must be [B, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B && context_lens.is_contiguous(),
              "paged_decode_attention: context_lens must be a contiguous [B]");
  TORCH_CHECK(block_size > 0, "paged_decode_attention: block_size must be positive");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b) {  // a bad id would read outside the cache: check every one used
    TORCH_CHECK(lens[b] >= 0 && (lens[b] + block_size - 1) / block_size <= max_blocks, "paged_decode_attention: request ",
                b, " has ", lens[b], " keys, more than its ", max_blocks, " blocks of ", block_size, " hold");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(id >= 0 && (id + 1) * block_size <= N, "paged_decode_attention: request ", b, " names block ",
                  id, ", outside the cache's ", N / block_size, " blocks");
    }
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, hq, dv}, q.options().dtype(at::kFloat));
  const bool v_in_k = v.data_ptr() == k.data_ptr() && v.stride(0) == k.stride(0) && v.stride(1) == k.stride(1) &&
                      dv <= dk;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P{k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), v_in_k,
                 qf.data_ptr<float>(), tables, block_tables.stride(0), lens, block_size, hq, hkv, hq / hkv, dk, dv,
                 round_up(dk), round_up(dv), static_cast<float>(scale), out.data_ptr<float>()};
    run(P, B);
  };
  switch (k.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: the cache must be float32, bfloat16 or float16, not ",
                         k.scalar_type());
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moeflow, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(moeflow, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
