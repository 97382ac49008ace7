// Causal paged attention for the few tokens of a decode step on the CPU, float32: each token attends to its
// own row's K/V from position 0 to its own, read from the row's pages. Two passes a (token, KV head): the
// scores of the head's query group over every position, then their softmax times V. Tasks (token, KV head)
// are shared by the caller and XLA's intra-op threads. Built and loaded by cpu_ffi.py with the other CPU
// kernels; paged_attention_cpu.py is its Python side.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Job {
  const float* q;            // [tokens, heads, dim]
  const float* k;            // [layers, pages, page_size, kv_heads, dim]
  const float* v;
  const int32_t* token_row;  // [tokens]
  const int32_t* positions;  // [tokens]
  const int32_t* table;      // [rows, max_pages]
  float* out;                // [tokens, heads, dim]
  int64_t tokens, real_tokens, heads, kv_heads, dim, pages, page_size, max_pages, rows, layer;
  float scale;
  int64_t tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Token t, KV head h: the group's heads attend to positions 0..positions[t] of the token's row.
void Attend(const Job& j, int64_t t, int64_t h, std::vector<float>& scores) {
  const int64_t group = j.heads / j.kv_heads;
  float* out = j.out + (t * j.heads + h * group) * j.dim;
  std::memset(out, 0, group * j.dim * sizeof(float));
  const int64_t row = j.token_row[t];
  if (t >= j.real_tokens || row < 0 || row >= j.rows) return;
  const int64_t last = std::min<int64_t>(j.positions[t], j.max_pages * j.page_size - 1);
  if (last < 0) return;
  const int64_t length = last + 1;
  scores.assign(group * length, -std::numeric_limits<float>::infinity());
  const int32_t* table = j.table + row * j.max_pages;
  const float* q = j.q + (t * j.heads + h * group) * j.dim;
  const int64_t page_stride = j.page_size * j.kv_heads * j.dim, layer_offset = j.layer * j.pages * page_stride;
  auto vector_at = [&](const float* cache, int64_t pos) -> const float* {
    const int64_t page = table[pos / j.page_size];
    if (page < 0 || page >= j.pages) return nullptr;  // a padding entry: masked
    return cache + layer_offset + page * page_stride + ((pos % j.page_size) * j.kv_heads + h) * j.dim;
  };
  for (int64_t pos = 0; pos < length; ++pos) {
    const float* kv = vector_at(j.k, pos);
    if (kv == nullptr) continue;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * j.dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < j.dim; ++d) dot += qg[d] * kv[d];
      scores[g * length + pos] = dot * j.scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < length; ++pos) top = std::max(top, s[pos]);
    if (!std::isfinite(top)) continue;  // nothing to attend to: zeros, as the reference
    float total = 0.0f;
    for (int64_t pos = 0; pos < length; ++pos) {
      s[pos] = std::exp(s[pos] - top);
      total += s[pos];
    }
    const float inv = 1.0f / total;
    for (int64_t pos = 0; pos < length; ++pos) s[pos] *= inv;
  }
  for (int64_t pos = 0; pos < length; ++pos) {
    const float* kv = vector_at(j.v, pos);
    if (kv == nullptr) continue;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * length + pos];
      float* og = out + g * j.dim;
#pragma omp simd
      for (int64_t d = 0; d < j.dim; ++d) og[d] += p * kv[d];
    }
  }
}

void Work(Job& j) {
  std::vector<float> scores;
  for (int64_t task; (task = j.next.fetch_add(1, std::memory_order_relaxed)) < j.tasks;) {
    Attend(j, task / j.kv_heads, task % j.kv_heads, scores);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> token_row,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> query_start, float scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions();
  const bool same_kv = vd.size() == kd.size() && std::equal(vd.begin(), vd.end(), kd.begin());
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || kd[4] != qd[2] || qd[1] % kd[3] != 0 || !same_kv ||
      token_row.element_count() != qd[0] || positions.element_count() != qd[0] ||
      query_start.element_count() != td[0] + 1 || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "jlight's CPU paged attention takes q [tokens, heads, dim], K/V [layers, pages, page_size, kv_heads, dim], "
        "a layer, token rows and positions [tokens], a page table [rows, pages] and query starts [rows + 1]");
  }
  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->k = k.typed_data();
  job->v = v.typed_data();
  job->token_row = token_row.typed_data();
  job->positions = positions.typed_data();
  job->table = table.typed_data();
  job->out = out->typed_data();
  job->tokens = qd[0];
  job->heads = qd[1];
  job->dim = qd[2];
  job->pages = kd[1];
  job->page_size = kd[2];
  job->kv_heads = kd[3];
  job->rows = td[0];
  job->max_pages = td[1];
  job->layer = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  job->real_tokens = std::clamp<int64_t>(query_start.typed_data()[job->rows], 0, job->tokens);
  job->scale = scale;
  job->tasks = job->tokens * job->kv_heads;
  // As in gguf_matmul_cpu.cc: helpers that start late find no task; the caller waits only for claimed ones.
  const int64_t helpers = std::min(std::max<int64_t>(1, pool.num_threads()), job->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->tasks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlightPagedAttentionCpu, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
