// TokTier compiled repair lane: the first-window splice of an append, in one call.
//
// It does what `Session._repair` does on its first window for an append at the end of the
// text, with the same certificate (DESIGN §3, `Session._find_left`'s non-glued pass):
//   * window: from the start of the cached token that holds byte n_old - wl (moved back to a
//     character start) to the end, plus the appended bytes; encoded by the native engine;
//   * agreeing runs: cached and fresh tokens that start at the same byte with the same id,
//     consecutive on both sides; a run counts with >= 2 tokens covering more bytes than the
//     longest token; runs are tried longest first (ties: the later one);
//   * in a run, the last token start q strictly inside the window and before the append that
//     is a character boundary, a stable pair of the family (the group and pair tables of
//     `Family.stable`), and crossed by no added-token literal occurrence in the old text or
//     in the new one (`LiteralIndex.crossed`: inside an occurrence, or at its start after a
//     byte that may be non-line-break whitespace);
//   * the fresh tokens from q must spell the rest of the new text, byte for byte.
// Anything else (no run, an NFC-changeable or uncertain-span window, a one-byte run before
// the append, invalid UTF-8) returns a fallback code, and the Python path runs from scratch:
// this lane may decline, never decide differently.
#pragma once

#include "engine.hpp"

namespace ttn {

enum LaneStatus : int {
  LANE_OK = 0,
  LANE_NO_RUN = 1,          // no certified cut in the first window
  LANE_ONE_BYTE_RUN = 2,    // the Python path doubles the window first
  LANE_NFC = 3,             // the window holds a character NFC may change
  LANE_UNCERTAIN = 4,       // a fresh token without one fixed byte span
  LANE_BAD_UTF8 = 5,
  LANE_TILING = 6,
};

struct LaneTables {
  const uint32_t* token_len = nullptr;   // per id (canonical bytes)
  const uint8_t* uncertain = nullptr;    // per id: 1 = no fixed span
  int64_t n_ids = 0;
  const uint8_t* group = nullptr;        // [0x110000] stable-predicate group per code point
  const uint8_t* pairs = nullptr;        // [(gx << 4) | gy] -> stable
  int64_t n_pairs = 0;
  int64_t max_token_bytes = 0;
  int64_t max_literal = 0;               // longest literal (bytes); 0 without literals
};

struct LaneResult {
  int status = LANE_NO_RUN;
  int64_t k1 = 0;       // cached index of the first replaced token
  int64_t q = 0;        // byte position of the cut
  int64_t fresh = 0;    // tokens encoded in the window
  std::vector<uint32_t> mid;  // fresh tokens from the cut to the end
};

static inline bool decode_utf8(const uint8_t* b, int64_t n, std::vector<uint32_t>& cps, std::vector<int64_t>& at) {
  cps.clear();
  at.clear();
  int64_t i = 0;
  while (i < n) {
    uint32_t c = b[i];
    int k;
    if (c < 0x80) k = 1;
    else if ((c & 0xE0) == 0xC0) { c &= 0x1F; k = 2; }
    else if ((c & 0xF0) == 0xE0) { c &= 0x0F; k = 3; }
    else if ((c & 0xF8) == 0xF0) { c &= 0x07; k = 4; }
    else return false;
    if (i + k > n) return false;
    for (int j = 1; j < k; ++j) {
      if ((b[i + j] & 0xC0) != 0x80) return false;
      c = (c << 6) | (b[i + j] & 0x3F);
    }
    if (c > 0x10FFFF) return false;
    cps.push_back(c);
    at.push_back(i);
    i += k;
  }
  return true;
}

class Lane {
 public:
  const Engine* eng = nullptr;
  LaneTables t;
  Trie lit_bytes;  // every active literal, over UTF-8 bytes (term = 1)

  // Whether a literal occurrence in buf[0, n) crosses position x (LiteralIndex.crossed).
  bool crossed(const uint8_t* buf, int64_t n, int64_t x) const {
    if (lit_bytes.empty()) return false;
    int64_t lo = std::max<int64_t>(0, x - t.max_literal);
    for (int64_t a = lo; a <= x && a < n; ++a) {
      if (!lit_bytes.may_start(buf[a])) continue;
      int64_t id = -1;
      int64_t b = lit_bytes.longest(buf, a, n, id);
      if (b < 0 || b <= x) continue;
      if (a < x) return true;
      // a == x: crossed when the byte before may be whitespace other than a line break
      if (a > 0) {
        uint8_t p = buf[a - 1];
        if (p == ' ' || p == '\t' || p == 0x0B || p == 0x0C || (p >= 0x1C && p <= 0x1F) || p >= 0x80) return true;
      }
    }
    return false;
  }

