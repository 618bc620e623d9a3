// TokTier compiled repair lane: the first-window splice of an edit (or append), in one call.
//
// It does what `Session._repair` does on its first window, with the same certificate (DESIGN
// §3; `Session._find_left` / `_find_right`, their non-glued pass):
//   * window: [s - wl, e + wr) moved out to character starts and to the cached token starts
//     around them (`Session._token_edges`), the change spliced in; encoded by the native engine;
//   * each side: cached and fresh tokens that start at the same byte (new coordinates) with the
//     same id, consecutive on both sides, form agreeing runs; a run counts with >= 2 tokens
//     covering more bytes than the longest token; runs are tried longest first (ties: the later);
//   * left of the change the latest, right of it the earliest, token start q inside a run (not its
//     first token) and strictly inside the window that is a character boundary, a stable pair of
//     the family (the group and pair tables of `Family.stable`), and crossed by no added-token
//     literal occurrence in the old text or in the new one (`LiteralIndex.crossed`: inside an
//     occurrence, or at its start after a byte that may be non-line-break whitespace);
//     a window reaching the text's start or end needs no cut on that side;
//   * the fresh tokens between the cuts must spell the new text between them, byte for byte.
// NFC families (Qwen3) take a window only when NFC leaves it as it is: its characters inert or
// marks in canonical order that compose with nothing before them (`Lane::nfc_stable`); with the
// cuts between inert characters and no span the normalizer changes in the session's text (or the
// lane running on the text after the last one), the reference then tokenizes the raw new text.
// Anything else (no run, an NFC-changeable or uncertain-span window, a one-byte run before
// the change, invalid UTF-8) returns a fallback code, and the Python path runs from scratch:
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
  const uint8_t* classes = nullptr;      // [0x110000] the tokenizer's class table (tok.classes)
  uint8_t w_bit = 0;                     // its whitespace bit: no chunk cut after whitespace
  // NFC families: the class table's NFC-inert bit, and per code point the canonical combining
  // class of a mark NFC leaves alone in canonical order (0xFF: any other character that is not
  // inert; `charclass.nfc_mark_table`).  Null in an NFC family: the engine's own check declines
  // every window holding a non-inert character (`Engine::encode`).
  const uint8_t* nfc_marks = nullptr;
  uint8_t inert_bit = 0;
};

// Windows of at least this many bytes are cut into chunks encoded on several threads (the
// engine's kept helpers wake in ~10-20 us, and a chunk's piece cache is another, colder one).
// Measured with bench.append_ab once the hot front (engine.hpp) made one core ~1.2x faster:
// 24K/12K beat 8K/4K by 1.26-1.37x at 16K appends, 1.07-1.20x at 20K, even from 28K on.
constexpr int64_t PARALLEL_MIN_BYTES = 24 * 1024;
constexpr int64_t CHUNK_MIN_BYTES = 12 * 1024;
constexpr int64_t CUT_SEARCH = 2048;  // code points searched after each target for a cut

struct LaneResult {
  int status = LANE_NO_RUN;
  int64_t k1 = 0;       // cached index of the first replaced token
  int64_t k2 = 0;       // cached index of the first kept token after the change
  int64_t q = 0;        // byte position of the left cut (new text)
  int64_t q2 = 0;       // byte position of the right cut (new text)
  int64_t fresh = 0;    // tokens encoded in the window
  // Fresh tokens from the cut to the end: a view into the calling thread's `Scratch`, valid until
  // that thread's next `Lane::edit` (no copy, no allocation per op: a busy process's fragmented
  // heap made each ~15 KB allocation here cost microseconds).
  const uint32_t* mid = nullptr;
  int64_t n_mid = 0;
};

// Capacity for `n` in a kept scratch vector, with half again to spare: windows of about one size
// (an agent's appends) then stop reallocating at each new largest one.
template <class V>
inline void reserve_slack(V& v, size_t n) {
  if (v.capacity() < n) v.reserve(n + n / 2);
}

using U16Scratch = std::vector<uint16_t, NoInit<uint16_t>>;

// A window's characters for the engine, as narrow as they fit: none for an ASCII window (the
// engine reads its bytes in place: character i is byte i), two bytes each when every character
// is in the BMP (most non-ASCII windows), four otherwise.  The engine narrows each piece back to
// UTF-8 itself, as it does for a Python str of that width.  (A four-byte character and an eight-
// byte offset per character, 12 bytes in all, were written here before: for a 16K window 192 KB
// of stores, cold whenever anything else ran since the last call.)
struct WindowChars {
  int width = 1;  // 1 (ASCII: use the bytes), 2 (c16) or 4 (c32)
  U16Scratch c16;
  U32Scratch c32;
};

// Whether b[0, n) is all ASCII (then it needs no decoding: character i is byte i).
static inline bool all_ascii(const uint8_t* b, int64_t n) {
  uint64_t acc = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    std::memcpy(&x, b + i, 8);
    acc |= x;
  }
  for (; i < n; ++i) acc |= b[i];
  return (acc & 0x8080808080808080ull) == 0;
}

