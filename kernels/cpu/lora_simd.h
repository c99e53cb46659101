// The LoRA tile (lora.h) written once for both vector ISAs: included by fvec_avx512.cpp and
// fvec_avx2.cpp after rows_simd.h (whose round_to / store_as it uses), with `struct FV`.
// T: the activations (float or uint16_t bf16 bits), W: the weights (the same two), MT: rows in
// the tile. Each row keeps its own accumulators and adds in the same order as a tile of one, so
// its bits never depend on its tile or batch; the tile shares each load of A and B between its
// rows (at 32 rows of rank 64 the pass was bound by reading A and B again for every row). Scalar
// tails (K or n not a multiple of L) use fmaf in the order the lanes would.
#pragma once

template <class T, class W, int MT>
WSQ_TARGET void lora_tile_t(const LoraPiece& p, const void* xv, void* yv, int64_t N, const int64_t* rows) {
  using VF = typename FV::VF;
  constexpr int L = FV::L;
  const W* A = static_cast<const W*>(p.a);
  const W* B = static_cast<const W*>(p.bt);
  const T* x[MT];
  T* y[MT];
  for (int i = 0; i < MT; ++i) {
    x[i] = static_cast<const T*>(xv) + rows[i] * p.K;
    y[i] = static_cast<T*>(yv) + rows[i] * N + p.offset;
  }
  float t[MT][kMaxLoraRank];
  const int K = p.K, kv = K - K % L;
  int j = 0;
  for (; j + 4 <= p.r; j += 4) {  // shrink: 4 rows of A per pass over the tile's x
    const W* a = A + int64_t(j) * K;
    VF s[MT][4];
    for (int i = 0; i < MT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = FV::zero();
    for (int k = 0; k < kv; k += L) {
      const VF a0 = FV::load(a + k), a1 = FV::load(a + K + k), a2 = FV::load(a + 2 * K + k),
               a3 = FV::load(a + 3 * K + k);
      for (int i = 0; i < MT; ++i) {
        const VF xk = FV::load(x[i] + k);
        s[i][0] = FV::fmadd(xk, a0, s[i][0]);
        s[i][1] = FV::fmadd(xk, a1, s[i][1]);
        s[i][2] = FV::fmadd(xk, a2, s[i][2]);
        s[i][3] = FV::fmadd(xk, a3, s[i][3]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      for (int q = 0; q < 4; ++q) {
        float r = FV::hsum(s[i][q]);
        for (int k = kv; k < K; ++k) r = std::fmaf(widen(x[i][k]), widen(a[q * K + k]), r);
        t[i][j + q] = r;
      }
    }
  }
  for (; j < p.r; ++j) {
    const W* a = A + int64_t(j) * K;
    VF s[MT];
    for (int i = 0; i < MT; ++i) s[i] = FV::zero();
    for (int k = 0; k < kv; k += L) {
      const VF ak = FV::load(a + k);
      for (int i = 0; i < MT; ++i) s[i] = FV::fmadd(FV::load(x[i] + k), ak, s[i]);
    }
    for (int i = 0; i < MT; ++i) {
      float r = FV::hsum(s[i]);
      for (int k = kv; k < K; ++k) r = std::fmaf(widen(x[i][k]), widen(a[k]), r);
      t[i][j] = r;
    }
  }
  const int n = p.n;
  int c = 0;
  for (; c + 2 * L <= n; c += 2 * L) {  // expand: two vectors of columns per pass over t
    VF u[MT][2];
    for (int i = 0; i < MT; ++i) u[i][0] = u[i][1] = FV::zero();
    for (int q = 0; q < p.r; ++q) {
      const W* b = B + int64_t(q) * n + c;
      const VF b0 = FV::load(b), b1 = FV::load(b + L);
      for (int i = 0; i < MT; ++i) {
        const VF tq = FV::set1(t[i][q]);
        u[i][0] = FV::fmadd(tq, b0, u[i][0]);
        u[i][1] = FV::fmadd(tq, b1, u[i][1]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      store_as(y[i] + c, round_to<T>(FV::add(FV::load(y[i] + c), u[i][0])));
      store_as(y[i] + c + L, round_to<T>(FV::add(FV::load(y[i] + c + L), u[i][1])));
    }
  }
  for (; c + L <= n; c += L) {
    VF u[MT];
    for (int i = 0; i < MT; ++i) u[i] = FV::zero();
    for (int q = 0; q < p.r; ++q) {
      const VF bq = FV::load(B + int64_t(q) * n + c);
      for (int i = 0; i < MT; ++i) u[i] = FV::fmadd(FV::set1(t[i][q]), bq, u[i]);
    }
    for (int i = 0; i < MT; ++i) store_as(y[i] + c, round_to<T>(FV::add(FV::load(y[i] + c), u[i])));
  }
  for (; c < n; ++c) {
    for (int i = 0; i < MT; ++i) {
      float u = 0.0f;
      for (int q = 0; q < p.r; ++q) u = std::fmaf(t[i][q], widen(B[int64_t(q) * n + c]), u);
      y[i][c] = narrow<T>(widen(y[i][c]) + u);
    }
  }
}

template <class T, class W>
inline LoraTileFn lora_tile_of(int rows) {
  switch (rows) {
    case 1:
      return lora_tile_t<T, W, 1>;
    case 2:
      return lora_tile_t<T, W, 2>;
    case 3:
      return lora_tile_t<T, W, 3>;
    default:
      return lora_tile_t<T, W, 4>;
  }
}

inline LoraTileFn lora_tile(bool x_bf16, bool w_bf16, int rows) {
  if (x_bf16) return w_bf16 ? lora_tile_of<uint16_t, uint16_t>(rows) : lora_tile_of<uint16_t, float>(rows);
  return w_bf16 ? lora_tile_of<float, uint16_t>(rows) : lora_tile_of<float, float>(rows);
}
