// The sampler's rows on the CPU (kernels/sampling.py: sample_rows): checks, each row's rule (greedy,
// or p = softmax(l / T) cut by top-k, top-p and min-p, then one draw), the rows in one threaded loop,
// and the run-time choice of ISA. The passes over a row are sample_simd.h's (the scalar ones here).
//
// A row's kept set is found without sorting its vocabulary: one pass writes e = exp(l / T - max) and
// sums it (Z); then the tokens of the best band of e ([1/4, 1]) are gathered, and so on down band by
// band to every positive e, until the cut (rank < top_k, the mass before a token < top_p * Z,
// e >= min_p; the best token always) lies inside one: a band the cut lies past is kept whole, in
// any order, and only the cut's band is sorted and walked token by token. A row then draws once: an unseeded row by the inverse CDF of its kept mass at
// its uniform u, a seeded row by the exponential race argmax e / E over its own noise E (the stream
// earlier releases drew, so its tokens are theirs). Each row is computed alone: its token does not
// depend on its batch.
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "qgemm.h"
#include "sample.h"
#include "sample_rows.h"
#include "team.h"

namespace wsq {
namespace {

float s_row_max(const float* l, int64_t V, bool* nan) {
  float mx = -INFINITY;
  bool bad = false;
  for (int64_t i = 0; i < V; ++i) {
    bad |= l[i] != l[i];
    mx = l[i] > mx ? l[i] : mx;
  }
  *nan = bad;
  return mx;
}

int64_t s_first_eq(const float* l, int64_t V, float v) {
  for (int64_t i = 0; i < V; ++i)
    if (l[i] == v) return i;
  return V;
}

float s_exp_pass(const float* l, int64_t V, float T, float ms, float floor, float* e, float* chunk, int64_t chunk_len) {
  const float f = sample_floor(floor);
  float total = 0.0f;
  for (int64_t c0 = 0, c = 0; c0 < V; c0 += chunk_len, ++c) {
    float a = 0.0f, k = 0.0f;  // a chunk's sums, then the total of those: less rounding than one long sum
    for (int64_t i = c0; i < std::min(V, c0 + chunk_len); ++i) {
      const float d = l[i] / T - ms;
      e[i] = d >= kSampleMinExp ? std::exp(d) : 0.0f;
      a += e[i];
      k += e[i] >= f ? e[i] : 0.0f;
    }
    chunk[c] = k;
    total += a;
  }
  return total;
}

int64_t s_gather(const float* e, int64_t V, float lo, float hi, int32_t* idx) {
  const float lo1 = sample_floor(lo);
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i)
    if (e[i] >= lo1 && e[i] < hi) idx[n++] = int32_t(i);
  return n;
}

float s_race_max(const float* e, const float* E, int64_t V, float floor) {
  const float f = sample_floor(floor);
  float mx = -1.0f;
  for (int64_t i = 0; i < V; ++i) {
    const float r = e[i] >= f ? e[i] / E[i] : -1.0f;
    mx = r > mx ? r : mx;
  }
  return mx;
}

int64_t s_race_first(const float* e, const float* E, int64_t V, float floor, float v) {
  const float f = sample_floor(floor);
  for (int64_t i = 0; i < V; ++i)
    if (e[i] >= f && e[i] / E[i] == v) return i;
  return V;
}

constexpr int64_t kChunk = 1024;  // values whose kept mass one chunk sum holds (the inverse CDF's first level)
// the bands of e gathered in turn, best first: [1/4, 1], [1/16, 1/4), ... (0, 2^-24); only the band
// the cut lies in is sorted
constexpr float kBands[] = {0x1p-2f, 0x1p-4f, 0x1p-6f, 0x1p-8f, 0x1p-10f, 0x1p-12f, 0x1p-14f, 0x1p-17f, 0x1p-20f, 0x1p-24f, 0.0f};

struct RowSpec {
  float temp, top_p, min_p, u;
  int64_t top_k;      // <= 0 or >= V: no limit
  const float* noise;  // a seeded row's E [V], or null
};

struct Scratch {  // a thread's, kept from call to call: nothing allocated per row once grown
  std::vector<float> e, chunk;
  std::vector<int32_t> idx;
  std::vector<std::pair<float, int32_t>> band, sorted, kept;
  std::vector<int64_t> start, at;  // a band's groups' first places in `sorted`, and where each fills
};
thread_local Scratch scratch;

// an unseeded row over its whole vocabulary (no rank cut): the first i where the running kept mass
// passes u * M, found chunk by chunk
int64_t inverse_cdf(const float* e, const float* chunk, int64_t V, float floor, float u) {
  const int64_t nc = (V + kChunk - 1) / kChunk;
  const float f = sample_floor(floor);
  float mass = 0.0f;
  for (int64_t c = 0; c < nc; ++c) mass += chunk[c];
  const float t = u * mass;
  float acc = 0.0f;
  for (int64_t c = 0; c < nc; ++c) {
    if (acc + chunk[c] <= t) {
      acc += chunk[c];
      continue;
    }
    for (int64_t i = c * kChunk; i < std::min(V, (c + 1) * kChunk); ++i) {
      if (e[i] < f) continue;
      acc += e[i];
      if (acc > t) return i;
    }
  }
  for (int64_t i = V - 1; i > 0; --i)  // t rounded up to the whole mass: the last kept token
    if (e[i] >= f) return i;
  return 0;
}

// a float sum with Kahan's compensation: a long tail of small e added to a sum near Z would otherwise
// round the top-p cut by several ranks
struct Compensated {
  float sum = 0.0f, carry = 0.0f;
  void add(float v) {
    const float y = v - carry, t = sum + y;
    carry = (t - sum) - y;
    sum = t;
  }
};

// whether every token of a band (n tokens, mass `mass`, e >= lo) is kept after `kept` tokens of mass
// `cum`: then it needs no order (a draw reads the kept set in any order)
bool band_kept_whole(const RowSpec& p, bool by_k, size_t kept, int64_t n, float cum, float mass, float mass_cut,
                     float lo) {
  return (!by_k || int64_t(kept) + n <= p.top_k) && (p.top_p >= 1.0f || cum + mass < mass_cut * (1.0f - 1e-6f)) &&
         lo >= std::max(p.min_p, 0.0f) && kept > 0;
}

// the bits of a positive float's exponent and first four mantissa bits: 16 keys an octave, ordered as e
inline uint32_t fine_key(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b >> 19;
}

// Walk the band's tokens (s.band, any order) in rank order onto s.kept until the cut: the tokens are
// counting-sorted by fine_key (descending), a key's group kept whole where the cut lies past it, and
// only the cut's group sorted by (e descending, id ascending). Returns true at the cut.
bool walk_band(const RowSpec& p, bool by_k, float mass_cut, Scratch& s, Compensated& cum) {
  const float floor = std::max(p.min_p, 0.0f);
  auto& b = s.band;
  uint32_t top = 0, low = UINT32_MAX;
  for (const auto& [ev, id] : b) top = std::max(top, fine_key(ev)), low = std::min(low, fine_key(ev));
  s.start.assign(top - low + 2, 0);
  for (const auto& [ev, id] : b) ++s.start[top - fine_key(ev) + 1];
  for (size_t k = 1; k < s.start.size(); ++k) s.start[k] += s.start[k - 1];
  s.sorted.resize(b.size());
  s.at.assign(s.start.begin(), s.start.end() - 1);
  for (const auto& t : b) s.sorted[s.at[top - fine_key(t.first)]++] = t;
  for (size_t g = 0; g + 1 < s.start.size(); ++g) {
    auto first = s.sorted.begin() + s.start[g], last = s.sorted.begin() + s.start[g + 1];
    Compensated mass;
    float least = INFINITY;
    for (auto it = first; it != last; ++it) mass.add(it->first), least = std::min(least, it->first);
    if (!band_kept_whole(p, by_k, s.kept.size(), last - first, cum.sum, mass.sum, mass_cut, least)) {
      std::sort(first, last, [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      for (auto it = first; it != last; ++it) {
        const size_t r = s.kept.size();
        if (r > 0 && ((by_k && int64_t(r) >= p.top_k) || (p.top_p < 1.0f && cum.sum >= mass_cut) || it->first < floor))
          return true;
        s.kept.push_back(*it);
        cum.add(it->first);
      }
      continue;
    }
    for (auto it = first; it != last; ++it) s.kept.push_back(*it), cum.add(it->first);
  }
  return false;
}

// the kept set into s.kept (the bands and groups the cut lies past in any order, the cut's group by
// rank); returns its mass
float kept_by_rank(const SampleFns& f, const float* e, int64_t V, float Z, const RowSpec& p, Scratch& s) {
  const bool by_k = p.top_k > 0 && p.top_k < V;
  const float mass_cut = p.top_p * Z;
  s.kept.clear();
  s.idx.resize(V);
  Compensated cum;
  float hi = INFINITY;
  for (const float lo : kBands) {
    const int64_t n = f.gather(e, V, lo, hi, s.idx.data());
    hi = lo;
    s.band.resize(n);
    Compensated band;
    for (int64_t j = 0; j < n; ++j) s.band[j] = {e[s.idx[j]], s.idx[j]}, band.add(e[s.idx[j]]);
    if (band_kept_whole(p, by_k, s.kept.size(), n, cum.sum, band.sum, mass_cut, lo)) {
      for (const auto& t : s.band) s.kept.push_back(t), cum.add(t.first);
      continue;
    }
    if (n > 0 && walk_band(p, by_k, mass_cut, s, cum)) break;
  }
  return cum.sum;
}

int64_t draw_kept(const Scratch& s, float mass, const RowSpec& p) {
  if (p.noise != nullptr) {  // the race over the kept tokens; a tie goes to the lower id, as argmax
    int64_t best = s.kept[0].second;
    float top = -1.0f;
    for (const auto& [ev, id] : s.kept) {
      const float r = ev / p.noise[id];
      if (r > top || (r == top && id < best)) top = r, best = id;
    }
    return best;
  }
  const float t = p.u * mass;
  float acc = 0.0f;
  for (const auto& [ev, id] : s.kept) {
    acc += ev;
    if (acc > t) return id;
  }
  return s.kept.back().second;
}

int64_t sample_row(const SampleFns& f, const float* l, int64_t V, const RowSpec& p) {
  bool nan = false;
  const float mx = f.row_max(l, V, &nan);
  if (nan) {  // as torch.argmax: a NaN is the largest
    for (int64_t i = 0; i < V; ++i)
      if (l[i] != l[i]) return i;
  }
  if (!(p.temp > 0.0f) || !std::isfinite(mx)) return std::min(f.first_eq(l, V, mx), V - 1);
  Scratch& s = scratch;
  s.e.resize(V);
  s.chunk.resize((V + kChunk - 1) / kChunk);
  const float floor = std::max(p.min_p, 0.0f);
  const float Z = f.exp_pass(l, V, p.temp, mx / p.temp, floor, s.e.data(), s.chunk.data(), kChunk);
  if ((p.top_k > 0 && p.top_k < V) || p.top_p < 1.0f) return draw_kept(s, kept_by_rank(f, s.e.data(), V, Z, p, s), p);
  if (p.noise == nullptr) return inverse_cdf(s.e.data(), s.chunk.data(), V, floor, p.u);
  const float top = f.race_max(s.e.data(), p.noise, V, floor);
  return std::min(f.race_first(s.e.data(), p.noise, V, floor, top), V - 1);
}

SampleFns fns_for(int64_t isa) {
  __builtin_cpu_init();
  if (isa == kAvx512Vnni) {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                    __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
                "this CPU cannot run the requested kernel path");
    return sample_fns_avx512();
  }
  if (isa == kAvx2) {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
                "this CPU cannot run the requested kernel path");
    return sample_fns_avx2();
  }
  return sample_fns_scalar();
}

void check_vec(const torch::Tensor& t, int64_t n, torch::ScalarType type, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == type && t.is_cpu() && t.is_contiguous(), what,
              " must be a contiguous CPU vector of the rows' length and its dtype");
}

}  // namespace