// Decode b[0, n) into out (code points, each stored as a T); 1 for invalid UTF-8, 2 for a code
// point that does not fit a T (the caller decodes again, wider), 0 when done.  Runs of 8 ASCII
// bytes are copied without the per-character decode (most windows are mostly ASCII).
template <class T, class V>
static inline int decode_utf8(const uint8_t* b, int64_t n, V& out) {
  reserve_slack(out, size_t(n));
  out.resize(size_t(n));
  T* cp = out.data();
  int64_t i = 0, m = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t x;
      std::memcpy(&x, b + i, 8);
      if ((x & 0x8080808080808080ull) == 0) {
        for (int j = 0; j < 8; ++j) cp[m + j] = T(b[i + j]);
        i += 8;
        m += 8;
        continue;
      }
    }
    uint32_t c = b[i];
    int k;
    if (c < 0x80) k = 1;
    else if ((c & 0xE0) == 0xC0) { c &= 0x1F; k = 2; }
    else if ((c & 0xF0) == 0xE0) { c &= 0x0F; k = 3; }
    else if ((c & 0xF8) == 0xF0) { c &= 0x07; k = 4; }
    else return 1;
    if (i + k > n) return 1;
    for (int j = 1; j < k; ++j) {
      if ((b[i + j] & 0xC0) != 0x80) return 1;
      c = (c << 6) | (b[i + j] & 0x3F);
    }
    // (overlong forms pass, as they always did here: a window is a str's UTF-8)
    if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 1;
    if (sizeof(T) < 4 && c > 0xFFFF) return 2;
    cp[m] = T(c);
    ++m;
    i += k;
  }
  out.resize(size_t(m));
  return 0;
}

// Decode the window b[0, n) into wc at its narrowest width; false for invalid UTF-8.
static inline bool decode_window(const uint8_t* b, int64_t n, WindowChars& wc) {
  wc.c16.clear();
  wc.c32.clear();
  if (all_ascii(b, n)) {
    wc.width = 1;
    return true;
  }
  wc.width = 2;
  const int st = decode_utf8<uint16_t>(b, n, wc.c16);
  if (st == 0) return true;
  if (st == 1) return false;
  wc.c16.clear();
  wc.width = 4;
  return decode_utf8<uint32_t>(b, n, wc.c32) == 0;
}

// The code point starting at byte i of valid UTF-8 b (`utf8_at`), and the one ending right before
// byte i (`utf8_before`, i > 0).
static inline uint32_t utf8_at(const uint8_t* b, int64_t i) {
  const uint32_t c = b[i];
  if (c < 0x80) return c;
  if ((c & 0xE0) == 0xC0) return ((c & 0x1F) << 6) | (b[i + 1] & 0x3F);
  if ((c & 0xF0) == 0xE0) return ((c & 0x0F) << 12) | (uint32_t(b[i + 1] & 0x3F) << 6) | (b[i + 2] & 0x3F);
  return ((c & 0x07) << 18) | (uint32_t(b[i + 1] & 0x3F) << 12) | (uint32_t(b[i + 2] & 0x3F) << 6) |
         (b[i + 3] & 0x3F);
}
static inline uint32_t utf8_before(const uint8_t* b, int64_t i) {
  int64_t a = i - 1;
  while (a > 0 && (b[a] & 0xC0) == 0x80) --a;
  return utf8_at(b, a);
}

// Byte offset of character c of valid UTF-8 b[0, n) holding `nchars` characters (n when c >=
// nchars), counted from the nearer end eight bytes at a time (a character starts at every byte
// that is not 10xxxxxx): an edit by character offset deep inside 3 MB of Thai or Chinese read
// ~1 MB through numpy temporaries for ~0.6 ms (`Session._char_to_byte`).
static inline int64_t char_byte_offset(const uint8_t* b, int64_t n, int64_t nchars, int64_t c) {
  if (c >= nchars) return n;
  // Character starts in 128 bytes: a 0/1 per byte lane, summed by lane, then across the lanes
  // (at most 16 a lane: no carry).  No popcount instruction is assumed (the build is generic).
  constexpr int64_t BLOCK = 128;
  auto starts = [](const uint8_t* p) {
    uint64_t acc = 0;
    for (int j = 0; j < 16; ++j) {
      uint64_t x;
      std::memcpy(&x, p + 8 * j, 8);
      acc += ((~x | (x << 1)) & 0x8080808080808080ull) >> 7;
    }
    return int64_t((acc * 0x0101010101010101ull) >> 56);
  };
  if (c <= nchars / 2) {  // the (c + 1)-th start from the front
    int64_t i = 0, seen = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
      const int64_t k = starts(b + i);
      if (seen + k > c) break;
      seen += k;
    }
    for (; i < n; ++i)
      if ((b[i] & 0xC0) != 0x80 && seen++ == c) return i;
    return n;  // (not reached for valid text)
  }
  const int64_t want = nchars - c;  // the want-th start from the end
  int64_t i = n, seen = 0;
  for (; i >= BLOCK; i -= BLOCK) {
    const int64_t k = starts(b + i - BLOCK);
    if (seen + k >= want) break;
    seen += k;
  }
  while (i > 0) {
    --i;
    if ((b[i] & 0xC0) != 0x80 && ++seen == want) return i;
  }
  return 0;  // (not reached for valid text)
}

