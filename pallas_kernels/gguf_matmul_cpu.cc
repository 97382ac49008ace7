// x [rows, k] float32 times a GGUF block-quantized weight kept as jlight/core/gguf_weights.py describes, one
// output channel a row ([n, k]: blocks of 32 stored values, each with a scale d a block, or two (one a half
// of 16: Q6_K), and for Q4_1 / Q4_K / Q5_K a minimum m a block), in float32. d and m are float16 (Q4_0, Q4_1,
// Q5_0, Q8_0) or float32 (the K-quants), told apart by the scales' dtype. One row: y[c] = sum over the
// row's blocks of d * (x . values) + m * sum(x). Several rows: each block is dequantized once (d * values + m)
// and multiplied with every row, 8 rows (AVX-512) or 4 a pass over a chunk of output channels, so the weights
// come from memory once a call. Q4_0 comes as Q4_1 with m = -8 d.
// Built and loaded by cpu_ffi.py with the other CPU kernels (gguf_matmul_cpu.py is its Python side); XLA calls
// it through its FFI with its intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define JLIGHT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JLIGHT_AVX512 1  // a block is two 16-lane vectors instead of four 8-lane ones
#endif
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;      // weights a block
constexpr int64_t kChunkRows = 32;  // output channels a worker claims at a time
#ifdef JLIGHT_AVX512
constexpr int64_t kRowGroup = 8;  // x rows one pass over a chunk's weights serves (two sums a row in registers)
#else
constexpr int64_t kRowGroup = 4;
#endif

float HalfToFloat(uint16_t h) {
#ifdef JLIGHT_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalize the mantissa
    int shift = 0;
    uint32_t m = man;
    while (!(m & 0x400u)) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ffu) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A scale or minimum as float: float16 (its bits) or float32.
float ScaleToFloat(uint16_t h) { return HalfToFloat(h); }
float ScaleToFloat(float f) { return f; }

#ifdef JLIGHT_AVX512
// The first `lanes` of 16 scales or minimums as floats (the others 0): float16 bits converted, or float32.
__m512 Load16(const uint16_t* h, __mmask16 lanes) {
  return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(static_cast<__mmask32>(lanes), h)));
}
__m512 Load16(const float* f, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, f); }
#endif

// A block's 32 stored values (before d and m) in weight order.
struct Q4 {  // 16 bytes: weight i in the low nibble of byte i, weight 16 + i in its high nibble
  static constexpr int64_t kBytes = 16;
  static void Values(const uint8_t* q, float* out) {
    for (int i = 0; i < 16; ++i) {
      out[i] = float(q[i] & 0xf);
      out[i + 16] = float(q[i] >> 4);
    }
  }
#ifdef JLIGHT_AVX2
  static void Values(const uint8_t* q, __m256* w) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0xf);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
#endif
#ifdef JLIGHT_AVX512
  static void Values(const uint8_t* q, __m512* w) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0xf);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  }
#endif
};

struct Q8 {  // 32 signed bytes
  static constexpr int64_t kBytes = 32;
  static void Values(const uint8_t* q, float* out) {
    for (int i = 0; i < 32; ++i) out[i] = float(static_cast<int8_t>(q[i]));
  }
#ifdef JLIGHT_AVX2
  static void Values(const uint8_t* q, __m256* w) {
    for (int g = 0; g < 4; ++g) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * g));
      w[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
  }
#endif
#ifdef JLIGHT_AVX512
  static void Values(const uint8_t* q, __m512* w) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  }
#endif
};