SampleFns sample_fns_scalar() {
  return {s_row_max, s_first_eq, s_exp_pass, s_gather, s_race_max, s_race_first};
}

// logits [n, V] float32 (rows may be further apart than V: a padded vocabulary cut), per row its
// temperature (<= 0: greedy), top_k (int64, <= 0: none), top_p, min_p and uniform; noise [s, V]
// float32 and noise_row [n] int64 (-1: the row draws by its uniform) -> the token ids [n] int64.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temp, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor uniform, torch::Tensor noise, torch::Tensor noise_row,
                          int64_t isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_cpu() &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be a float32 CPU matrix [n, vocab] with contiguous rows");
  const int64_t n = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  check_vec(temp, n, torch::kFloat32, "temp");
  check_vec(top_k, n, torch::kInt64, "top_k");
  check_vec(top_p, n, torch::kFloat32, "top_p");
  check_vec(min_p, n, torch::kFloat32, "min_p");
  check_vec(uniform, n, torch::kFloat32, "uniform");
  check_vec(noise_row, n, torch::kInt64, "noise_row");
  TORCH_CHECK(noise.dim() == 2 && noise.size(1) == V && noise.scalar_type() == torch::kFloat32 && noise.is_cpu() &&
                  noise.is_contiguous(),
              "noise must be a contiguous float32 CPU matrix [seeded rows, vocab]");
  const int64_t* nr = noise_row.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(nr[i] >= -1 && nr[i] < noise.size(0), "noise_row out of range");
  const SampleFns f = fns_for(isa);
  auto out = torch::empty({n}, torch::kInt64);
  const float* lp = logits.data_ptr<float>();
  const float *tp = temp.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>(),
              *up = uniform.data_ptr<float>(), *np = noise.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const RowSpec p{tp[r], pp[r], mp[r], up[r], kp[r], nr[r] < 0 ? nullptr : np + nr[r] * V};
      op[r] = sample_row(f, lp + r * ld, V, p);
    }
  };
  if (n == 1) {
    rows(0, 1);
  } else {  // rows claimed one at a time by the team (team.h): a thread that lost its core costs its row only
    run_as_team([&] { parallel_for(0, n, 1, rows); });
  }
  return out;
}

void register_sampling(pybind11::module& m) {
  m.def("sample_rows", &sample_rows,
        "each row's token: greedy, or drawn from softmax(l / T) cut by top-k, top-p and min-p; see kernels/sampling.py",
        pybind11::arg("logits"), pybind11::arg("temp"), pybind11::arg("top_k"), pybind11::arg("top_p"),
        pybind11::arg("min_p"), pybind11::arg("uniform"), pybind11::arg("noise"), pybind11::arg("noise_row"),
        pybind11::arg("isa"), pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace wsq