// An agreeing run of cached and fresh tokens (`Lane::runs_of`).
struct LaneRun { int64_t c0, f0, len; };

// One thread's scratch buffers for `Lane::edit` (windows, their decode, the engine's output):
// kept between calls so big appends reuse memory already paged in.
struct Scratch {
  std::vector<uint8_t> win, buf_new, buf_old;
  std::vector<int64_t> starts;  // the fresh tokens' byte starts in the window
  WindowChars chars;
  Output out;
  std::vector<Output> chunk_outs;  // a chunked window's per-chunk tokens (`encode_window`)
  std::vector<int64_t> chunk_bytes;
  std::vector<int64_t> cut_starts;  // cached token starts beside the change (`Lane::edit`'s sides)
  std::vector<LaneRun> runs;
  std::vector<uint8_t, NoInit<uint8_t>> utf8;  // an append's UTF-8 (`utf8_of`)
  static Scratch& mine() {
    thread_local Scratch s;
    return s;
  }
};

// Gives a scratch buffer's memory back after a window larger than usual: each thread that ever
// served a window keeps at most ~KEEP_BYTES per buffer (a 400K-character window's buffers, ~8 MB
// in all), outside the sessions' memory budget; a bigger window pays its page faults again.
// The fresh tokens (`out.ids`) are what the op's `LaneResult::mid` points into: they are trimmed
// when the thread's next edit starts, not when this one ends.
struct ScratchTrim {
  Scratch& s;
  static constexpr size_t KEEP_BYTES = size_t(4) << 20;
  template <class V>
  static void trim(V& v) {
    if (v.capacity() * sizeof(typename V::value_type) > KEEP_BYTES) V().swap(v);
  }
  explicit ScratchTrim(Scratch& sc) : s(sc) { trim(s.out.ids); }
  ~ScratchTrim() {
    trim(s.cut_starts);
    trim(s.win);
    trim(s.buf_new);
    trim(s.buf_old);
    trim(s.chars.c16);
    trim(s.chars.c32);
    trim(s.starts);
    trim(s.out.starts);
    for (Output& o : s.chunk_outs) {
      trim(o.ids);
      trim(o.starts);
    }
  }
};

// The UTF-8 of a str's `n` code units of `kind` bytes each (the engine's own converter, ASCII
// eight at a time), in this thread's scratch: valid until the thread's next call.  nullptr for a
// str holding a surrogate (no UTF-8).  An append used CPython's conversion, which allocates a
// worst-case buffer and then the str's cached copy: two allocations per op, the copy kept with
// the caller's str.
template <class T>
inline const uint8_t* utf8_of_units(const T* s, int64_t n, int64_t& n_out) {
  if (Engine::has_surrogate(s, n)) return nullptr;
  auto& u = Scratch::mine().utf8;
  const size_t room = size_t(n) * 4 + 8;  // (+ `ascii8`'s 8-byte stores)
  if (u.capacity() > ScratchTrim::KEEP_BYTES && room <= ScratchTrim::KEEP_BYTES)
    std::vector<uint8_t, NoInit<uint8_t>>().swap(u);
  if (u.size() < room) u.resize(room);
  n_out = int64_t(Engine::put_utf8_run(s, 0, n, n, u.data()) - u.data());
  return u.data();
}

inline const uint8_t* utf8_of(const void* data, int kind, int64_t n, int64_t& n_out) {
  if (kind == 1) return utf8_of_units(static_cast<const uint8_t*>(data), n, n_out);
  if (kind == 2) return utf8_of_units(static_cast<const uint16_t*>(data), n, n_out);
  return utf8_of_units(static_cast<const uint32_t*>(data), n, n_out);
}

class Lane {
 public:
  const Engine* eng = nullptr;  // with its token records built (`Engine::build_records`)
  LaneTables t;
  Trie lit_bytes;  // every active literal, over UTF-8 bytes (term = 1)
  // NFC families (`t.nfc_marks`): a bit per "maybe" mark, and the (first << 21 | second) pairs NFC
  // composes, sorted (`charclass.nfc_mark_table`)
  std::vector<uint64_t> nfc_maybe;
  std::vector<uint64_t> nfc_pairs;

  // Per id: its canonical byte length when its record has no flag and it is 1..255 bytes long,
  // else 0 (`build_fast_len`).  128 KB for a 128K vocabulary against 2 MB of records.
  std::vector<uint8_t> fast_len;
  void build_fast_len() {
    const size_t n = std::min(eng->n_records(), size_t(std::max<int64_t>(t.n_ids, 0)));
    fast_len.assign(n, 0);
    for (size_t id = 0; id < n; ++id) {
      const Engine::TokRec& r = eng->recs[id];
      if (!r.flags && r.len > 0 && r.len <= 255) fast_len[id] = uint8_t(r.len);
    }
  }