struct Job {
  const float* x;                 // [rows, k]
  const uint8_t* q;               // [n, k / 32 * kBytes]
  const void* d;                  // [n, k / 32 * scales a block] float16 or float32
  const void* m;                  // [n, k / 32] as d, or null (no minimum)
  float* y;                       // [rows, n]
  std::unique_ptr<float[]> xsum;  // [rows, k / 32]: each block's sum of x (the m term)
  int64_t rows, k, n, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

#ifdef JLIGHT_AVX2
float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// Output channels [c0, c1) for the G x rows from r0; S: the scales' type (uint16_t: float16 bits, or float),
// kSub: scales a block of 32 (1, or 2: one a half).
template <typename Q, typename S, int kSub, int G>
void RowGroup(const Job& j, int64_t r0, int64_t c0, int64_t c1) {
  const int64_t blocks = j.k / kBlock;
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* q = j.q + c * blocks * Q::kBytes;
    const S* d = static_cast<const S*>(j.d) + c * blocks * kSub;
    const S* m = j.m ? static_cast<const S*>(j.m) + c * blocks : nullptr;
    float mterm[G] = {};
#if defined(JLIGHT_AVX512)
    if constexpr (G == 1 && kSub == 1) {
      // One row: d * (x . values) a block, the m term from the block sums of x (xsum): no dequantizing fma.
      // Sixteen blocks' scales (and minimums) become floats in one conversion, the m term is a vector dot of
      // the minimums with xsum, and even and odd blocks add into two sums, so no block waits on the last.
      __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, macc = _mm512_setzero_ps();
      alignas(64) float ds[16];
      const float* xs = j.xsum.get() + r0 * blocks;
      int64_t b = 0;
      for (; b < blocks; b += 16) {
        const int64_t count = std::min<int64_t>(16, blocks - b);
        const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
        _mm512_store_ps(ds, Load16(d + b, lanes));
        if (m) macc = _mm512_fmadd_ps(Load16(m + b, lanes), _mm512_maskz_loadu_ps(lanes, xs + b), macc);
        for (int64_t i = 0; i < count; ++i) {
          __m512 w[2];
          Q::Values(q + (b + i) * Q::kBytes, w);
          const float* xr = j.x + r0 * j.k + (b + i) * kBlock;
          const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w[1], _mm512_mul_ps(_mm512_loadu_ps(xr), w[0]));
          acc[i & 1] = _mm512_fmadd_ps(_mm512_set1_ps(ds[i]), t, acc[i & 1]);
        }
      }
      j.y[r0 * j.n + c] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), macc));
    } else {
      // Several rows, or a scale a half: the block dequantized once (d * values + m), then two fmas a row.
      __m512 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m512 w[2];
        Q::Values(q + b * Q::kBytes, w);
        const __m512 vm = _mm512_set1_ps(m ? ScaleToFloat(m[b]) : 0.0f);
        for (int i = 0; i < 2; ++i) w[i] = _mm512_fmadd_ps(_mm512_set1_ps(ScaleToFloat(d[b * kSub + i * kSub / 2])), w[i], vm);
        for (int g = 0; g < G; ++g) {
          const float* xr = j.x + (r0 + g) * j.k + b * kBlock;
          acc[g][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w[0], acc[g][0]);
          acc[g][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w[1], acc[g][1]);
        }
      }
      for (int g = 0; g < G; ++g) j.y[(r0 + g) * j.n + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]));
    }
#elif defined(JLIGHT_AVX2)
    if constexpr (G == 1 && kSub == 1) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m256 w[4];
        Q::Values(q + b * Q::kBytes, w);
        const float* xr = j.x + r0 * j.k + b * kBlock;
        // Two independent partial sums, so consecutive fmas do not wait on each other.
        __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(xr), w[0]);
        __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(xr + 8), w[1]);
        t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], t0);
        t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], t1);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ScaleToFloat(d[b])), _mm256_add_ps(t0, t1), acc);
        if (m) mterm[0] += ScaleToFloat(m[b]) * j.xsum[r0 * blocks + b];
      }
      j.y[r0 * j.n + c] = HorizontalSum(acc) + mterm[0];
    } else {
      __m256 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m256 w[4];
        Q::Values(q + b * Q::kBytes, w);
        const __m256 vm = _mm256_set1_ps(m ? ScaleToFloat(m[b]) : 0.0f);
        for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_set1_ps(ScaleToFloat(d[b * kSub + i * kSub / 4])), w[i], vm);
        for (int g = 0; g < G; ++g) {
          const float* xr = j.x + (r0 + g) * j.k + b * kBlock;
          acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], acc[g][1]);
          acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], acc[g][1]);
        }
      }
      for (int g = 0; g < G; ++g) j.y[(r0 + g) * j.n + c] = HorizontalSum(_mm256_add_ps(acc[g][0], acc[g][1]));
    }
#else
    constexpr int64_t kPart = kBlock / kSub;  // the values a scale covers
    float acc[G] = {};
    float w[kBlock];
    for (int64_t b = 0; b < blocks; ++b) {
      Q::Values(q + b * Q::kBytes, w);
      const float mb = m ? ScaleToFloat(m[b]) : 0.0f;
      for (int g = 0; g < G; ++g) {
        const float* xr = j.x + (r0 + g) * j.k + b * kBlock;
        for (int s = 0; s < kSub; ++s) {
          float dot = 0.0f;
          for (int64_t i = s * kPart; i < (s + 1) * kPart; ++i) dot += xr[i] * w[i];
          acc[g] += ScaleToFloat(d[b * kSub + s]) * dot;
        }
        mterm[g] += mb * j.xsum[(r0 + g) * blocks + b];
      }
    }
    for (int g = 0; g < G; ++g) j.y[(r0 + g) * j.n + c] = acc[g] + mterm[g];
#endif
  }
}

