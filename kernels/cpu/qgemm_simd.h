// The vector kernels, written once for both vector ISAs. Included by qgemm_avx2.cpp and
// qgemm_avx512.cpp inside their own namespace, after they define WSQ_TARGET (the function
// attribute that enables the ISA) and `struct Vec`:
//   VI, VF, L       int32 / float vectors of L lanes (8: AVX2, 16: AVX-512); R = kRows / L
//   load(p)         L * 4 bytes: a unit's slice for L rows
//   bcast4(p)       4 quants of x in every lane
//   dot(acc, u, s)  acc += per lane, the sum of 4 (unsigned byte u) * (signed byte s)
//   dot2(acc, u1, s1, u2, s2)  two dots; u below 64, so AVX2 may add the int16 pairs first
//   dot_s           the same as dot with signed w (Q8_0)
//   lo4, hi4, or_, bits(h, shift, mask) = ((h >> shift) & mask) << 4 per byte,
//   shl16, shr16 (16-bit lanes, constant counts), and8(v, byte mask)
//   u8, s8, f16     L per-row scales (bytes, signed bytes, fp16) widened to lanes
//   pairs(u, s)    int16 lanes: u[2k] * s[2k] + u[2k+1] * s[2k+1] (vpmaddubsw); add16, madd16
//                  (int16 pairs times int16 pairs, summed into int32: vpmaddwd)
//   mxfp4(v)       nibbles (bytes 0 .. 15) -> kMxfp4Plus12's bytes; e8m0(p) L exponent bytes -> floats
//   scale16u/s(p)  L per-row scale bytes (unsigned / signed), each in both int16 halves of its lane
//   pair16u/s(a, b) two rows of L scale bytes, lane r = (a[r], b[r]) as int16; shl32
//   add, sub, mullo, set1 on VI; cvt, fmul, fadd, fsub, fset1, fzero, store on VF
// A unit holds 4 bytes of each of the 16 rows of a group: lane r = row r, and the same 4
// quants of x in every lane (a broadcast load) make one `vpdpbusd` of 16 rows' partial sums.
// The float part per block runs in the order of kernels/quant_ref.py (no FMA: the build
// has -ffp-contract=off), so results equal the reference's bits.
#pragma once

using VI = typename Vec::VI;
using VF = typename Vec::VF;
constexpr int L = Vec::L, R = kRows / Vec::L;

// Q8_0 where dot never saturates (VNNI): weights + 128 (the sign bit flipped) as the unsigned
// operand, so each x row takes one dot per unit instead of dot_s's sign moves; the 128 * sum(x)
// it adds is taken out with the block's sums of x, as Q4_0's 8 * sum(x). The same integers.
constexpr bool kQ8Offset = Vec::kQ8Offset;

