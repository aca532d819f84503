// One decode step's attention read straight from kvbudget's quantized KV store (CPU).
//
// Built on first use by kvbudget.quantized_read (torch.utils.cpp_extension); see its docstring and
// docs/architecture.md "Decode attention". For each (batch row, KV head) the kernel walks the
// head's segments in slot order -- quantized ones (KIVI codes: keys per channel over key groups,
// values per token over channel groups) and full-precision ones (a tail, a byte budget's other
// tier, a shared document's store) -- dequantizing one entry at a time into a small fp32 buffer:
// no dequantized copy of the layer is ever written. Scores, softmax and the weighted sum of values
// are in fp32; one thread per (row, head), entries in order, so the result does not depend on how
// a head's entries are split into segments (a shared document's prefix gives the same bits as one
// store).
//
// A quantized segment, per row: key codes uint8 [m, D*BITS/8], key scale and minimum [g, D] (one
// row per key group), key group int16 or int32 [m], value codes uint8 [m, Dv*BITS/8], value scale
// and minimum [m, Dv/Gv]. A code c reads back as c * scale + minimum. Codes are packed 8/BITS a
// byte, the first in the lowest bits.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// One segment of one head, the batch row already applied to every pointer.
template <typename S>
struct Segment {
  int bits = 16;  // 16: full precision (keys/values below)
  int64_t m = 0;  // entries
  const uint8_t* key_codes = nullptr;
  const S* key_scale = nullptr;
  const S* key_min = nullptr;
  const int16_t* key_group16 = nullptr;
  const int32_t* key_group32 = nullptr;
  const uint8_t* value_codes = nullptr;
  const S* value_scale = nullptr;
  const S* value_min = nullptr;
  int value_groups = 1;
  const S* keys = nullptr;
  const S* values = nullptr;
};

// D (and Dv = D) fixed at compile time where it is 64 or 128; 0 reads it at run time.
template <int BITS, int DC, typename S>
void quantized_scores(const Segment<S>& seg, const float* __restrict__ q, int rows, int d_run,
                      float scale, float* __restrict__ scores, int64_t stride) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int d = DC ? DC : d_run;
  const int width = d / PER;
  std::vector<float> buffer(d);
  float* __restrict__ key = buffer.data();
  for (int64_t i = 0; i < seg.m; ++i) {
    const uint8_t* __restrict__ codes = seg.key_codes + i * width;
    const int64_t g = seg.key_group16 ? seg.key_group16[i] : seg.key_group32[i];
    const S* __restrict__ sc = seg.key_scale + g * d;
    const S* __restrict__ mn = seg.key_min + g * d;
#pragma omp simd
    for (int c = 0; c < width; ++c) {
      const int byte = codes[c];
      for (int k = 0; k < PER; ++k) {
        const int j = c * PER + k;
        key[j] = static_cast<float>((byte >> (BITS * k)) & MASK) * static_cast<float>(sc[j]) +
                 static_cast<float>(mn[j]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float* __restrict__ qr = q + r * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < d; ++c) dot += qr[c] * key[c];
      scores[r * stride + i] = dot * scale;
    }
  }
}

template <int BITS, int DC, typename S>
void quantized_values(const Segment<S>& seg, const float* __restrict__ p, int rows, int dv_run,
                      int64_t stride, float* __restrict__ acc) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int dv = DC ? DC : dv_run;
  const int groups = seg.value_groups;
  const int per_group = dv / groups, width = per_group / PER;
  std::vector<float> buffer(dv);
  float* __restrict__ value = buffer.data();
  for (int64_t i = 0; i < seg.m; ++i) {
    const uint8_t* __restrict__ codes = seg.value_codes + i * (dv / PER);
    for (int g = 0; g < groups; ++g) {
      const float sc = static_cast<float>(seg.value_scale[i * groups + g]);
      const float mn = static_cast<float>(seg.value_min[i * groups + g]);
      float* __restrict__ out = value + g * per_group;
      const uint8_t* __restrict__ in = codes + g * width;
#pragma omp simd
      for (int c = 0; c < width; ++c) {
        const int byte = in[c];
        for (int k = 0; k < PER; ++k)
          out[c * PER + k] = static_cast<float>((byte >> (BITS * k)) & MASK) * sc + mn;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float w = p[r * stride + i];
      float* __restrict__ ar = acc + r * dv;
#pragma omp simd
      for (int c = 0; c < dv; ++c) ar[c] += w * value[c];
    }
  }
}

template <typename S>
void full_scores(const Segment<S>& seg, const float* __restrict__ q, int rows, int d, float scale,
                 float* __restrict__ scores, int64_t stride) {
  for (int64_t i = 0; i < seg.m; ++i) {
    const S* __restrict__ key = seg.keys + i * d;
    for (int r = 0; r < rows; ++r) {
      const float* __restrict__ qr = q + r * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < d; ++c) dot += qr[c] * static_cast<float>(key[c]);
      scores[r * stride + i] = dot * scale;
    }
  }
}

template <typename S>
void full_values(const Segment<S>& seg, const float* __restrict__ p, int rows, int dv, int64_t stride,
                 float* __restrict__ acc) {
  for (int64_t i = 0; i < seg.m; ++i) {
    const S* __restrict__ value = seg.values + i * dv;
    for (int r = 0; r < rows; ++r) {
      const float w = p[r * stride + i];
      float* __restrict__ ar = acc + r * dv;
#pragma omp simd
      for (int c = 0; c < dv; ++c) ar[c] += w * static_cast<float>(value[c]);
    }
  }
}