  // canonical byte length of a cached token
  inline uint32_t clen(uint32_t id) const {
    if (id < fast_len.size() && fast_len[id]) return fast_len[id];
    const Engine::TokRec& r = eng->recs[id];
    return (r.flags & Engine::REC_LEN_DIFFERS) ? t.token_len[id] : r.len;
  }

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

  // -- cached token starts from the session's checkpoints (one per `stride` tokens) ----------
  struct Cached {
    const uint32_t* ids;
    int64_t N;
    const uint32_t* cp;  // cp[j] = byte start of token j * stride
    int64_t n_cp, stride;
    const Lane* lane;
    inline uint32_t len(uint32_t id) const { return lane->clen(id); }
    // first token starting at or after byte `pos`, and its start (N and the text end if none)
    void locate(int64_t pos, int64_t& k, int64_t& start) const {
      int64_t j = int64_t(std::upper_bound(cp, cp + n_cp, uint32_t(std::min<int64_t>(pos, 0xFFFFFFFF))) - cp) - 1;
      if (j < 0) { k = 0; start = 0; }
      else { k = j * stride; start = cp[j]; }
      while (k < N && start < pos) { start += len(ids[k]); ++k; }
    }
    int64_t start_of(int64_t k) const {  // byte start of token k (k < N)
      int64_t j = k / stride, st = cp[j];
      for (int64_t x = j * stride; x < k; ++x) st += len(ids[x]);
      return st;
    }
  };

  using Run = LaneRun;