// Q4_0, Q4_1, Q8_0 and MXFP4 (whose nibbles become their E2M1 values plus 12 by a byte shuffle)
template <int MT, int QT>
WSQ_TARGET void block32(const uint8_t* g, const Act& a, int m0, VF (*acc)[R]) {
  constexpr Off o = offsets(QT);
  constexpr int units = QT == Q8_0 ? 8 : 4;
  const int ahead = m0 == 0 ? prefetch_ahead : 0;  // the later tiles find the group in cache
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * o.bytes;
    if (ahead > 0)
      for (int off = 0; off < o.bytes; off += 64) __builtin_prefetch(blk + ahead + off, 0, 3);
    VI s[MT][R];
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < R; ++h) s[i][h] = Vec::zero();
    for (int v = 0; v < units; ++v) {
      VI lo[R], hi[R];
      for (int h = 0; h < R; ++h) {
        const VI w = Vec::load(blk + o.qs + v * kUnit + h * L * 4);
        lo[h] = QT == Q8_0 ? (kQ8Offset ? Vec::flip(w) : w) : QT == MXFP4 ? Vec::mxfp4(Vec::lo4(w)) : Vec::lo4(w);
        hi[h] = QT == Q8_0 ? w : QT == MXFP4 ? Vec::mxfp4(Vec::hi4(w)) : Vec::hi4(w);
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* x = a.qrow(m0 + i) + b * 32;
        const VI xl = Vec::bcast4(x + 4 * v);
        if (QT == Q8_0 && kQ8Offset) {
          for (int h = 0; h < R; ++h) s[i][h] = Vec::dot(s[i][h], lo[h], xl);
        } else if (QT == Q8_0) {
          for (int h = 0; h < R; ++h) s[i][h] = Vec::dot_s(s[i][h], lo[h], xl);
        } else {
          const VI xh = Vec::bcast4(x + 16 + 4 * v);
          for (int h = 0; h < R; ++h) s[i][h] = Vec::dot2(s[i][h], lo[h], xl, hi[h], xh);
        }
      }
    }
    for (int h = 0; h < R; ++h) {
      const VF dw = QT == MXFP4 ? Vec::e8m0(blk + o.d + h * L) : Vec::f16(blk + o.d + h * L * 2);
      const VF mw = QT == Q4_1 ? Vec::f16(blk + o.m + h * L * 2) : Vec::fzero();
      for (int i = 0; i < MT; ++i) {
        const VF dx = Vec::fset1(a.dx(m0 + i)[b]);
        const int32_t xsum = a.sums(m0 + i)[2 * b] + a.sums(m0 + i)[2 * b + 1];
        const VI si = QT == Q4_0               ? Vec::sub(s[i][h], Vec::set1(8 * xsum))
                      : QT == MXFP4             ? Vec::sub(s[i][h], Vec::set1(12 * xsum))
                      : QT == Q8_0 && kQ8Offset ? Vec::sub(s[i][h], Vec::set1(128 * xsum))
                                                : s[i][h];
        VF t = Vec::fmul(Vec::fmul(dw, dx), Vec::cvt(si));
        if (QT == Q4_1) t = Vec::fadd(t, Vec::fmul(Vec::fmul(mw, dx), Vec::fset1(float(xsum))));
        acc[i][h] = Vec::fadd(acc[i][h], t);
      }
    }
  }
}

// Q6_K on int16 pair sums: `pairs` (vpmaddubsw) gives int16 sums of 2 products, two units'
// of them add in int16 without overflowing, and one `madd16` (vpmaddwd) against the 16-group's
// scale in both int16 halves of every lane gives the int32 sc_j * dot_j at once: no int32 sum
// per group, no vpmulld, and few enough registers for 4 rows of x per weight vector. The
// integers are kernels/quant_ref.py's (exact, any order): so are the bits. The -32 of every
// quant is one madd16 per pair of groups against the x sums, the pair's two scales side by
// side in each lane. tile() runs the blocks kChunk at a time, each vector of rows in turn over
// them (the chunk stays in L1 for the next), prefetching prefetch_q6k bytes (the chunk after)
// ahead: on one core the stream's bandwidth needs requests in flight ahead of the loads. Batch 1
// has its own loop (block_q6k_1, below).
constexpr int kChunk = 4;

// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; pairs of sub-blocks share
// the bytes of qs (low nibbles: the first), Q5_K's fifth bits are bit j of qh for sub-block j.
// Both row vectors per unit and int32 sums per sub-block: the int16 form of Q6_K below measured
// no faster here cold and 1.2-1.5x slower with the weights in cache (AVX2, batch 1).
template <int MT, int QT>
WSQ_TARGET void block_k45(const uint8_t* g, const Act& a, int m0, VF (*acc)[R]) {
  constexpr Off o = offsets(QT);
  const int ahead = m0 == 0 ? prefetch_k45 : 0;  // as block32's
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * o.bytes;
    if (ahead > 0)  // the scales' lines here, each unit's line beside its load below (a burst of a
      for (int off = 0; off < o.qs; off += 64) __builtin_prefetch(blk + ahead + off, 0, 3);  // block stalls)
    VI isum[MT][R];
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < R; ++h) isum[i][h] = Vec::zero();
    for (int p = 0; p < 4; ++p) {
      VI s0[MT][R], s1[MT][R];
      for (int i = 0; i < MT; ++i)
        for (int h = 0; h < R; ++h) s0[i][h] = s1[i][h] = Vec::zero();
      for (int v = 0; v < 8; v += 2) {  // two units of the same sub-blocks per dot2
        if (ahead > 0) {
          __builtin_prefetch(blk + ahead + o.qs + (p * 8 + v) * kUnit, 0, 3);
          __builtin_prefetch(blk + ahead + o.qs + (p * 8 + v + 1) * kUnit, 0, 3);
          if (QT == Q5_K && p == 0) {
            __builtin_prefetch(blk + ahead + o.qh + v * kUnit, 0, 3);
            __builtin_prefetch(blk + ahead + o.qh + (v + 1) * kUnit, 0, 3);
          }
        }
        for (int h = 0; h < R; ++h) {
          const VI wa = Vec::load(blk + o.qs + (p * 8 + v) * kUnit + h * L * 4);
          const VI wb = Vec::load(blk + o.qs + (p * 8 + v + 1) * kUnit + h * L * 4);
          VI loa = Vec::lo4(wa), hia = Vec::hi4(wa), lob = Vec::lo4(wb), hib = Vec::hi4(wb);
          if (QT == Q5_K) {
            const VI qa = Vec::load(blk + o.qh + v * kUnit + h * L * 4);
            const VI qb = Vec::load(blk + o.qh + (v + 1) * kUnit + h * L * 4);
            loa = Vec::or_(loa, Vec::bits(qa, 2 * p, 1));
            hia = Vec::or_(hia, Vec::bits(qa, 2 * p + 1, 1));
            lob = Vec::or_(lob, Vec::bits(qb, 2 * p, 1));
            hib = Vec::or_(hib, Vec::bits(qb, 2 * p + 1, 1));
          }
          for (int i = 0; i < MT; ++i) {
            const int8_t* x = a.qrow(m0 + i) + b * 256 + p * 64 + 4 * v;
            s0[i][h] = Vec::dot2(s0[i][h], loa, Vec::bcast4(x), lob, Vec::bcast4(x + 4));
            s1[i][h] = Vec::dot2(s1[i][h], hia, Vec::bcast4(x + 32), hib, Vec::bcast4(x + 36));
          }
        }
      }
      for (int h = 0; h < R; ++h) {
        const VI sc0 = Vec::u8(blk + o.sc + (2 * p) * kRows + h * L);
        const VI sc1 = Vec::u8(blk + o.sc + (2 * p + 1) * kRows + h * L);
        for (int i = 0; i < MT; ++i)
          isum[i][h] = Vec::add(isum[i][h], Vec::add(Vec::mullo(sc0, s0[i][h]), Vec::mullo(sc1, s1[i][h])));
      }
    }
    for (int h = 0; h < R; ++h) {
      const VF dw = Vec::f16(blk + o.d + h * L * 2), dmin = Vec::f16(blk + o.m + h * L * 2);
      for (int i = 0; i < MT; ++i) {
        const int32_t* s16 = a.sums(m0 + i) + b * 16;
        VI msum = Vec::zero();
        for (int j = 0; j < 8; ++j)
          msum = Vec::add(msum, Vec::mullo(Vec::u8(blk + o.mn + j * kRows + h * L), Vec::set1(s16[2 * j] + s16[2 * j + 1])));
        const VF dx = Vec::fset1(a.dx(m0 + i)[b]);
        const VF t = Vec::fsub(Vec::fmul(Vec::fmul(dw, dx), Vec::cvt(isum[i][h])),
                               Vec::fmul(Vec::fmul(dmin, dx), Vec::cvt(msum)));
        acc[i][h] = Vec::fadd(acc[i][h], t);
      }
    }
  }
}

// Q6_K: 16 groups of 16 with int8 scales; 4 low bits from ql, 2 high bits from qh (see
// quant_formats.quant_values), unsigned 0..63 here and the -32 taken out with the sums of x.
// In half hf of a block, unit v of quarter t (t = 0..3: x values hf * 128 + t * 32 + 4 v ..)
// is the low (t < 2) or high nibbles of ql unit hf * 16 + v (+ 8 for odd t) and bits 2 t, 2 t + 1
// of qh unit hf * 8 + v; units 0..3 are 16-group hf * 8 + 2 t, units 4..7 the next one.
WSQ_TARGET inline VI six_bits(const uint8_t* blk, int hf, int t, int v, int h) {
  constexpr Off o = offsets(Q6_K);
  const VI l = Vec::load(blk + o.qs + (hf * 16 + v + (t & 1) * 8) * kUnit + h * L * 4);
  const VI q = Vec::load(blk + o.qh + (hf * 8 + v) * kUnit + h * L * 4);
  const VI hb = t == 0 ? Vec::shl16(q, 4) : t == 1 ? Vec::shl16(q, 2) : t == 2 ? q : Vec::shr16(q, 2);
  return Vec::or_(t < 2 ? Vec::lo4(l) : Vec::hi4(l), Vec::and8(hb, 0x30));
}