template <int DC, typename S>
void segment_scores(const Segment<S>& seg, const float* q, int rows, int d, float scale, float* scores,
                    int64_t stride) {
  switch (seg.bits) {
    case 2: return quantized_scores<2, DC, S>(seg, q, rows, d, scale, scores, stride);
    case 4: return quantized_scores<4, DC, S>(seg, q, rows, d, scale, scores, stride);
    case 8: return quantized_scores<8, DC, S>(seg, q, rows, d, scale, scores, stride);
    default: return full_scores<S>(seg, q, rows, d, scale, scores, stride);
  }
}

template <int DC, typename S>
void segment_values(const Segment<S>& seg, const float* p, int rows, int dv, int64_t stride, float* acc) {
  switch (seg.bits) {
    case 2: return quantized_values<2, DC, S>(seg, p, rows, dv, stride, acc);
    case 4: return quantized_values<4, DC, S>(seg, p, rows, dv, stride, acc);
    case 8: return quantized_values<8, DC, S>(seg, p, rows, dv, stride, acc);
    default: return full_values<S>(seg, p, rows, dv, stride, acc);
  }
}

// softmax over each of `rows` rows of `n` scores, in place
void softmax_rows(float* scores, int rows, int64_t n) {
  for (int r = 0; r < rows; ++r) {
    float* __restrict__ s = scores + r * n;
    float top = -FLT_MAX;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      const float e = expf(s[i] - top);
      s[i] = e;
      total += e;
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

template <int DC, typename S>
void attend_one(const std::vector<Segment<S>>& segs, const float* q, int rows, int d, int dv, float scale,
                float* out) {
  int64_t n = 0;
  for (const auto& seg : segs) n += seg.m;
  std::vector<float> scores(static_cast<size_t>(rows) * n);
  int64_t offset = 0;
  for (const auto& seg : segs) {
    segment_scores<DC, S>(seg, q, rows, d, scale, scores.data() + offset, n);
    offset += seg.m;
  }
  softmax_rows(scores.data(), rows, n);
  std::vector<float> acc(static_cast<size_t>(rows) * dv, 0.f);
  offset = 0;
  for (const auto& seg : segs) {
    segment_values<DC, S>(seg, scores.data() + offset, rows, dv, n, acc.data());
    offset += seg.m;
  }
  std::copy(acc.begin(), acc.end(), out);
}

// The batch row `b` of one segment given as its tensors (2: keys, values [B, m, D]; 7: a
// quantized segment, see the file's head).
template <typename S>
Segment<S> segment_of(const std::vector<torch::Tensor>& t, int bits, int64_t b) {
  Segment<S> seg;
  seg.bits = bits;
  if (bits == 16) {
    seg.m = t[0].size(1);
    seg.keys = t[0].data_ptr<S>() + b * t[0].stride(0);
    seg.values = t[1].data_ptr<S>() + b * t[1].stride(0);
    return seg;
  }
  seg.m = t[0].size(1);
  seg.key_codes = t[0].data_ptr<uint8_t>() + b * t[0].stride(0);
  seg.key_scale = t[1].data_ptr<S>() + b * t[1].stride(0);
  seg.key_min = t[2].data_ptr<S>() + b * t[2].stride(0);
  if (t[3].scalar_type() == torch::kInt16)
    seg.key_group16 = t[3].data_ptr<int16_t>() + b * t[3].stride(0);
  else
    seg.key_group32 = t[3].data_ptr<int32_t>() + b * t[3].stride(0);
  seg.value_codes = t[4].data_ptr<uint8_t>() + b * t[4].stride(0);
  seg.value_scale = t[5].data_ptr<S>() + b * t[5].stride(0);
  seg.value_min = t[6].data_ptr<S>() + b * t[6].stride(0);
  seg.value_groups = static_cast<int>(t[5].size(2));
  return seg;
}

}  // namespace

// query: fp32 [B, H, R, D] (the R query heads that share KV head h, already contiguous);
// heads[h]: that head's segments in slot order, each a list of tensors (2 or 7, contiguous, the
// scales and full-precision entries in one dtype); bits[h][s]: 16 or 2/4/8.
// Returns fp32 [B, H, R, Dv].
torch::Tensor quantized_decode(const torch::Tensor& query,
                               const std::vector<std::vector<std::vector<torch::Tensor>>>& heads,
                               const std::vector<std::vector<int64_t>>& bits, int64_t dv, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: contiguous fp32");
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3);
  TORCH_CHECK(static_cast<int64_t>(heads.size()) == H, "one segment list per KV head");
  auto out = torch::empty({B, H, R, dv}, query.options());
  torch::ScalarType dtype = torch::kFloat32;
  for (const auto& head : heads)
    for (const auto& seg : head)
      if (seg.size() == 2) dtype = seg[0].scalar_type(); else dtype = seg[1].scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, dtype, "quantized_decode", [&] {
    at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t b = w / H, h = w % H;
        std::vector<Segment<scalar_t>> segs;
        for (size_t s = 0; s < heads[h].size(); ++s)
          segs.push_back(segment_of<scalar_t>(heads[h][s], static_cast<int>(bits[h][s]), b));
        const float* q = query.data_ptr<float>() + (b * H + h) * R * D;
        float* o = out.data_ptr<float>() + (b * H + h) * R * dv;
        if (D == 64 && dv == 64)
          attend_one<64, scalar_t>(segs, q, R, D, dv, static_cast<float>(scale), o);
        else if (D == 128 && dv == 128)
          attend_one<128, scalar_t>(segs, q, R, D, dv, static_cast<float>(scale), o);
        else
          attend_one<0, scalar_t>(segs, q, R, D, dv, static_cast<float>(scale), o);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_decode", &quantized_decode, "one decode step's attention over quantized KV segments");
}