  // Agreeing runs of cached tokens k_lo + i (start cs[i], new coordinates) and fresh tokens
  // j (start fs[j] + p), both restricted to [lo, hi): maximal, consecutive on both sides.
  static void runs_of(const std::vector<int64_t>& cs, const uint32_t* cids, const int64_t* fs, int64_t nf,
                      const std::vector<uint32_t>& fresh, int64_t j0, int64_t p, std::vector<Run>& runs) {
    runs.clear();
    int64_t i = 0, j = j0, li = -2, lj = -2;
    const int64_t nc = int64_t(cs.size());
    while (i < nc && j < nf) {
      int64_t a = cs[i], b = fs[j] + p;
      if (a < b) { ++i; continue; }
      if (b < a) { ++j; continue; }
      if (cids[i] == fresh[j]) {
        if (li == i - 1 && lj == j - 1 && !runs.empty()) ++runs.back().len;
        else runs.push_back({i, j, 1});
        li = i;
        lj = j;
      }
      ++i;
      ++j;
    }
    std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) {
      return x.len != y.len ? x.len > y.len : x.c0 > y.c0;
    });
  }

  // Whether new-text position q (a cached token start in the window) is a certified boundary.
  // (`win` is valid UTF-8: `decode_window` accepted it.)
  bool certified(int64_t q, int64_t p, const std::vector<uint8_t>& win, const std::vector<uint8_t>& buf_new,
                 const std::vector<uint8_t>& buf_old, int64_t lo, int64_t old_q) const {
    const int64_t wq = q - p;
    if (wq <= 0 || wq >= int64_t(win.size())) return false;  // strictly inside the window
    const uint8_t* const b = win.data();
    if ((b[wq] & 0xC0) == 0x80) return false;  // not a character start
    const uint32_t x = utf8_before(b, wq), y = utf8_at(b, wq);  // the characters before and after q
    const int64_t pi = int64_t((uint32_t(t.group[x]) << 4) | t.group[y]);
    if (pi >= t.n_pairs || !t.pairs[pi]) return false;
    if (!lit_bytes.empty()) {
      if (crossed(buf_new.data(), int64_t(buf_new.size()), q - lo)) return false;
      if (crossed(buf_old.data(), int64_t(buf_old.size()), old_q - lo)) return false;
    }
    return true;
  }

  // Cuts of the window (code point indices) into about `k` chunks that encode independently:
  // the full path's standalone-stable boundaries (`Family.chunk_stable`: a stable pair whose left
  // character is not whitespace) that no literal occurrence crosses, searched after each target.
  // (`s`: the window's n characters, `win`'s bytes themselves when T is uint8_t.)
  template <class T>
  void chunk_cuts(const T* s, int64_t n, const std::vector<uint8_t>& win, int64_t k,
                  std::vector<int64_t>& cuts) const {
    const int64_t nb = int64_t(win.size());
    int64_t ci = 0, bi = 0;  // character ci starts at byte bi (advanced as q moves on)
    auto byte_of = [&](int64_t q) {
      if (sizeof(T) == 1) return q;
      if (q < ci) ci = bi = 0;
      bi += Engine::utf8_length(s + ci, q - ci);
      ci = q;
      return bi;
    };
    auto cp = [&](int64_t i) { return uint32_t(s[size_t(i)]); };
    for (int64_t c = 1; c < k; ++c) {
      int64_t q = std::max<int64_t>(n * c / k, cuts.empty() ? 1 : cuts.back() + 1);
      for (const int64_t stop = std::min(n, q + CUT_SEARCH); q < stop; ++q) {
        const int64_t bq = byte_of(q);
        // the literal check sees every occurrence that could cross q only this far inside
        if (bq < t.max_literal || bq > nb - t.max_literal) continue;
        const uint32_t x = cp(q - 1), y = cp(q);
        const int64_t pi = int64_t((uint32_t(t.group[x]) << 4) | t.group[y]);
        if (pi >= t.n_pairs || !t.pairs[pi] || (t.classes[x] & t.w_bit)) continue;
        if (!lit_bytes.empty() && crossed(win.data(), nb, bq)) continue;
        cuts.push_back(q);
        break;
      }
    }
  }

  // Cuts of a whole text s[0, n) (a str's code points) about every `chunk` characters, for
  // `Engine::encode_chunks`: Python's `fullpath.chunk_cuts` compiled, with its predicate
  // (`Family.chunk_stable`: a stable pair whose left character is not whitespace) and its
  // literal filter (no occurrence crosses the cut: `crossed` over the UTF-8 of the characters
  // within `max_literal` of it), searched CUT_SEARCH characters from each target; no cut found
  // there moves the target on by CUT_SEARCH.  In Python a cut cost 0.1-0.25 ms, too much to cut a
  // session start into more chunks than threads.
  template <class T>
  void text_cuts(const T* s, int64_t n, int64_t chunk, std::vector<int64_t>& cuts) const {
    if (chunk <= 0 || !t.classes) return;
    std::vector<uint8_t> near;  // the UTF-8 around a candidate, for the literal check
    const int64_t reach = t.max_literal;  // in characters: at least as many bytes
    int64_t target = chunk;
    while (target < n - 1) {
      const int64_t lo = std::max<int64_t>(1, target), stop = std::min(n, lo + CUT_SEARCH);
      int64_t found = -1;
      for (int64_t q = lo; q < stop; ++q) {
        const uint32_t x = uint32_t(s[q - 1]), y = uint32_t(s[q]);
        if (x > 0x10FFFF || y > 0x10FFFF) continue;
        const int64_t pi = int64_t((uint32_t(t.group[x]) << 4) | t.group[y]);
        if (pi >= t.n_pairs || !t.pairs[pi] || (t.classes[x] & t.w_bit)) continue;
        if (!lit_bytes.empty()) {
          const int64_t a = std::max<int64_t>(0, q - reach), b = std::min(n, q + reach);
          near.clear();
          int64_t bq = 0;
          for (int64_t i = a; i < b; ++i) {
            if (i == q) bq = int64_t(near.size());
            Engine::put_utf8(uint32_t(s[i]), near);
          }
          if (crossed(near.data(), int64_t(near.size()), bq)) continue;
        }
        found = q;
        break;
      }
      if (found >= 0) {
        cuts.push_back(found);
        target = found + chunk;
      } else {
        target += CUT_SEARCH;
      }
    }
  }

  // The fresh tokens' byte starts in the window, and the proof that they tile it: every id has
  // one fixed span whose canonical length is its byte length (no record flag, else
  // LANE_UNCERTAIN: the Python path proves those by walking the text), and the lengths sum to
  // the window's bytes.  For a byte-level BPE whose normalizer leaves the window as it is (none,
  // or NFC on a window `nfc_stable` took) that proves the tokens spell the window, as
  // `Session._tiles_exactly` does.  The
  // lengths come from `fast_len` (one byte per id, L2-resident): the 16-byte records it
  // summarizes are 2 MB or more, cold after the engine's table reads, and reading one per
  // token was ~40% of a 16K append's lane time (measured 2026-12-02, `bench.append_ab`).
  int tile(const std::vector<uint32_t>& fresh, int64_t nb, std::vector<int64_t>& starts) const {
    const size_t nf = fresh.size();
    starts.resize(nf);
    int64_t* const st = starts.data();
    const uint8_t* const fl = fast_len.data();
    const uint32_t n_fast = uint32_t(fast_len.size());
    // Many tokens: the whole table is read in first, in order.  After other work has run, each
    // token's byte is a cold miss of its own (~35% of a 16K window's lane time after a 32 MB
    // sweep); read in order, the hardware prefetcher runs ahead and 128 KB arrive in a few us.
    if (nf >= 1024) {
      uint64_t acc = 0;
      for (uint32_t i = 0; i < n_fast; i += 64) acc += fl[i];
      asm volatile("" : : "r"(acc));
    }
    int64_t w = 0;
    for (size_t x = 0; x < nf; ++x) {
      const uint32_t id = fresh[x];
      uint32_t len = id < n_fast ? fl[id] : 0;
      if (len == 0) {  // not summarized: a flagged id, an id past the table, or a token over 255 bytes
        if (id >= uint32_t(t.n_ids)) return LANE_UNCERTAIN;
        const Engine::TokRec& rec = eng->recs[id];
        if (rec.flags) return LANE_UNCERTAIN;  // also a canonical length that differs from the bytes
        len = rec.blen;
        if (len == 0) return LANE_TILING;
      }
      st[x] = w;
      w += len;
    }
    return w == nb ? 0 : LANE_TILING;
  }

  // NFC families (`t.nfc_marks`): whether the code points s[0, n) are their own NFC, by the
  // quick check of UAX #15: every character inert, or a mark NFC leaves alone (`nfc_marks[c]`: its
  // combining class), the marks of each run in canonical order; a "maybe" mark (`nfc_maybe`) only
  // right after an inert character it does not compose with (`nfc_pairs`: that character is the
  // last starter before it, with nothing between).  Why that is all a window needs: the splice's
  // cuts are stable pairs, which in an NFC family join two inert characters (`Family._group_table`),
  // so NFC of the new text is NFC of the old text before the left cut (the text is its own NFC
  // there: the session holds no span the normalizer changes, or the lane runs on the text after
  // the last one), of the window's text between the cuts (this check: a part of a text that
  // passes it, cut before inert characters, passes it too) and of the old text after the right cut.
  // A window reaching the text's start or end needs no cut on that side, and no more than this.
  // So the reference tokenizes the raw new text, as the lane does.
  template <class T>
  bool nfc_stable(const T* s, int64_t n) const {
    uint8_t last = 0;
    bool after_inert = false;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t c = uint32_t(s[i]);
      if (c < 0x80 || (t.classes[c] & t.inert_bit)) {
        last = 0;
        after_inert = true;
        continue;
      }
      const uint8_t ccc = t.nfc_marks[c];
      if (ccc == 0xFF || (ccc != 0 && ccc < last)) return false;
      if (c < uint32_t(nfc_maybe.size()) * 64 && (nfc_maybe[c >> 6] >> (c & 63) & 1)) {
        if (!after_inert) return false;
        const uint64_t pair = (uint64_t(uint32_t(s[i - 1])) << 21) | c;
        if (std::binary_search(nfc_pairs.begin(), nfc_pairs.end(), pair)) return false;
      }
      last = ccc;
      after_inert = false;
    }
    return true;
  }
  bool nfc_stable(const std::vector<uint8_t>& win, const WindowChars& wc) const {
    if (wc.width == 1) return true;  // ASCII
    if (wc.width == 2) return nfc_stable(wc.c16.data(), int64_t(wc.c16.size()));
    return nfc_stable(wc.c32.data(), int64_t(wc.c32.size()));
  }

  // Encode the window: on this thread, or in chunks on several (`more`: extra piece caches).
  int encode_window(const std::vector<uint8_t>& win, const WindowChars& wc, PieceCache& cache,
                    const std::vector<PieceCache*>& more, Scratch& sc, Output& out) const {
    // (an NFC family's window reaches here only once `nfc_stable` passed: no normalizer check)
    const bool check_nfc = t.nfc_marks == nullptr;
    if (wc.width == 1)
      return encode_window(win.data(), int64_t(win.size()), true, check_nfc, win, cache, more, sc, out);
    if (wc.width == 2)
      return encode_window(wc.c16.data(), int64_t(wc.c16.size()), false, check_nfc, win, cache, more, sc, out);
    return encode_window(wc.c32.data(), int64_t(wc.c32.size()), false, check_nfc, win, cache, more, sc, out);
  }
  template <class T>
  int encode_window(const T* s, int64_t n, bool ascii, bool check_nfc, const std::vector<uint8_t>& win,
                    PieceCache& cache, const std::vector<PieceCache*>& more, Scratch& sc, Output& out) const {
    std::vector<int64_t> cuts;
    const int64_t nb = int64_t(win.size());
    if (!more.empty() && nb >= PARALLEL_MIN_BYTES && t.classes)
      chunk_cuts(s, n, win, std::min<int64_t>(int64_t(more.size()) + 1, nb / CHUNK_MIN_BYTES), cuts);
    if (cuts.empty()) return eng->encode<T>(s, n, ascii, check_nfc, cache, out);
    std::vector<PieceCache*> caches{&cache};
    caches.insert(caches.end(), more.begin(), more.begin() + int64_t(cuts.size()));
    std::vector<Output>& outs = sc.chunk_outs;  // reused: their capacity spares page faults
    std::vector<int64_t>& nbytes = sc.chunk_bytes;
    // starts only where the caller wants them (the lane makes its own in `tile`)
    const bool ws = out.want_starts;
    const int st = eng->encode_chunks<T>(s, n, ascii, cuts, caches, ws, outs, nbytes, check_nfc);
    if (st != OK) return st;
    size_t total = out.ids.size();
    for (const Output& o : outs) total += o.ids.size();
    out.ids.reserve(total);
    int64_t base = 0;
    for (size_t i = 0; i < outs.size(); ++i) {
      out.ids.insert(out.ids.end(), outs[i].ids.begin(), outs[i].ids.end());
      if (ws)
        for (int64_t x : outs[i].starts) out.starts.push_back(x + base);
      base += nbytes[i];
    }
    return OK;
  }

  // The first-window splice of replacing bytes [s, e) of T by `data` (see the file comment).
  int edit(const uint8_t* T, int64_t n_old, int64_t s, int64_t e, const uint8_t* data, int64_t n_data,
           const Cached& C, int64_t wl, int64_t wr, PieceCache& cache, const std::vector<PieceCache*>& more,
           LaneResult& res) const {
    const int64_t N = C.N;
    const int64_t delta = n_data - (e - s);
    if (s >= 2 * wl && T[s - 1] < 0x80) {
      bool same = true;
      for (int64_t i = s - wl; i < s && same; ++i) same = T[i] == T[s - 1];
      if (same) return res.status = LANE_ONE_BYTE_RUN;
    }
    int64_t p = std::max<int64_t>(0, s - wl);
    while (p > 0 && (T[p] & 0xC0) == 0x80) --p;
    int64_t r = std::min<int64_t>(n_old, e + wr);
    while (r < n_old && (T[r] & 0xC0) == 0x80) ++r;
    // edges at cached token starts (`Session._token_edges`)
    int64_t k, st;
    if (p > 0) {
      C.locate(p, k, st);
      if (k > 0) {
        int64_t q = C.start_of(k - 1);
        if (q <= p) p = q;
      }
    }
    if (r < n_old) {
      C.locate(r, k, st);
      int64_t q = k < N ? st : n_old;
      if (q >= r) r = q;
    }
    while (p > 0 && (T[p] & 0xC0) == 0x80) --p;
    while (r < n_old && (T[r] & 0xC0) == 0x80) ++r;
    p = std::min(p, s);
    r = std::max(r, e);
    // the window: new text [p, r + delta), in this thread's scratch buffers (reused: a fresh
    // allocation of a big window's buffers costs as much in page faults as encoding it)
    Scratch& sc = Scratch::mine();
    ScratchTrim trim(sc);
    std::vector<uint8_t>& win = sc.win;
    reserve_slack(win, size_t(s - p) + size_t(n_data) + size_t(r - e));
    win.assign(T + p, T + s);
    win.insert(win.end(), data, data + n_data);
    win.insert(win.end(), T + e, T + r);
    if (!decode_window(win.data(), int64_t(win.size()), sc.chars)) return res.status = LANE_BAD_UTF8;
    if (t.nfc_marks && !nfc_stable(win, sc.chars)) return res.status = LANE_NFC;
    Output& out = sc.out;
    out.ids.clear();
    out.starts.clear();
    out.want_starts = false;  // the pass below makes them, one record read per token
    if (encode_window(win, sc.chars, cache, more, sc, out) != OK) return res.status = LANE_NFC;
    const std::vector<uint32_t>& fresh = out.ids;
    const int64_t nf = int64_t(fresh.size());
    res.fresh = nf;
    if (const int st = tile(fresh, int64_t(win.size()), sc.starts)) return res.status = st;
    const int64_t* const fst = sc.starts.data();  // window-local byte starts
    // literal buffers: new text [lo, hi_old + delta), old text [lo, hi_old)
    const int64_t lo = std::max<int64_t>(0, p - t.max_literal);
    const int64_t hi_old = std::min<int64_t>(n_old, r + t.max_literal);
    std::vector<uint8_t>& buf_new = sc.buf_new;
    std::vector<uint8_t>& buf_old = sc.buf_old;
    buf_new.clear();
    buf_old.clear();
    if (!lit_bytes.empty()) {
      buf_old.assign(T + lo, T + hi_old);
      reserve_slack(buf_new, size_t(s - lo) + size_t(n_data) + size_t(hi_old - e));
      buf_new.assign(T + lo, T + s);
      buf_new.insert(buf_new.end(), data, data + n_data);
      buf_new.insert(buf_new.end(), T + e, T + hi_old);
    }
    // left side: cached tokens starting in [p, s), fresh ones starting before s
    int64_t lk = 0, lj = 0, lq = 0;
    if (p > 0) {
      int64_t k_lo, c0s, k_hi, c1s;
      C.locate(p, k_lo, c0s);
      C.locate(s, k_hi, c1s);
      std::vector<int64_t>& cs = sc.cut_starts;
      cs.clear();
      for (int64_t x = k_lo, a = c0s; x < k_hi; ++x) { cs.push_back(a); a += C.len(C.ids[x]); }
      int64_t nfl = 0;  // fresh tokens starting before s
      while (nfl < nf && fst[nfl] + p < s) ++nfl;
      std::vector<Run>& runs = sc.runs;
      runs_of(cs, C.ids + k_lo, fst, nfl, fresh, 0, p, runs);
      bool found = false;
      for (const Run& rn : runs) {
        if (rn.len < 2) continue;
        const int64_t last = rn.c0 + rn.len - 1;
        if (cs[last] + C.len(C.ids[k_lo + last]) - cs[rn.c0] <= t.max_token_bytes) continue;
        for (int64_t m = last; m >= rn.c0 + 1; --m) {  // the latest certified start wins
          const int64_t q = cs[m];
          if (q <= p || q >= s) continue;
          if (!certified(q, p, win, buf_new, buf_old, lo, q)) continue;
          lk = k_lo + m;
          lj = rn.f0 + (m - rn.c0);
          lq = q;
          found = true;
          break;
        }
        if (found) break;
      }
      if (!found) return res.status = LANE_NO_RUN;
    }
    // right side: cached tokens starting in [e, r), shifted to new coordinates; fresh ones
    // starting at or after the new middle's end
    const int64_t mid_end = s + n_data;
    int64_t rk = N, rj = nf, rq = n_old + delta;
    if (r < n_old) {
      int64_t k_lo, c0s, k_hi, c1s;
      C.locate(e, k_lo, c0s);
      C.locate(r, k_hi, c1s);
      std::vector<int64_t>& cs = sc.cut_starts;
      cs.clear();
      for (int64_t x = k_lo, a = c0s; x < k_hi; ++x) { cs.push_back(a + delta); a += C.len(C.ids[x]); }
      int64_t j_lo = 0;
      while (j_lo < nf && fst[j_lo] + p < mid_end) ++j_lo;
      std::vector<Run>& runs = sc.runs;
      runs_of(cs, C.ids + k_lo, fst, nf, fresh, j_lo, p, runs);
      bool found = false;
      for (const Run& rn : runs) {
        if (rn.len < 2) continue;
        const int64_t last = rn.c0 + rn.len - 1;
        if (cs[last] + C.len(C.ids[k_lo + last]) - cs[rn.c0] <= t.max_token_bytes) continue;
        for (int64_t m = rn.c0 + 1; m <= last; ++m) {  // the earliest certified start wins
          const int64_t q = cs[m];
          if (q <= mid_end) continue;
          if (!certified(q, p, win, buf_new, buf_old, lo, q - delta)) continue;
          rk = k_lo + m;
          rj = rn.f0 + (m - rn.c0);
          rq = q;
          found = true;
          break;
        }
        if (found) break;
      }
      if (!found) return res.status = LANE_NO_RUN;
    }
    if (lj > rj) return res.status = LANE_NO_RUN;
    res.k1 = lk;
    res.k2 = rk;
    res.q = lq;
    res.q2 = rq;
    res.mid = fresh.data() + lj;  // (out.ids: kept until this thread's next edit)
    res.n_mid = rj - lj;
    return res.status = LANE_OK;
  }

  // -- the commit, in place over the session's buffers -----------------------------------------
  struct Buffers {
    uint32_t* ids;     // the session's id buffer: ids[0, n) used, capacity `cap`
    int64_t n, cap;
    uint32_t* cp;      // its checkpoints: cp[0, n_cp) used, capacity `cp_cap`
    int64_t n_cp, cp_cap, stride;
  };

  // First index where ids[0, n) with [k1, k2) replaced by `mid` differs from ids itself
  // (`session._first_difference`): the work follows the answer's distance from k1.
  static int64_t first_difference(const uint32_t* ids, int64_t n, int64_t k1, int64_t k2, const uint32_t* mid,
                                  int64_t lm) {
    const int64_t new_n = n - (k2 - k1) + lm, m = std::min(n, new_n);
    for (int64_t x = k1; x < m; ++x) {
      const int64_t i = x - k1;
      const uint32_t now = i < lm ? mid[i] : ids[k2 + (i - lm)];
      if (now != ids[x]) return x;
    }
    return m;
  }

  // Splice `res.mid` into the buffers (ids[k1, k2) replaced) and rebuild the checkpoints from
  // token k1, whose byte start is res.q.  Returns false, touching nothing, when a buffer is too
  // small (the caller grows it and commits the slow way).  No allocation, so it cannot fail
  // half-way.
  bool commit(const LaneResult& res, Buffers& b, int64_t& first_changed) const {
    const int64_t k1 = res.k1, k2 = res.k2, lm = res.n_mid;
    const int64_t new_n = b.n - (k2 - k1) + lm;
    const int64_t new_cp = (new_n + b.stride - 1) / b.stride;
    if (new_n > b.cap || new_cp > b.cp_cap) return false;
    first_changed = first_difference(b.ids, b.n, k1, k2, res.mid, lm);
    if (k2 < b.n && k1 + lm != k2)
      std::memmove(b.ids + k1 + lm, b.ids + k2, size_t(b.n - k2) * sizeof(uint32_t));
    if (lm) std::memcpy(b.ids + k1, res.mid, size_t(lm) * sizeof(uint32_t));
    // checkpoints before k1 stay: the tokens before the splice did not move
    int64_t j = (k1 + b.stride - 1) / b.stride, x = k1, st = res.q;
    for (; j < new_cp; ++j) {
      for (const int64_t to = j * b.stride; x < to; ++x) st += clen(b.ids[x]);
      b.cp[j] = uint32_t(st);
    }
    b.n = new_n;
    b.n_cp = new_cp;
    return true;
  }
};

}  // namespace ttn