template <typename Q, typename S, int kSub>
void RunChunk(const Job& j, int64_t chunk) {
  const int64_t c0 = chunk * kChunkRows, c1 = std::min(j.n, c0 + kChunkRows);
  int64_t r = 0;
  for (; r + kRowGroup <= j.rows; r += kRowGroup) RowGroup<Q, S, kSub, kRowGroup>(j, r, c0, c1);
  switch (j.rows - r) {
    case 7: RowGroup<Q, S, kSub, 7>(j, r, c0, c1); break;
    case 6: RowGroup<Q, S, kSub, 6>(j, r, c0, c1); break;
    case 5: RowGroup<Q, S, kSub, 5>(j, r, c0, c1); break;
    case 4: RowGroup<Q, S, kSub, 4>(j, r, c0, c1); break;
    case 3: RowGroup<Q, S, kSub, 3>(j, r, c0, c1); break;
    case 2: RowGroup<Q, S, kSub, 2>(j, r, c0, c1); break;
    case 1: RowGroup<Q, S, kSub, 1>(j, r, c0, c1); break;
    default: break;
  }
}

template <typename Q, typename S, int kSub>
void Work(Job& j) {
  for (int64_t chunk; (chunk = j.next.fetch_add(1, std::memory_order_relaxed)) < j.chunks;) {
    RunChunk<Q, S, kSub>(j, chunk);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

// The shapes checked (Dispatch).
template <typename Q, typename S, int kSub>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& q, ffi::AnyBuffer& d,
               ffi::AnyBuffer* m, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->q = static_cast<const uint8_t*>(q.untyped_data());
  job->d = d.untyped_data();
  job->m = m ? m->untyped_data() : nullptr;
  job->y = y->typed_data();
  job->rows = x.dimensions()[0];
  job->k = x.dimensions()[1];
  job->n = q.dimensions()[0];
  job->chunks = (job->n + kChunkRows - 1) / kChunkRows;
  const int64_t sums = job->rows * (job->k / kBlock);
  job->xsum.reset(new float[sums]);
  for (int64_t s = 0; s < sums; ++s) {
    float total = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) total += job->x[s * kBlock + i];
    job->xsum[s] = total;
  }
  // Workers claim chunks from one counter. A helper the pool starts after the caller has claimed every
  // chunk finds none and returns, and the caller waits only for chunks already claimed, never for a task
  // the pool has not started: no deadlock when the pool is busy or has one thread.
  const int64_t helpers = std::min(std::max<int64_t>(1, pool.num_threads()), job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { Work<Q, S, kSub>(*job); });
  Work<Q, S, kSub>(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
#ifdef JLIGHT_AVX2
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

// Checks the shapes and runs the instance for the scales' dtype and count: float16 a block (Q4_0, Q4_1, Q5_0,
// Q8_0), float32 a block (Q4_K, Q5_K), float32 two a block without minimums (Q6_K, as Q8).
template <typename Q>
ffi::Error Dispatch(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& q, ffi::AnyBuffer& d,
                    ffi::AnyBuffer* m, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), dd = d.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || dd.size() != 2 || xd[1] % kBlock != 0 || qd[0] != dd[0] ||
      qd[1] != xd[1] / kBlock * Q::kBytes) {
    return ffi::Error::InvalidArgument(
        "jlight's GGUF matmul takes x [rows, k], blocks [n, k / 32 * block bytes] and scales [n, k / 32 * scales a block]");
  }
  const int64_t blocks = xd[1] / kBlock;
  if (m && (m->dimensions().size() != 2 || m->dimensions()[0] != dd[0] || m->dimensions()[1] != blocks ||
            m->element_type() != d.element_type())) {
    return ffi::Error::InvalidArgument("jlight's GGUF matmul takes minimums [n, k / 32] of its scales' dtype");
  }
  const ffi::DataType type = d.element_type();
  if (type == ffi::DataType::F16 && dd[1] == blocks) return Run<Q, uint16_t, 1>(pool, x, q, d, m, y);
  if (type == ffi::DataType::F32 && dd[1] == blocks) return Run<Q, float, 1>(pool, x, q, d, m, y);
  if constexpr (std::is_same_v<Q, Q8>) {
    if (type == ffi::DataType::F32 && dd[1] == 2 * blocks && !m) return Run<Q, float, 2>(pool, x, q, d, m, y);
  }
  return ffi::Error::InvalidArgument(
      "jlight's GGUF matmul takes float16 scales a block of 32, or float32 ones a block of 32 (or of 16 for Q8 "
      "values without minimums)");
}

ffi::Error Q4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                    ffi::AnyBuffer m, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Dispatch<Q4>(pool, x, q, d, &m, y);
}

ffi::Error Q8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                    ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Dispatch<Q8>(pool, x, q, d, nullptr, y);
}

ffi::Error Q8MinMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                       ffi::AnyBuffer m, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Dispatch<Q8>(pool, x, q, d, &m, y);
}

// The matmuls with minimums (Q4, Q8 with minimums): x, values, scales, minimums -> y.
auto BindWithMinimums() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlightGgufQ4Matmul, Q4Matmul, BindWithMinimums());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlightGgufQ8MinMatmul, Q8MinMatmul, BindWithMinimums());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlightGgufQ8Matmul, Q8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