// One Q6_K block's value for x row m and row vector h, from the integer sum isum of its unsigned
// quants times x: the -32 of every quant taken out with the x sums (over the 16-groups, sc times
// the group's x sum, times 32), then times d * dx, in kernels/quant_ref.py's order.
WSQ_TARGET inline VF q6k_value(const uint8_t* blk, const Act& a, int m, int b, int h, VI isum) {
  constexpr Off o = offsets(Q6_K);
  const int32_t* xp = a.pairs(m) + b * 8;
  VI off = Vec::zero();
  for (int j = 0; j < 16; j += 2)
    off = Vec::add(off, Vec::madd16(Vec::pair16s(blk + o.sc + j * kRows + h * L, blk + o.sc + (j + 1) * kRows + h * L),
                                     Vec::set1(xp[j / 2])));
  const VI si = Vec::sub(isum, Vec::shl32(off, 5));
  return Vec::fmul(Vec::fmul(Vec::f16(blk + o.d + h * L * 2), Vec::fset1(a.dx(m)[b])), Vec::cvt(si));
}

template <int MT>
WSQ_TARGET void block_q6k(const uint8_t* g, const Act& a, int m0, int h, int b0, int b1, VF* acc) {
  constexpr Off o = offsets(Q6_K);
  constexpr int lines = (o.bytes + 63) / 64, share = (lines + R - 1) / R;
  const int ahead = prefetch_q6k;
  for (int b = b0; b < b1; ++b) {
    const uint8_t* blk = g + (size_t)b * o.bytes;
    if (ahead > 0)  // this pass's share of the lines `ahead` on: requests in flight in every pass
      for (int l = h * share; l < (h + 1) * share && l < lines; ++l) __builtin_prefetch(blk + ahead + 64 * l, 0, 3);
    const int8_t* xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = a.qrow(m0 + i) + b * 256;
    VI isum[MT];
    for (int i = 0; i < MT; ++i) isum[i] = Vec::zero();
    #pragma GCC unroll 1
    for (int hf = 0; hf < 2; ++hf) {
      #pragma GCC unroll 8
      for (int t = 0; t < 4; ++t) {
        #pragma GCC unroll 8
        for (int half = 0; half < 2; ++half) {
          const VI sc = Vec::scale16s(blk + o.sc + (hf * 8 + 2 * t + half) * kRows + h * L);
          #pragma GCC unroll 8
          for (int v0 = half * 4; v0 < half * 4 + 4; v0 += 2) {  // 2 units per int16 sum: 4 * 63 * 127 < 2**15
            VI ps[MT];
            for (int i = 0; i < MT; ++i) ps[i] = Vec::zero();
            #pragma GCC unroll 8
            for (int v = v0; v < v0 + 2; ++v) {
              const VI q = six_bits(blk, hf, t, v, h);
              for (int i = 0; i < MT; ++i)
                ps[i] = Vec::add16(ps[i], Vec::pairs(q, Vec::bcast4(xb[i] + hf * 128 + t * 32 + 4 * v)));
            }
            for (int i = 0; i < MT; ++i) isum[i] = Vec::add(isum[i], Vec::madd16(ps[i], sc));
          }
        }
      }
    }
    for (int i = 0; i < MT; ++i) acc[i] = Vec::fadd(acc[i], q6k_value(blk, a, m0 + i, b, h, isum[i]));
  }
}