  int append(const uint8_t* T, int64_t n_old, const uint8_t* data, int64_t n_data, const uint32_t* ids,
             int64_t N, int64_t wl, PieceCache& cache, LaneResult& res) const {
    const int64_t s = n_old;
    if (s >= 2 * wl && T[s - 1] < 0x80) {
      bool same = true;
      for (int64_t i = s - wl; i < s && same; ++i) same = T[i] == T[s - 1];
      if (same) return res.status = LANE_ONE_BYTE_RUN;
    }
    int64_t p = std::max<int64_t>(0, s - wl);
    while (p > 0 && (T[p] & 0xC0) == 0x80) --p;
    // the cached token holding p, walking back from the end: starts[k_lo..N)
    int64_t k = N, pos = n_old;
    while (k > 0 && pos > p) { --k; pos -= t.token_len[ids[k]]; }
    if (pos < 0) return res.status = LANE_TILING;  // the session's tokens do not tile its text
    if (k < N && pos < p) p = pos;  // p moved to the start of the token holding it
    while (p > 0 && (T[p] & 0xC0) == 0x80) --p;
    // cached tokens starting at or after p
    int64_t k_lo = k, c_pos = pos;
    while (k_lo < N && c_pos < p) { c_pos += t.token_len[ids[k_lo]]; ++k_lo; }
    // the window, its code points and their byte offsets
    std::vector<uint8_t> win(T + p, T + n_old);
    win.insert(win.end(), data, data + n_data);
    std::vector<uint32_t> cps;
    std::vector<int64_t> at;
    if (!decode_utf8(win.data(), int64_t(win.size()), cps, at)) return res.status = LANE_BAD_UTF8;
    Output out;
    out.want_starts = true;
    bool ascii = true;
    for (uint32_t c : cps) if (c >= 0x80) { ascii = false; break; }
    if (eng->encode<uint32_t>(cps.data(), int64_t(cps.size()), ascii, true, cache, out) != OK)
      return res.status = LANE_NFC;
    const std::vector<uint32_t>& fresh = out.ids;
    const std::vector<int64_t>& fst = out.starts;  // window-local
    res.fresh = int64_t(fresh.size());
    for (uint32_t id : fresh)
      if (id >= uint32_t(t.n_ids) || t.uncertain[id]) return res.status = LANE_UNCERTAIN;
    // agreeing runs (cached k >= k_lo starting before s; fresh j starting before s - p)
    struct Run { int64_t c0, f0, len; };
    std::vector<Run> runs;
    std::vector<int64_t> cstart;  // byte start of cached token k_lo + i
    {
      int64_t cp_ = c_pos;
      for (int64_t kk = k_lo; kk < N; ++kk) { cstart.push_back(cp_); cp_ += t.token_len[ids[kk]]; }
    }
    const int64_t nc = int64_t(cstart.size());
    int64_t i = 0, j = 0, last_i = -2, last_j = -2;
    while (i < nc && j < int64_t(fst.size())) {
      int64_t a = cstart[i], b = fst[j] + p;
      if (a >= s || b >= s) break;
      if (a < b) { ++i; continue; }
      if (b < a) { ++j; continue; }
      if (ids[k_lo + i] == fresh[j]) {
        if (last_i == i - 1 && last_j == j - 1 && !runs.empty()) ++runs.back().len;
        else runs.push_back({i, j, 1});
        last_i = i;
        last_j = j;
      }
      ++i;
      ++j;
    }
    std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) {
      return x.len != y.len ? x.len > y.len : x.c0 > y.c0;
    });
    // new-text and old-text buffers for the literal checks (they reach max_literal around p)
    const int64_t lo = std::max<int64_t>(0, p - t.max_literal);
    std::vector<uint8_t> buf_new, buf_old;
    if (!lit_bytes.empty()) {
      buf_old.assign(T + lo, T + n_old);
      buf_new = buf_old;
      buf_new.insert(buf_new.end(), data, data + n_data);
    }
    for (const Run& r : runs) {
      if (r.len < 2) continue;
      const int64_t last = r.c0 + r.len - 1;
      if (cstart[last] + t.token_len[ids[k_lo + last]] - cstart[r.c0] <= t.max_token_bytes) continue;
      for (int64_t m = r.c0 + r.len - 1; m >= r.c0 + 1; --m) {  // the latest good candidate wins
        const int64_t q = cstart[m];
        if (q <= p || q >= s) continue;
        // q must be a character start inside the window, not its first character
        int64_t wq = q - p;
        auto it = std::lower_bound(at.begin(), at.end(), wq);
        if (it == at.end() || *it != wq || it == at.begin()) continue;
        const size_t ci = size_t(it - at.begin());
        const uint32_t gx = t.group[cps[ci - 1]], gy = t.group[cps[ci]];
        const int64_t pi = int64_t((gx << 4) | gy);
        if (pi >= t.n_pairs || !t.pairs[pi]) continue;
        if (!lit_bytes.empty()) {
          if (crossed(buf_new.data(), int64_t(buf_new.size()), q - lo)) continue;
          if (crossed(buf_old.data(), int64_t(buf_old.size()), q - lo)) continue;
        }
        const int64_t f = r.f0 + (m - r.c0);
        // the fresh tokens' bytes from the cut are the rest of the new text, byte for byte
        int64_t w = q - p;
        for (size_t x = size_t(f); x < fresh.size(); ++x) {
          const uint32_t o = eng->t.tok_off[fresh[x]], len = eng->t.tok_off[fresh[x] + 1] - o;
          if (len != t.token_len[fresh[x]] || w + len > int64_t(win.size()) ||
              std::memcmp(eng->t.tok_blob + o, win.data() + w, len) != 0)
            return res.status = LANE_TILING;
          w += len;
        }
        if (w != int64_t(win.size())) return res.status = LANE_TILING;
        res.k1 = k_lo + m;
        res.q = q;
        res.mid.assign(fresh.begin() + f, fresh.end());
        return res.status = LANE_OK;
      }
    }
    return res.status = LANE_NO_RUN;
  }
};

}  // namespace ttn