// Q6_K at one x row (batch 1, a decode step): every row vector of a unit in one pass, so each line
// of the block is used whole when it arrives. Passes per row vector over kChunk blocks (tile() at
// M > 1) read half of each line in the first pass, which then waits on memory with nothing to
// overlap: one core streamed 7.4 GB/s cold that way against Q4_K's 14.5 (19 with the weights in
// cache). The units of the 4 quarters that share ql and qh bytes are made together from one load
// of each; the x quants of a unit broadcast once for all row vectors; the same int16 pair sums;
// the block's 16 scale vectors made once. The lines are prefetched `prefetch_q6k` bytes ahead in
// address order, 3 beside each unit (the units' own lines, from ql's two halves and qh, measured
// slower: three interleaved streams). Two threads, cold, AVX2: 13.5-17 -> 18.5-21 GB/s.
WSQ_TARGET void block_q6k_1(const uint8_t* g, const Act& a, int m0, VF* acc) {
  constexpr Off o = offsets(Q6_K);
  constexpr int lines = (o.bytes + 63) / 64, head = lines - 3 * 16;  // 3 lines for each of 16 units below
  const int ahead = m0 == 0 ? prefetch_q6k : 0;  // the later tiles of a call find the group in cache
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * o.bytes;
    for (int l = 0; ahead > 0 && l < head; ++l) __builtin_prefetch(blk + ahead + 64 * l, 0, 3);
    const int8_t* xb = a.qrow(m0) + b * 256;
    VI sc[R][16];  // each 16-group's scale in both int16 halves of every lane, made once a block
    for (int h = 0; h < R; ++h)
      for (int j = 0; j < 16; ++j) sc[h][j] = Vec::scale16s(blk + o.sc + j * kRows + h * L);
    VI isum[R];
    for (int h = 0; h < R; ++h) isum[h] = Vec::zero();
    #pragma GCC unroll 1
    for (int hf = 0; hf < 2; ++hf) {
      #pragma GCC unroll 1
      for (int half = 0; half < 2; ++half) {
        #pragma GCC unroll 2
        for (int v0 = half * 4; v0 < half * 4 + 4; v0 += 2) {
          VI ps[R][4];
          #pragma GCC unroll 2
          for (int v = v0; v < v0 + 2; ++v) {
            for (int l = head + 3 * (hf * 8 + v); ahead > 0 && l < head + 3 * (hf * 8 + v) + 3; ++l)
              __builtin_prefetch(blk + ahead + 64 * l, 0, 3);
            const int8_t* x = xb + hf * 128 + 4 * v;
            const VI xv[4] = {Vec::bcast4(x), Vec::bcast4(x + 32), Vec::bcast4(x + 64), Vec::bcast4(x + 96)};
            for (int h = 0; h < R; ++h) {
              const VI la = Vec::load(blk + o.qs + (hf * 16 + v) * kUnit + h * L * 4);
              const VI lb = Vec::load(blk + o.qs + (hf * 16 + v + 8) * kUnit + h * L * 4);
              const VI q = Vec::load(blk + o.qh + (hf * 8 + v) * kUnit + h * L * 4);
              const VI w[4] = {Vec::or_(Vec::lo4(la), Vec::and8(Vec::shl16(q, 4), 0x30)),
                               Vec::or_(Vec::lo4(lb), Vec::and8(Vec::shl16(q, 2), 0x30)),
                               Vec::or_(Vec::hi4(la), Vec::and8(q, 0x30)),
                               Vec::or_(Vec::hi4(lb), Vec::and8(Vec::shr16(q, 2), 0x30))};
              for (int t = 0; t < 4; ++t) {
                const VI p = Vec::pairs(w[t], xv[t]);
                ps[h][t] = v == v0 ? p : Vec::add16(ps[h][t], p);
              }
            }
          }
          for (int h = 0; h < R; ++h)
            for (int t = 0; t < 4; ++t)
              isum[h] = Vec::add(isum[h], Vec::madd16(ps[h][t], sc[h][hf * 8 + 2 * t + half]));
        }
      }
    }
    for (int h = 0; h < R; ++h) acc[h] = Vec::fadd(acc[h], q6k_value(blk, a, m0, b, h, isum[h]));
  }
}

template <int MT, int QT>
WSQ_TARGET void tile(const uint8_t* g, const Act& a, int m0, float* out) {
  if constexpr (QT == Q6_K && MT == 1) {
    VF acc[R];
    for (int h = 0; h < R; ++h) acc[h] = Vec::fzero();
    block_q6k_1(g, a, m0, acc);
    for (int h = 0; h < R; ++h) Vec::store(out + h * L, acc[h]);
  } else if constexpr (QT == Q6_K) {
    // row vectors in turn over kChunk blocks (they stay in L1 for the next vector)
    VF acc[R][MT];
    for (int h = 0; h < R; ++h)
      for (int i = 0; i < MT; ++i) acc[h][i] = Vec::fzero();
    for (int b0 = 0; b0 < a.nb; b0 += kChunk) {
      const int b1 = b0 + kChunk < a.nb ? b0 + kChunk : a.nb;
      for (int h = 0; h < R; ++h) block_q6k<MT>(g, a, m0, h, b0, b1, acc[h]);
    }
    for (int h = 0; h < R; ++h)
      for (int i = 0; i < MT; ++i) Vec::store(out + i * kRows + h * L, acc[h][i]);
  } else {
    VF acc[MT][R];
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < R; ++h) acc[i][h] = Vec::fzero();
    if constexpr (QT == Q4_K || QT == Q5_K)
      block_k45<MT, QT>(g, a, m0, acc);
    else
      block32<MT, QT>(g, a, m0, acc);
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < R; ++h) Vec::store(out + i * kRows + h * L, acc[i][h]);
  }
}

// x rows in tiles of Vec::tile(QT) (what the registers hold), up to kMaxTile per call.
template <int QT>
WSQ_TARGET void group_kernel(const uint8_t* g, const Act& a, int m0, int mt, float* out) {
  constexpr int T = Vec::tile(QT);
  static_assert(T >= 1 && T <= 4 && kMaxTile == 4, "tiles of 1 to 4 rows");
  for (int i = 0; i < mt; i += T, out += T * kRows) {
    switch (mt - i < T ? mt - i : T) {
      case 4: tile<(T >= 4 ? 4 : 1), QT>(g, a, m0 + i, out); break;
      case 3: tile<(T >= 3 ? 3 : 1), QT>(g, a, m0 + i, out); break;
      case 2: tile<(T >= 2 ? 2 : 1), QT>(g, a, m0 + i, out); break;
      default: tile<1, QT>(g, a, m0 + i, out);
    }
  }
}

const GroupFn kTable[kNumQTypes] = {group_kernel<Q4_0>, group_kernel<Q4_1>, group_kernel<Q8_0>, group_kernel<Q4_K>,
                                    group_kernel<Q5_K>, group_kernel<Q6_K>, group_kernel<MXFP4>};

// x rows m0 .. m1 - 1 -> int8 blocks, the scalar quantize_rows of qgemm.cpp in vectors (the same
// bits: the block's amax is exact in any order, x * (1 / d) is one rounding, and the conversion
// rounds to nearest even as nearbyint does). Each 16 quants are one s16 sum.
template <class T>
WSQ_TARGET void quantize_rows_t(const T* x, int64_t m0, int64_t m1, int K, int bv, float* d, int32_t* s16,
                                int8_t* q) {
  const float inv127 = float(1.0 / 127.0);
  const int nb = K / bv;
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * K;
    for (int b = 0; b < nb; ++b) {
      const T* xb = xr + b * bv;
      VF amax = Vec::fzero();
      for (int l = 0; l < bv; l += L) amax = Vec::fmax_(amax, Vec::fabs_(Vec::fload(xb + l)));
      const float db = Vec::hmax(amax) * inv127;
      const VF id = Vec::fset1(db == 0.0f ? 0.0f : 1.0f / db);
      d[m * nb + b] = db;
      for (int g = 0; g < bv; g += 16) {
        VI sum = Vec::zero();
        for (int h = 0; h < 16; h += L) {
          const VI qi = Vec::round_clamp(Vec::fmul(Vec::fload(xb + g + h), id));
          Vec::store_q8(q + m * K + b * bv + g + h, qi);
          sum = Vec::add(sum, qi);
        }
        s16[m * (K / 16) + (b * bv + g) / 16] = Vec::hsum(sum);
      }
    }
  }
}

WSQ_TARGET void quantize_rows(const void* x, bool bf16, int64_t m0, int64_t m1, int K, int bv, float* d,
                              int32_t* s16, int8_t* q) {
  if (bf16)
    quantize_rows_t(static_cast<const uint16_t*>(x), m0, m1, K, bv, d, s16, q);
  else
    quantize_rows_t(static_cast<const float*>(x), m0, m1, K, bv, d, s16, q);
}
