// TokTier native engine: the CPU twin of the GPU path's algorithm, sequential and compiled.
//
// One call encodes one text the way the reference does (HF `tokenizers` / tiktoken):
//   1. added-token literals, leftmost-longest, first the non-normalized ones, then the
//      normalized ones in the gaps (a code-point trie each);
//   2. each gap is pre-tokenized by a hand-written scanner per rule set that follows the
//      family's regex alternative by alternative (leftmost-first, greedy, with the exact
//      backtracking each alternative can do), reading only the probed class table; for the
//      cl100k-like and o200k rule sets, ASCII stretches go 128 characters at a time through
//      class bitmasks instead (`pretok_block`), where the table allows it;
//   3. each piece is BPE-encoded: whole-piece vocab lookup where the reference does it,
//      else the leftmost lowest-rank merge, one merge at a time (a heap for long pieces,
//      ordered as HF's `Word::merge_all` orders it), through a per-thread piece cache.
// Everything the scanner and BPE read (class table, pair and vocab hash tables, token
// bytes) is built and certified in Python (toktier/native/__init__.py) and only borrowed
// here: this file owns no tokenizer data and no global state.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <queue>
#include <thread>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>  // x86-64's baseline: no runtime dispatch needed
#endif

#include "workers.hpp"

namespace ttn {

// class-table bits (toktier/charclass.py)
constexpr uint32_t L = 1, N = 2, M = 4, W = 8, K = 16, UP = 32, LO = 64, PS = 128;
constexpr uint32_t FOLD_SHIFT = 8, NFC_INERT = 1u << 16;

enum Rules : int { CL100K_HF = 0, CL100K_TT = 1, QWEN = 2, O200K = 3, DEEPSEEK = 4 };

#ifndef PREFETCH
#define PREFETCH 1
#endif

// A software prefetch of p's cache line that the compiler keeps.  GCC 12 at -O3 deleted the
// `__builtin_prefetch` calls that were the only statements under a branch (`prefetch_vocab`'s,
// under `t.whole_piece_lookup`): until 2026-12-04 the short-vocab and vocab prefetches were not
// in the binary at all (objdump: one prefetch instruction in `encode_pieces`, the piece
// cache's).  A volatile asm statement is never deleted.
static inline void prefetch_line(const void* p) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm volatile("prfm pldl1keep, [%0]" : : "r"(p));
#else
  __builtin_prefetch(p);
#endif
}
constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
constexpr uint64_t EMPTY64 = ~0ull;
constexpr uint32_t EMPTY32 = ~0u;
constexpr uint64_t FNV_OFFSET = 0xCBF29CE484222325ull, FNV_PRIME = 0x100000001B3ull;

struct Tables {
  const uint32_t* cls = nullptr;  // [0x110000]
  const uint32_t* byte_to_id = nullptr;  // [256]
  const uint64_t* pair_keys = nullptr;
  const uint32_t* pair_rank = nullptr;
  const uint32_t* pair_merged = nullptr;
  int pair_bits = 0;
  const uint64_t* vocab_keys = nullptr;
  const uint32_t* vocab_ids = nullptr;
  int vocab_bits = 0;
  const uint32_t* tok_off = nullptr;
  const uint8_t* tok_blob = nullptr;
  int max_piece_lookup = 0;
  bool whole_piece_lookup = false;
  int rules = CL100K_HF;
};

// Equality of two short byte strings, inline: the hash and length already matched, so this is
// nearly always a full compare, and a libc call per piece cost more than the compare itself.
static inline bool same_bytes(const uint8_t* a, const uint8_t* b, uint32_t n) {
  while (n >= 8) {
    uint64_t x, y;
    std::memcpy(&x, a, 8);
    std::memcpy(&y, b, 8);
    if (x != y) return false;
    a += 8; b += 8; n -= 8;
  }
  if (n >= 4) {
    uint32_t x, y;
    std::memcpy(&x, a, 4);
    std::memcpy(&y, b, 4);
    if (x != y) return false;
    a += 4; b += 4; n -= 4;
  }
  while (n--) if (*a++ != *b++) return false;
  return true;
}

// -- big tables, on huge pages where the kernel offers them ------------------------------------
// The hot per-token tables (short vocab, token records, piece cache) are read at random, a few
// lines per token; with 4 KiB pages nearly every such read of a window encoded with cold caches
// also misses the TLB.  Backed by 2 MiB pages (MADV_HUGEPAGE) they cost one miss each.
template <class T>
class HugeArray {
 public:
  HugeArray() = default;
  explicit HugeArray(size_t n) { allocate(n); }
  HugeArray(const HugeArray&) = delete;
  HugeArray& operator=(const HugeArray&) = delete;
  ~HugeArray() { release(); }

  // n zero-filled elements (T must be trivially constructible from zero bytes)
  void allocate(size_t n) {
    release();
    n_ = n;
    const size_t bytes = std::max<size_t>(n * sizeof(T), 1);
#ifdef __linux__
    constexpr size_t HUGE = size_t(2) << 20;
    if (bytes >= HUGE / 2) {
      map_bytes_ = (bytes + HUGE - 1) / HUGE * HUGE + HUGE;  // room to align to a huge page
      void* m = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      map_ = m;
      uintptr_t a = (reinterpret_cast<uintptr_t>(m) + HUGE - 1) & ~(uintptr_t(HUGE) - 1);
      madvise(reinterpret_cast<void*>(a), map_bytes_ - HUGE, MADV_HUGEPAGE);  // advice only
      p_ = reinterpret_cast<T*>(a);
      return;
    }
#endif
    p_ = static_cast<T*>(::operator new(bytes));
    std::memset(static_cast<void*>(p_), 0, bytes);
  }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }
  T* begin() { return p_; }
  T* end() { return p_ + n_; }
  const T* data() const { return p_; }

 private:
  void release() {
#ifdef __linux__
    if (map_) { munmap(map_, map_bytes_); map_ = nullptr; p_ = nullptr; n_ = 0; return; }
#endif
    if (p_) ::operator delete(static_cast<void*>(p_));
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
};

// -- literal tries (over code points) ---------------------------------------------------------
struct Trie {
  // Edges (node << 21 | cp) -> child in one open-addressed array (at most half full): a step of
  // `longest` is one probe into it, where a node-based map's bucket, node and next pointers were
  // several dependent misses a step once a session op finds its caches cold.
  struct Edge { uint64_t key; int32_t child; };
  std::vector<Edge> edges = std::vector<Edge>(16, Edge{EMPTY_EDGE, -1});
  size_t n_edges = 0;
  static constexpr uint64_t EMPTY_EDGE = ~0ull;  // no key: a code point takes 21 bits
  size_t slot_of(uint64_t key) const {
    const size_t m = edges.size() - 1;
    size_t j = size_t((key * GOLDEN) >> 40) & m;
    while (edges[j].key != key && edges[j].key != EMPTY_EDGE) j = (j + 1) & m;
    return j;
  }
  int32_t child_of(uint64_t key) const {
    const Edge& e = edges[slot_of(key)];
    return e.key == key ? e.child : -1;
  }
  void put_edge(uint64_t key, int32_t child) {
    if (2 * (n_edges + 1) > edges.size()) {
      std::vector<Edge> old(2 * edges.size(), Edge{EMPTY_EDGE, -1});
      old.swap(edges);
      for (const Edge& e : old)
        if (e.key != EMPTY_EDGE) edges[slot_of(e.key)] = e;
    }
    edges[slot_of(key)] = Edge{key, child};
    ++n_edges;
  }
  std::vector<int64_t> term{-1};  // node -> literal id or -1
  std::vector<uint64_t> first_ascii{0, 0};  // bitmap of ASCII first code points
  std::vector<uint32_t> first_other;  // sorted non-ASCII first code points
  uint32_t first4[4] = {0, 0, 0, 0};  // the first ASCII first code points (`next_candidate`)
  int n_first_ascii = 0;

  void add(const uint32_t* cps, int64_t n, int64_t id) {
    if (n <= 0) return;
    int32_t node = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t key = (uint64_t(node) << 21) | cps[i];
      const int32_t found = child_of(key);
      if (found < 0) {
        const int32_t child = int32_t(term.size());
        term.push_back(-1);
        put_edge(key, child);
        node = child;
      } else {
        node = found;
      }
    }
    term[node] = id;
    uint32_t c0 = cps[0];
    if (c0 < 128) {
      if (!((first_ascii[c0 >> 6] >> (c0 & 63)) & 1)) {
        if (n_first_ascii < 4) first4[n_first_ascii] = c0;
        ++n_first_ascii;
      }
      first_ascii[c0 >> 6] |= 1ull << (c0 & 63);
    } else if (!std::binary_search(first_other.begin(), first_other.end(), c0)) {
      first_other.insert(std::upper_bound(first_other.begin(), first_other.end(), c0), c0);
    }
  }
  bool empty() const { return term.size() == 1; }
  // The first position from i (below n) whose character may start a literal, or n.  With at
  // most four ASCII first characters (every family's literals start with '<' or so), 16 bytes
  // are compared at a time (SSE2), with up to four non-ASCII first characters too; past those,
  // any character outside ASCII counts as a candidate and `may_start` decides it.  A scan per
  // character cost 6-9% of an encode.
  template <class T>
  int64_t next_candidate(const T* s, int64_t i, int64_t n) const {
#if defined(__SSE2__)
    const int k = n_first_ascii;
    if (k >= 1 && k <= 4) {
      uint32_t firsts[4];
      for (int j = 0; j < 4; ++j) firsts[j] = first4[j < k ? j : 0];
      constexpr int per = 16 / int(sizeof(T));
      // Non-ASCII first characters: up to four that a T can hold are compared exactly (DeepSeek's
      // '｜'), so other non-ASCII text is not a candidate at every character (its literal scan
      // of mixed text went per character: 3 ms per 1M); more, and any non-ASCII one is.
      uint32_t others[4];
      int n_others = 0;
      bool other = false;
      for (uint32_t c : first_other) {
        if (sizeof(T) < 4 && c >= (1u << (8 * sizeof(T)))) continue;  // a str of this width never holds it
        if (n_others == 4) {
          other = true;
          break;
        }
        others[n_others++] = c;
      }
      for (int j = n_others; j < 4; ++j) others[j] = n_others ? others[0] : firsts[0];
      __m128i f[4], g[4], high;
      for (int j = 0; j < 4; ++j) {
        f[j] = sizeof(T) == 1 ? _mm_set1_epi8(char(firsts[j])) : sizeof(T) == 2 ? _mm_set1_epi16(short(firsts[j]))
                                                                                : _mm_set1_epi32(int(firsts[j]));
        g[j] = sizeof(T) == 1 ? _mm_set1_epi8(char(others[j])) : sizeof(T) == 2 ? _mm_set1_epi16(short(others[j]))
                                                                                : _mm_set1_epi32(int(others[j]));
      }
      const bool exact_others = !other && n_others > 0;
      high = sizeof(T) == 1 ? _mm_set1_epi8(char(0x80)) : sizeof(T) == 2 ? _mm_set1_epi16(short(0xFF80))
                                                                           : _mm_set1_epi32(int(0xFFFFFF80u));
      const __m128i zero = _mm_setzero_si128();
      for (; i + per <= n; i += per) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        __m128i hit;
        if (sizeof(T) == 1) {
          hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, f[0]), _mm_cmpeq_epi8(x, f[1])),
                             _mm_or_si128(_mm_cmpeq_epi8(x, f[2]), _mm_cmpeq_epi8(x, f[3])));
          if (exact_others)
            hit = _mm_or_si128(hit, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, g[0]), _mm_cmpeq_epi8(x, g[1])),
                                                 _mm_or_si128(_mm_cmpeq_epi8(x, g[2]), _mm_cmpeq_epi8(x, g[3]))));
          if (other) hit = _mm_or_si128(hit, _mm_xor_si128(_mm_cmpeq_epi8(_mm_and_si128(x, high), zero), _mm_set1_epi8(-1)));
        } else if (sizeof(T) == 2) {
          hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi16(x, f[0]), _mm_cmpeq_epi16(x, f[1])),
                             _mm_or_si128(_mm_cmpeq_epi16(x, f[2]), _mm_cmpeq_epi16(x, f[3])));
          if (exact_others)
            hit = _mm_or_si128(hit, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi16(x, g[0]), _mm_cmpeq_epi16(x, g[1])),
                                                 _mm_or_si128(_mm_cmpeq_epi16(x, g[2]), _mm_cmpeq_epi16(x, g[3]))));
          if (other) hit = _mm_or_si128(hit, _mm_xor_si128(_mm_cmpeq_epi16(_mm_and_si128(x, high), zero), _mm_set1_epi8(-1)));
        } else {
          hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi32(x, f[0]), _mm_cmpeq_epi32(x, f[1])),
                             _mm_or_si128(_mm_cmpeq_epi32(x, f[2]), _mm_cmpeq_epi32(x, f[3])));
          if (exact_others)
            hit = _mm_or_si128(hit, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi32(x, g[0]), _mm_cmpeq_epi32(x, g[1])),
                                                 _mm_or_si128(_mm_cmpeq_epi32(x, g[2]), _mm_cmpeq_epi32(x, g[3]))));
          if (other) hit = _mm_or_si128(hit, _mm_xor_si128(_mm_cmpeq_epi32(_mm_and_si128(x, high), zero), _mm_set1_epi8(-1)));
        }
        const uint32_t m = uint32_t(_mm_movemask_epi8(hit));
        if (m) return i + int64_t(__builtin_ctz(m) / int(sizeof(T)));
      }
    }
#endif
    for (; i < n; ++i)
      if (may_start(uint32_t(s[i]))) return i;
    return n;
  }
  bool may_start(uint32_t c) const {
    if (c < 128) return (first_ascii[c >> 6] >> (c & 63)) & 1;
    return !first_other.empty() && std::binary_search(first_other.begin(), first_other.end(), c);
  }
  // Longest literal starting at i (its end), or -1; `id` receives its id.
  template <class T>
  int64_t longest(const T* s, int64_t i, int64_t n, int64_t& id) const {
    int32_t node = 0;
    int64_t best = -1;
    for (int64_t j = i; j < n; ++j) {
      const int32_t child = child_of((uint64_t(node) << 21) | uint32_t(s[j]));
      if (child < 0) break;
      node = child;
      if (term[node] >= 0) { best = j + 1; id = term[node]; }
    }
    return best;
  }
};

struct Literal { int64_t a, b, id; };

template <class T>
void find_literals(const Trie& t, const T* s, int64_t lo, int64_t hi, std::vector<Literal>& out) {
  int64_t i = lo;
  while ((i = t.next_candidate(s, i, hi)) < hi) {
    if (t.may_start(uint32_t(s[i]))) {
      int64_t id = -1;
      int64_t e = t.longest(s, i, hi, id);
      if (e > 0) { out.push_back({i, e, id}); i = e; continue; }
    }
    ++i;
  }
}

// A vector whose resize leaves new elements uninitialized: the lane's scratch buffers are
// written in full right after they are sized, so zero-filling them first would be a wasted pass.
template <class T>
struct NoInit : std::allocator<T> {
  template <class U>
  struct rebind { using other = NoInit<U>; };
  NoInit() = default;
  template <class U>
  NoInit(const NoInit<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
  template <class U, class... A>
  void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(std::forward<A>(a)...); }
};
using U32Scratch = std::vector<uint32_t, NoInit<uint32_t>>;
using U64Scratch = std::vector<uint64_t, NoInit<uint64_t>>;
using U8Scratch = std::vector<uint8_t, NoInit<uint8_t>>;

// -- piece cache (lent to one call at a time by the Python side, `NativeEngine._take`) ---------
// One 64-byte line per entry, the piece's bytes and ids inline, so a lookup costs one cache
// line (prefetched a batch ahead, see `Engine::encode_pieces`): a session's window is re-encoded
// on every op, usually with its caches cold after other work, and each extra line is a miss.
struct PieceCache {
  static constexpr uint32_t MAX_BYTES = 26, MAX_IDS = 6;
  struct alignas(64) Slot {
    uint64_t h;
    uint8_t blen, nids, used, pad;
    uint32_t ids[MAX_IDS];
    uint8_t bytes[MAX_BYTES];
    uint8_t pad2[2];
  };
  static_assert(sizeof(Slot) == 64, "one cache line per entry");
  static constexpr size_t CAP = 1 << 16;  // 4 MiB; cleared when half full
  HugeArray<Slot> slots;
  size_t n_used = 0;
  uint64_t hits = 0, misses = 0;

  // The hot front (`Engine::encode_pieces`): what a piece of 2-16 bytes encoded to, when that
  // is 1-3 ids.  Real text repeats a few thousand pieces most of the time; their answers then
  // come from here, where the short vocab (8 MiB) and the slots above (4 MiB) are reads past L2
  // (on the Xeon VMs here a random read in 8 MiB takes ~150 ns, in 2 MiB ~18 ns).  The key is
  // the piece's bytes themselves (two zero-padded words and the length), so an entry is exact
  // or absent; the answer is a pure function of the bytes, as the slots' are.
  // Two ways per set, one set per cache line, the newest answer in way 0 and the one it
  // displaced in way 1: against the 16K direct-mapped entries of before, 2.5-5x fewer pieces
  // of a warm encode miss (per 1M characters: code 2,500 instead of 6,400, English 630 instead
  // of 3,000).
  struct alignas(32) Hot { uint64_t lo, hi; uint32_t ids[3]; uint8_t len, nids, pad[2]; };
  static_assert(sizeof(Hot) == 32, "two hot entries per cache line");
  static constexpr uint32_t HOT_MAX_BYTES = 16, HOT_MAX_IDS = 3;
  bool hot_steady = false;  // the last batch missed nothing (`Engine::encode_pieces`' choice of loop)
  bool hot_small = false;   // the encode under way is a short one (`Engine::SMALL_ENCODE`)
  static constexpr int HOT_SET_BITS = 15;  // 32K sets, 64K entries, 2 MiB (16: 4% faster on code, 4 MiB)
  HugeArray<Hot> hot = HugeArray<Hot>(size_t(2) << HOT_SET_BITS);  // zero-filled: len 0 is empty
  static inline size_t hot_set(uint64_t h) { return size_t(h >> (64 - HOT_SET_BITS)); }
  // piece (lo, hi, n)'s answer, ids w[0, k) (k <= HOT_MAX_IDS), into set `set`
  inline void hot_put(size_t set, uint64_t lo, uint64_t hi, uint32_t n, const uint32_t* w, uint32_t k) {
    Hot* const e = &hot[2 * set];
    if (e[0].len == n && ((e[0].lo ^ lo) | (e[0].hi ^ hi)) == 0) return;  // already the newest
    e[1] = e[0];
    e[0].lo = lo;
    e[0].hi = hi;
    e[0].ids[0] = w[0];
    e[0].ids[1] = k > 1 ? w[1] : 0;
    e[0].ids[2] = k > 2 ? w[2] : 0;
    e[0].len = uint8_t(n);
    e[0].nids = uint8_t(k);
  }

  // An encode's per-batch scratch (piece hashes, ids), kept with the cache lent to that call: a
  // fresh vector per call was a malloc and a zero-filling resize into cold memory per window.
  U64Scratch batch_hashes;
  U32Scratch batch_ids;
  U8Scratch piece_utf8;  // a converted text's pieces as UTF-8 (`encode`'s log), kept the same way

  PieceCache() : slots(CAP) {
    clear();
    // the hot front's pages are faulted in here, as `clear` does the slots', not by the first
    // encode lent this cache (a fresh 2 MiB mapping costs ~0.2 ms of faults)
    std::memset(static_cast<void*>(hot.begin()), 0, hot.size() * sizeof(Hot));
  }
  void clear() {
    for (Slot& sl : slots) sl.used = 0;
    n_used = 0;
  }
  static inline size_t home(uint64_t h) { return size_t((h * GOLDEN) >> 48) & (CAP - 1); }
  inline void prefetch(uint64_t h) const { prefetch_line(&slots[home(h)]); }
  const Slot* find(uint64_t h, const uint8_t* p, uint32_t n) const {
    if (n > MAX_BYTES) return nullptr;
    size_t i = home(h);
    while (true) {
      const Slot& sl = slots[i];
      if (!sl.used) return nullptr;
      if (sl.h == h && sl.blen == n && same_bytes(sl.bytes, p, n)) return &sl;
      i = (i + 1) & (CAP - 1);
    }
  }
  // Pieces longer than a slot holds: slots of offsets into byte and id arenas (two more lines
  // a lookup, for the rarer long pieces: indentation, long identifiers, digits, encoded data).
  struct Big { uint64_t h; uint32_t boff, blen, ioff, nids; };
  static constexpr size_t BIG_CAP = 1 << 16, BIG_MAX = 1024;
  std::vector<Big> big = std::vector<Big>(BIG_CAP, Big{EMPTY64, 0, 0, 0, 0});
  std::vector<uint8_t> big_bytes;
  std::vector<uint32_t> big_ids;
  size_t big_used = 0;

  // the id count copied to out (room for n ids), or 0 when absent
  uint32_t find_big(uint64_t h, const uint8_t* p, uint32_t n, uint32_t* out) const {
    size_t i = home(h) & (BIG_CAP - 1);
    while (true) {
      const Big& b = big[i];
      if (b.h == EMPTY64) return 0;
      if (b.h == h && b.blen == n && std::memcmp(&big_bytes[b.boff], p, n) == 0) {
        std::memcpy(out, &big_ids[b.ioff], b.nids * sizeof(uint32_t));
        return b.nids;
      }
      i = (i + 1) & (BIG_CAP - 1);
    }
  }
  void put_big(uint64_t h, const uint8_t* p, uint32_t n, const uint32_t* v, uint32_t nv) {
    if (n > BIG_MAX) return;
    if (big_used * 2 >= BIG_CAP || big_bytes.size() > (8u << 20)) {
      std::fill(big.begin(), big.end(), Big{EMPTY64, 0, 0, 0, 0});
      big_bytes.clear();
      big_ids.clear();
      big_used = 0;
    }
    size_t i = home(h) & (BIG_CAP - 1);
    while (big[i].h != EMPTY64) i = (i + 1) & (BIG_CAP - 1);
    big[i] = Big{h, uint32_t(big_bytes.size()), n, uint32_t(big_ids.size()), nv};
    big_bytes.insert(big_bytes.end(), p, p + n);
    big_ids.insert(big_ids.end(), v, v + nv);
    ++big_used;
  }

  // A piece of MAX_BYTES or fewer with more than MAX_IDS ids (a CJK run of 8 characters is 24
  // bytes and ~8 ids) keeps a slot too, marked IN_BIG, whose ids are in the long-piece table: a
  // short piece that misses the slots then costs no long-piece lookup.  (Until 2026-12-04 such
  // pieces went to that table, but only long pieces looked there: they never hit, and a CJK text
  // encoded twice re-merged one piece in nine, each adding a copy to that table.)
  static constexpr uint8_t IN_BIG = 0xFF;
  void put(uint64_t h, const uint8_t* p, uint32_t n, const uint32_t* v, uint32_t nv) {
    if (n > MAX_BYTES) { put_big(h, p, n, v, nv); return; }
    if (nv > MAX_IDS) {
      put_big(h, p, n, v, nv);
      nv = 0;  // the marker: no ids here
    }
    if (n_used * 2 >= CAP) clear();
    size_t i = home(h);
    while (slots[i].used) i = (i + 1) & (CAP - 1);
    Slot& sl = slots[i];
    sl.h = h;
    sl.blen = uint8_t(n);
    sl.nids = nv ? uint8_t(nv) : IN_BIG;
    sl.used = 1;
    std::memcpy(sl.bytes, p, n);
    std::memcpy(sl.ids, v, nv * sizeof(uint32_t));
    ++n_used;
  }
};

// -- the engine --------------------------------------------------------------------------------
struct Output {
  std::vector<uint32_t> ids;
  std::vector<int64_t> starts;  // byte offset of each token in the UTF-8 text
  bool want_starts = false;
};

enum Status : int { OK = 0, NEEDS_NFC = 1, SURROGATE = 2 };

// What `Engine::assemble_chunks` finds per chunk while it lays a session start out: the sum of
// its tokens' canonical byte lengths (`token_len`, `token_len_n` ids), whether one of them is
// flagged in `uncertain` (null: none is), and `bad`: an id past `token_len` (none comes from a
// built engine; the caller then takes the general path).
struct ChunkSums {
  std::vector<int64_t> len;
  std::vector<char> uncertain, bad;
  const uint32_t* token_len = nullptr;
  const uint8_t* uncertain_ids = nullptr;
  int64_t token_len_n = 0;
  // Optional (`Engine::len8` of the same tables): per id, its length when token_len would give
  // 1-255 and uncertain_ids 0, else 0 (then those two are read).  A start's walk reads one byte
  // per token from 128 KB instead of 4 + 1 from 640 KB that the encode pushed out of L2.
  const uint8_t* len8 = nullptr;
  size_t n_len8 = 0;
};

class Engine {
 public:
  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    Workers* w = workers_.load();
    if (w != nullptr && w->owned_here()) delete w;  // a forked child leaves its parent's pool (workers.hpp)
  }

  Tables t;
  Trie lit1, lit2;  // non-normalized, normalized literals
  bool nfc = false;  // NFC family: text with a non-inert character goes back to Python
  const uint32_t* lit_len = nullptr;  // unused placeholder for symmetry (literal byte lengths come from tok_off)

  inline uint32_t cls(uint32_t cp) const { return t.cls[cp]; }

  // The merge table again, key, rank and merged id in one 16-byte slot at the same index (same
  // probe sequence): a BPE miss does tens of pair lookups, and three parallel arrays made each
  // found pair three cache misses instead of one (`build_fast_tables`).
  struct alignas(16) PSlot { uint64_t key; uint32_t rank, merged; };
  static_assert(sizeof(PSlot) == 16, "four slots per cache line");
  HugeArray<PSlot> pslots;

  // A split-block Bloom filter of the merge keys (Parquet's layout: a key sets one bit in each of
  // the eight 32-bit words of one 32-byte block), 16-32 bits a key: 1 MB for Llama 3's 280K
  // merges, where the slots take 16 MB.  Most pairs a BPE of non-ASCII text looks up are no merge
  // (two CJK characters side by side); each was a cache miss in the slots, now a filter read
  // (`pair`).  A filter answers "maybe" for every key it holds, so it never hides a merge.
  // Asked only for pieces with non-ASCII bytes: an ASCII piece's pairs are mostly merges, and
  // the extra read cost cold English 8% (`bench.engine_speed --ab --cold`).
  std::vector<uint32_t> pfilter;
  uint64_t pf_blocks_mask = 0;
  static inline uint64_t pf_mix(uint64_t k) {  // murmur3's finalizer
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
  }
  static inline uint32_t pf_bit(uint32_t x, int i) {
    static constexpr uint32_t SALT[8] = {0x47b6137bU, 0x44974d91U, 0x8824ad5bU, 0xa2b7289dU,
                                         0x705495c7U, 0x2df1424bU, 0x9efc4947U, 0x5c6bfb31U};
    return 1u << ((x * SALT[i]) >> 27);
  }
  inline bool maybe_pair(uint64_t key) const {
    const uint64_t h = pf_mix(key);
    const uint32_t* b = pfilter.data() + ((h >> 32) & pf_blocks_mask) * 8;
    const uint32_t x = uint32_t(h);
    uint32_t miss = 0;
    for (int i = 0; i < 8; ++i) miss |= pf_bit(x, i) & ~b[i];
    return miss == 0;
  }
  void build_pair_filter(size_t n_keys) {
    size_t blocks = 1;
    while (blocks * 16 < n_keys) blocks <<= 1;  // 256 bits a block: at least 16 bits a key
    pfilter.assign(blocks * 8, 0);
    pf_blocks_mask = blocks - 1;
    const size_t cap = size_t(1) << t.pair_bits;
    for (size_t i = 0; i < cap; ++i) {
      if (t.pair_keys[i] == EMPTY64) continue;
      const uint64_t h = pf_mix(t.pair_keys[i]);
      uint32_t* b = pfilter.data() + ((h >> 32) & pf_blocks_mask) * 8;
      for (int j = 0; j < 8; ++j) b[j] |= pf_bit(uint32_t(h), j);
    }
  }

  // ASCII runs skipped 16 bytes at a time (`skip_ascii`), for each class mask a scanner runs over,
  // only where the probed table gives exactly these ASCII members to that mask (checked here, at
  // load): the fast path then reads nothing but what the table says.
  enum AsciiRun : int { ALPHA = 0, LOWER = 1 };  // [A-Za-z], [a-z]
  // (not for DeepSeek's L|M runs: its digit and K splits leave short segments, and there the
  // fast path measured 6% slower on file listings)
  bool run_alpha_L = false, run_lower_LO = false;

  void build_fast_tables() {
    const size_t cap = size_t(1) << t.pair_bits;
    pslots.allocate(cap);
    uint32_t top = 0;
    size_t n_keys = 0;
    for (size_t i = 0; i < cap; ++i) {
      pslots[i] = PSlot{t.pair_keys[i], t.pair_rank[i], t.pair_merged[i]};
      if (t.pair_keys[i] != EMPTY64) top = std::max(top, t.pair_rank[i]), ++n_keys;
    }
    small_keys = top < (1u << 25);
    build_pair_filter(n_keys);
    auto exact = [&](uint32_t mask, int kind) {
      for (uint32_t c = 0; c < 128; ++c) {
        const bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
        const bool want = kind == ALPHA ? lower || upper : lower;
        if (bool(t.cls[c] & mask) != want) return false;
      }
      return true;
    };
    mark_self_spelled();
    run_alpha_L = exact(L, ALPHA);
    run_lower_LO = exact(LO, LOWER);
    build_block();
  }

  // The first position from i (below b) whose character is not an ASCII letter of `kind`, or a
  // position from which fewer than 16 bytes are left: the scalar run continues from there (so a
  // non-ASCII letter simply ends the fast part).  One load, compare and bit scan per 16 bytes
  // instead of a table read and a branch per character, and no mispredicted loop exit.
  template <class T>
  static inline int64_t skip_ascii(const T* s, int64_t i, int64_t b, int kind) {
#if defined(__SSE2__)
    if (sizeof(T) > 2) return i;
    constexpr int per = 16 / int(sizeof(T));
    const __m128i fold = sizeof(T) == 1 ? _mm_set1_epi8(kind == ALPHA ? 0x20 : 0) : _mm_set1_epi16(kind == ALPHA ? 0x20 : 0);
    const __m128i base = sizeof(T) == 1 ? _mm_set1_epi8('a') : _mm_set1_epi16('a');
    const __m128i span = sizeof(T) == 1 ? _mm_set1_epi8(25) : _mm_set1_epi16(25);
    const __m128i zero = _mm_setzero_si128();
    while (i + per <= b) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i ok;
      if (sizeof(T) == 1) {  // (x | fold) - first <= 25, unsigned
        const __m128i d = _mm_sub_epi8(_mm_or_si128(x, fold), base);
        ok = _mm_cmpeq_epi8(_mm_subs_epu8(d, span), zero);
      } else {
        const __m128i d = _mm_sub_epi16(_mm_or_si128(x, fold), base);
        ok = _mm_cmpeq_epi16(_mm_subs_epu16(d, span), zero);
      }
      const uint32_t miss = ~uint32_t(_mm_movemask_epi8(ok)) & 0xFFFFu;
      if (miss) return i + int64_t(__builtin_ctz(miss) / int(sizeof(T)));
      i += per;
    }
#else
    (void)s; (void)b; (void)kind;
#endif
    return i;
  }

  template <class T>
  inline int64_t run_letters(const T* s, int64_t i, int64_t b, uint32_t any, bool fast, int kind) const {
    if (fast) i = skip_ascii(s, i, b, kind);
    return run(s, i, b, any);
  }

  // `filtered`: ask the filter first (for pieces where most pairs are no merge, see `pfilter`)
  template <bool filtered = false>
  inline uint32_t pair(uint32_t a, uint32_t b, uint32_t& merged) const {
    uint64_t key = (uint64_t(a) << 32) | b;
    if (filtered && !maybe_pair(key)) return EMPTY32;
    uint64_t i = (key * GOLDEN) >> (64 - t.pair_bits);
    const uint64_t m = (1ull << t.pair_bits) - 1;
    if (!pslots.empty()) {
      const PSlot* P = pslots.data();
      while (true) {
        const PSlot& sl = P[i];
        if (sl.key == key) { merged = sl.merged; return sl.rank; }
        if (sl.key == EMPTY64) return EMPTY32;
        i = (i + 1) & m;
      }
    }
    while (true) {
      uint64_t k = t.pair_keys[i];
      if (k == key) { merged = t.pair_merged[i]; return t.pair_rank[i]; }
      if (k == EMPTY64) return EMPTY32;
      i = (i + 1) & m;
    }
  }

  // Short vocab tokens again, each in one 32-byte slot with its bytes inline: a whole-piece
  // lookup reads one line instead of four (keys, ids, offsets, bytes), which is what a window
  // encoded with cold caches pays for.  Built once from the vocab table (`build_short_vocab`).
  static constexpr uint32_t SHORT_MAX = 18;
  struct alignas(32) VSlot { uint64_t h; uint32_t id; uint8_t len, used; uint8_t bytes[SHORT_MAX]; };
  static_assert(sizeof(VSlot) == 32, "two slots per cache line");
  HugeArray<VSlot> short_vocab;
  uint64_t short_mask = 0;
  int short_bits = 0;
  // A slot's `used`: USED, and SELF_SPELLED when the token's own bytes merge to that one token
  // (`mark_self_spelled`).  Which slots answer a whole-piece lookup (`short_accept`): every one
  // under whole-piece lookup (tiktoken, HF `ignore_merges`: the vocab is asked before any merge);
  // otherwise (HF merges first: Qwen, DeepSeek) only the self-spelled ones, whose answer is the
  // merges' own answer, computed once at load.  Most words of prose are one such token: a word
  // the piece cache has not seen costs one lookup instead of ~5 merges (16K of English with a
  // fresh piece cache: ~1,250 missed words, ~6,700 merges; 1,145 misses -> 146 for Qwen3).
  static constexpr uint8_t USED = 1, SELF_SPELLED = 2;
  uint8_t short_accept = USED;
  bool piece_lookup = false;  // some pieces are answered by a vocab lookup (see above)

  // One 16-byte record per token id, what the hot paths read per token (the byte length for
  // offsets, the repair lane's flags and spelling check, short tokens' bytes inline): one line
  // instead of three or four tables (`build_records`).
  static constexpr uint32_t REC_INLINE = 7;
  static constexpr uint8_t REC_UNCERTAIN = 1, REC_LEN_DIFFERS = 2;
  struct alignas(16) TokRec {
    uint32_t off;   // into tok_blob
    uint16_t blen;  // bytes in tok_blob
    uint16_t len;   // canonical byte length (the session's offsets)
    uint8_t flags;  // REC_*: the lane declines a fresh token with any flag
    uint8_t b[REC_INLINE];
  };
  static_assert(sizeof(TokRec) == 16, "four records per cache line");
  HugeArray<TokRec> recs;

  // token_len / uncertain: per id (the tokenizer's canonical lengths and unproven-span flags)
  void build_records(const uint32_t* token_len, const uint8_t* uncertain, int64_t n_ids, int64_t n_vocab) {
    recs.allocate(size_t(std::max(n_ids, n_vocab)));
    for (int64_t id = n_vocab; id < n_ids; ++id)  // ids without bytes: never spliced
      recs[size_t(id)].flags = REC_UNCERTAIN | REC_LEN_DIFFERS;
    for (int64_t id = 0; id < n_vocab; ++id) {
      TokRec& r = recs[size_t(id)];
      const uint32_t o = t.tok_off[id], n = t.tok_off[id + 1] - o;
      r.off = o;
      r.blen = uint16_t(std::min<uint32_t>(n, 0xFFFF));
      const uint32_t canon = id < n_ids ? token_len[id] : n;
      r.len = uint16_t(std::min<uint32_t>(canon, 0xFFFF));
      r.flags = 0;
      if (id >= n_ids || uncertain[id]) r.flags |= REC_UNCERTAIN;
      if (canon != n || n > 0xFFFF) r.flags |= REC_LEN_DIFFERS;
      std::memcpy(r.b, t.tok_blob + o, std::min<uint32_t>(n, REC_INLINE));
    }
    len8.assign(size_t(std::max<int64_t>(n_ids, 0)), 0);
    for (int64_t id = 0; id < n_ids; ++id)
      if (!uncertain[id] && token_len[id] >= 1 && token_len[id] <= 255) len8[size_t(id)] = uint8_t(token_len[id]);
  }
  // One byte per id (`build_records`' tables): token_len[id] where that is 1-255 and the id is
  // not uncertain, else 0 (`ChunkSums::len8`).
  std::vector<uint8_t> len8;
  size_t n_records() const { return recs.size(); }
  inline uint32_t blen(uint32_t id) const {
    if (recs.empty() || (recs[id].flags & REC_LEN_DIFFERS)) return t.tok_off[id + 1] - t.tok_off[id];
    return recs[id].blen;
  }

  void build_short_vocab() {
    size_t count = 0;
    const size_t cap = size_t(1) << t.vocab_bits;
    for (size_t i = 0; i < cap; ++i)
      if (t.vocab_ids[i] != EMPTY32) ++count;
    short_bits = 4;
    while ((size_t(1) << short_bits) < 2 * count + 16) ++short_bits;
    short_vocab.allocate(size_t(1) << short_bits);  // zero-filled: every slot unused
    short_mask = (uint64_t(1) << short_bits) - 1;
    for (size_t i = 0; i < cap; ++i) {
      const uint32_t id = t.vocab_ids[i];
      if (id == EMPTY32) continue;
      const uint32_t o = t.tok_off[id], n = t.tok_off[id + 1] - o;
      if (n > SHORT_MAX || n == 0) continue;
      const uint64_t h = piece_hash(t.tok_blob + o, n);
      uint64_t j = (h * GOLDEN) >> (64 - short_bits);
      while (short_vocab[j].used) j = (j + 1) & short_mask;
      VSlot& v = short_vocab[j];
      v.h = h;
      v.id = id;
      v.len = uint8_t(n);
      v.used = USED;
      std::memcpy(v.bytes, t.tok_blob + o, n);
    }
  }

  // Mark the short tokens whose own bytes BPE to themselves (`short_accept`); needs the merge
  // tables (`build_fast_tables` calls it).  Each token's merges run once, by the routines that
  // serve pieces, so a lookup answers exactly what the merges would.
  void mark_self_spelled() {
    piece_lookup = t.whole_piece_lookup;
    short_accept = t.whole_piece_lookup ? USED : SELF_SPELLED;
    if (short_vocab.empty() || t.whole_piece_lookup) return;  // (every slot answers: nothing to mark)
    uint32_t out[SHORT_MAX];
    for (VSlot& v : short_vocab) {
      if (!v.used || v.len < 2) continue;
      const uint32_t k = v.len <= SMALL_MAX && small_keys ? merge_small(v.bytes, v.len, out) : merge_heap(v.bytes, v.len, out);
      if (k == 1 && out[0] == v.id) v.used |= SELF_SPELLED;
    }
    piece_lookup = true;
  }

  // The ids whose short slot answers a lookup (tests: under merges first, the self-spelled ones)
  std::vector<uint32_t> short_answers() const {
    std::vector<uint32_t> ids;
    for (size_t j = 0; j < short_vocab.size(); ++j)
      if ((short_vocab[j].used & short_accept) && short_vocab[j].len >= 2) ids.push_back(short_vocab[j].id);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  // The one id a piece is, when a vocab lookup answers it (`short_accept`), else -1.  h: piece_hash
  inline int64_t vocab(uint64_t h, const uint8_t* p, uint32_t n) const {
    if (int(n) > t.max_piece_lookup) return -1;
    if (n <= SHORT_MAX && !short_vocab.empty()) {
      uint64_t lo = 0, hi = 0;
      if (n <= QUICK_MAX) quick_words(p, n, lo, hi);
      return short_vocab_id(h, lo, hi, p, n);
    }
    if (!t.whole_piece_lookup) return -1;
    if (n <= QUICK_MAX) h = fnv(p, n);  // (only without a short table)
    uint64_t i = (h * GOLDEN) >> (64 - t.vocab_bits);
    const uint64_t m = (1ull << t.vocab_bits) - 1;
    while (true) {
      uint64_t k = t.vocab_keys[i];
      if (k == EMPTY64) return -1;
      if (k == h) {
        uint32_t id = t.vocab_ids[i];
        if (id != EMPTY32) {
          uint32_t o = t.tok_off[id], e = t.tok_off[id + 1];
          if (e - o == n && same_bytes(t.tok_blob + o, p, n)) return id;
        }
      }
      i = (i + 1) & m;
    }
  }

  static inline uint64_t fnv(const uint8_t* p, uint32_t n) {
    uint64_t h = FNV_OFFSET;
    for (uint32_t i = 0; i < n; ++i) h = (h ^ p[i]) * FNV_PRIME;
    return h;
  }

  // The hash of a piece in the tables built here (short vocab, piece cache).  A piece of up to 16
  // bytes (nearly all of them) is read as two zero-padded little-endian words (`quick_words`)
  // and mixed with one 64x64->128 multiply: FNV-1a's serial multiply per byte, and the branches
  // on the length, cost more than the lookup they feed.  Longer pieces keep FNV-1a, the hash of
  // the Python-built vocab table they are looked up in.  Only speed depends on the hash: every
  // table compares the bytes.
  static constexpr uint32_t QUICK_MAX = 16;
  // An encode of fewer characters than this (a repair window, a big window's chunk, a short
  // text) runs every batch through `encode_pieces`' three passes, never its one-pass loop: such an
  // encode usually follows other work, and the hot entries it reads are then cold, which the one
  // pass reads one at a time while the three passes ask for a batch's lines at once.  A 16K
  // window after a 64 MB sweep: 0.255 -> 0.221 ms; back to back, too: 0.089 -> 0.083 ms.
  // (Required as "8 clean batches first" in every encode instead, listings and tables lost 4-9%:
  // sprinkled misses kept them from the one pass.)
  static constexpr int64_t SMALL_ENCODE = 32 * 1024;
  static inline void quick_words(const uint8_t* p, uint32_t n, uint64_t& lo, uint64_t& hi) {  // 1 <= n <= 16
    static constexpr uint64_t LO[17] = {0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF, 0xFFFFFFFFFF, 0xFFFFFFFFFFFF,
                                        0xFFFFFFFFFFFFFF, ~0ull, ~0ull, ~0ull, ~0ull, ~0ull, ~0ull, ~0ull, ~0ull, ~0ull};
    static constexpr uint64_t HI[17] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF, 0xFFFFFFFFFF,
                                        0xFFFFFFFFFFFF, 0xFFFFFFFFFFFFFF, ~0ull};
    if ((reinterpret_cast<uintptr_t>(p) & 4095) <= 4096 - 16) {
      // 16 bytes from p lie in p's page, so reading past the piece cannot fault; the extra
      // bytes are masked off (no branch on the length)
      std::memcpy(&lo, p, 8);
      std::memcpy(&hi, p + 8, 8);
      lo &= LO[n];
      hi &= HI[n];
    } else {
      uint8_t tmp[16] = {0};
      std::memcpy(tmp, p, n);
      std::memcpy(&lo, tmp, 8);
      std::memcpy(&hi, tmp + 8, 8);
    }
  }
  static inline uint64_t quick_mix(uint64_t lo, uint64_t hi, uint32_t n) {
#if defined(__SIZEOF_INT128__)
    const __uint128_t m = __uint128_t(lo ^ 0xA0761D6478BD642Full) * (hi ^ 0xE7037ED1A0B428DBull ^ (uint64_t(n) << 56));
    return uint64_t(m) ^ uint64_t(m >> 64);
#else  // compilers without 128-bit integers: two multiply-xorshift rounds
    uint64_t h = (lo ^ 0xA0761D6478BD642Full) * GOLDEN;
    h = (h ^ (h >> 29) ^ hi ^ (uint64_t(n) << 56)) * 0xE7037ED1A0B428DBull;
    return h ^ (h >> 32);
#endif
  }
  static inline uint64_t piece_hash(const uint8_t* p, uint32_t n) {
    uint64_t lo, hi;
    return piece_key(p, n, lo, hi);
  }

  // A piece's hash (`piece_hash`) and, when it has 16 bytes or fewer, its bytes as `quick_words`
  // (the hot front's key; else lo = hi = 0, which no hot entry holds).
  static inline uint64_t piece_key(const uint8_t* p, uint32_t n, uint64_t& lo, uint64_t& hi) {
    if (n <= QUICK_MAX) {
      quick_words(p, n, lo, hi);
      return quick_mix(lo, hi, n);
    }
    lo = hi = 0;
    return fnv(p, n);
  }

  // The hot front set a piece's answer goes to, or -1 when it never goes there (tests build
  // pieces that share a set with this).
  static int64_t hot_entry(const uint8_t* p, uint32_t n) {
    if (n < 2 || n > PieceCache::HOT_MAX_BYTES) return -1;
    return int64_t(PieceCache::hot_set(piece_hash(p, n)));
  }

  inline void prefetch_vocab(uint64_t h, uint32_t n) const {
    if (n <= SHORT_MAX && !short_vocab.empty()) {
      prefetch_line(&short_vocab[(h * GOLDEN) >> (64 - short_bits)]);
      return;
    }
    if (!t.whole_piece_lookup) return;  // (longer pieces are looked up only under whole-piece lookup)
    uint64_t i = (h * GOLDEN) >> (64 - t.vocab_bits);  // n > QUICK_MAX here: h is FNV-1a
    prefetch_line(t.vocab_keys + i);
    prefetch_line(t.vocab_ids + i);
  }

  // BPE of one piece's bytes (hash `h` = piece_hash) into w (room for n ids): the id count.
  // `looked_up`: the caller already found the piece missing from the vocab.
  uint32_t bpe_hashed(const uint8_t* p, uint32_t n, uint64_t h, PieceCache& cache, uint32_t* w,
                      bool looked_up = false) const {
    if (n == 1) { *w = t.byte_to_id[p[0]]; return 1; }
    if (piece_lookup && !looked_up) {  // most pieces are one vocab token: no cache entry for them
      int64_t id = vocab(h, p, n);
      if (id >= 0) { *w = uint32_t(id); return 1; }
    }
    bool marked = false;  // a short piece of many ids: its slot points to the long-piece table
    if (const PieceCache::Slot* sl = cache.find(h, p, n)) {
      if (sl->nids != PieceCache::IN_BIG) {
        ++cache.hits;
        std::memcpy(w, sl->ids, sl->nids * sizeof(uint32_t));
        return sl->nids;
      }
      marked = true;
    }
    if (marked || n > PieceCache::MAX_BYTES) {
      const uint32_t k = cache.find_big(h, p, n, w);
      if (k) { ++cache.hits; return k; }
    }
    ++cache.misses;
    const uint32_t k = n <= SMALL_MAX && small_keys ? merge_small(p, n, w) : merge_heap(p, n, w);
    if (marked) cache.put_big(h, p, n, w, k);  // (the long-piece table was cleared; the slot stays)
    else cache.put(h, p, n, w, k);
    return k;
  }

  void bpe(const uint8_t* p, uint32_t n, PieceCache& cache, std::vector<uint32_t>& out) const {
    const size_t base = out.size();
    out.resize(base + n);
    out.resize(base + bpe_hashed(p, n, piece_hash(p, n), cache, out.data() + base));
  }

  // `vocab`'s short-table probe for a piece of at most SHORT_MAX bytes, hash h, its bytes as
  // `quick_words` (lo, hi) when it has QUICK_MAX or fewer: the id, or -1
  inline int64_t short_vocab_id(uint64_t h, uint64_t lo, uint64_t hi, const uint8_t* p, uint32_t n) const {
    const VSlot* const sv = short_vocab.data();
    uint64_t j = (h * GOLDEN) >> (64 - short_bits);
    if (n <= QUICK_MAX) {  // a slot's bytes are zero-padded: two word compares
      while (true) {
        const VSlot& v = sv[j];
        if (!v.used) return -1;
        uint64_t vlo, vhi;
        std::memcpy(&vlo, v.bytes, 8);
        std::memcpy(&vhi, v.bytes + 8, 8);
        if (v.h == h && v.len == n && ((vlo ^ lo) | (vhi ^ hi)) == 0) return v.used & short_accept ? int64_t(v.id) : -1;
        j = (j + 1) & short_mask;
      }
    }
    while (true) {
      const VSlot& v = sv[j];
      if (!v.used) return -1;
      if (v.h == h && v.len == n && same_bytes(v.bytes, p, n)) return v.used & short_accept ? int64_t(v.id) : -1;
      j = (j + 1) & short_mask;
    }
  }

  // BPE of a batch of pieces of `buf` (byte start, length), in order: all hashes first, their
  // cache and vocab lines prefetched, then the lookups (a cold window's misses overlap).
  // A batch of pieces (byte start, length) in fixed room: a vector's emplace_back per piece was
  // an out-of-line call (4-6% of an encode).  Callers flush at CAP.
  struct PieceBatch {
    static constexpr size_t CAP = 256;
    std::pair<uint32_t, uint32_t> p[CAP];
    size_t n = 0;
    bool empty() const { return n == 0; }
    size_t size() const { return n; }
    const std::pair<uint32_t, uint32_t>& operator[](size_t i) const { return p[i]; }
    void emplace_back(uint32_t at, uint32_t len) { p[n++] = {at, len}; }
    void clear() { n = 0; }
  };

  void encode_pieces(const uint8_t* buf, const PieceBatch& pcs,
                     U64Scratch& hs, U32Scratch& scratch, PieceCache& cache,
                     std::vector<uint32_t>& out, std::vector<uint32_t>* first_tok) const {
    // Which pieces the hot front holds, two ways, chosen per batch by what the last batch of
    // this cache saw:
    // - it missed nothing (a table, a listing, text seen before): one pass, each piece's hash
    //   and its hot entry read and compared, a branch on the answer that is then always right;
    // - else three passes: every piece's hash, its hot line asked for; then the answers, with no
    //   branch on them (a mispredicted branch per miss stopped the loads of later pieces from
    //   overlapping: ~26% of `encode_pieces` in a `perf` profile of code); then only the pieces
    //   the hot front lacks prefetch their lines in the big tables, from a list.
    // Either way alone lost 14-30% on some content (RESULTS, 2026-12-04).
    hs.resize(pcs.size());
    int32_t at[PieceBatch::CAP];  // the hot entry that held piece i in this pass, or -1
    uint64_t los[PieceBatch::CAP], his[PieceBatch::CAP];  // its bytes as `quick_words` (n <= 16)
    uint16_t multi[PieceBatch::CAP], missed[PieceBatch::CAP];
    PieceCache::Hot* const hot = cache.hot.begin();
    size_t room = 0, n_cold = 0;
    if (cache.hot_steady && !cache.hot_small) {
      for (size_t i = 0; i < pcs.size(); ++i) {
        const uint8_t* p = buf + pcs[i].first;
        const uint32_t n = pcs[i].second;
        room += n;
        at[i] = -1;
        if (n <= QUICK_MAX) {  // (`piece_key` inline: calling it here cost tables 4-5%)
          uint64_t lo, hi;
          quick_words(p, n, lo, hi);
          los[i] = lo;
          his[i] = hi;
          hs[i] = quick_mix(lo, hi, n);
          if (n == 1) continue;
          const size_t k = 2 * PieceCache::hot_set(hs[i]);
          const PieceCache::Hot& e0 = hot[k];
          if (e0.len == n && ((e0.lo ^ lo) | (e0.hi ^ hi)) == 0) { at[i] = int32_t(k); continue; }
          const PieceCache::Hot& e1 = hot[k + 1];
          if (e1.len == n && ((e1.lo ^ lo) | (e1.hi ^ hi)) == 0) { at[i] = int32_t(k + 1); continue; }
        } else {
          los[i] = his[i] = 0;
          hs[i] = fnv(p, n);
        }
        ++n_cold;
        if (PREFETCH) {
          if (piece_lookup) prefetch_vocab(hs[i], n);
          cache.prefetch(hs[i]);
        }
      }
    } else {
      size_t n_multi = 0;
      for (size_t i = 0; i < pcs.size(); ++i) {
        const uint8_t* p = buf + pcs[i].first;
        const uint32_t n = pcs[i].second;
        room += n;
        at[i] = -1;
        // pieces of one byte (~40% of a table's or a listing's) take no part in the next pass
        multi[n_multi] = uint16_t(i);
        n_multi += size_t(n != 1);
        hs[i] = piece_key(p, n, los[i], his[i]);
        prefetch_line(&hot[2 * PieceCache::hot_set(hs[i])]);
      }
      size_t n_missed = 0;
      for (size_t j = 0; j < n_multi; ++j) {
        const size_t i = multi[j];
        const uint32_t n = pcs[i].second;
        const size_t k = 2 * PieceCache::hot_set(hs[i]);
        const PieceCache::Hot& e0 = hot[k];
        const PieceCache::Hot& e1 = hot[k + 1];
        // a hot entry's len is 2-16, so a piece of more than 16 bytes never matches
        const bool hit0 = (e0.len == n) & (((e0.lo ^ los[i]) | (e0.hi ^ his[i])) == 0);
        const bool hit1 = (e1.len == n) & (((e1.lo ^ los[i]) | (e1.hi ^ his[i])) == 0);
        const uint32_t miss = uint32_t(!(hit0 | hit1));
        // arithmetic, not a select: the compiler made `hit ? .. : -1` a branch on which way held it
        at[i] = int32_t(uint32_t(k + !hit0) | (0u - miss));
        missed[n_missed] = uint16_t(i);
        n_missed += miss;
      }
      if (PREFETCH) {
        for (size_t m = 0; m < n_missed; ++m) {
          // a piece the hot front lacks is often not one vocab token either (an unseen
          // identifier): its piece cache line is read next, so both lines are asked for
          const size_t i = missed[m];
          if (piece_lookup) prefetch_vocab(hs[i], pcs[i].second);
          cache.prefetch(hs[i]);
        }
      }
      n_cold = n_missed;
    }
    cache.hot_steady = n_cold == 0;
    // Ids are written through a pointer (at most one per byte) into `scratch`, then appended: a
    // push_back per token was an out-of-line call, and growing `out` by `room` first zero-filled
    // four bytes per text byte (a memset ~6% of an encode) for ~4 bytes per token kept.  (+3: a
    // hot hit stores all three of its id words.)
    const size_t base = out.size();
    if (scratch.size() < room + 3) scratch.resize(std::max(room + 3, 2 * scratch.size()));
    uint32_t* const w0 = scratch.data();
    uint32_t* w = w0;
    const bool short_ok = piece_lookup && !short_vocab.empty();
    const uint32_t short_lim = std::min<uint32_t>(SHORT_MAX, uint32_t(std::max(t.max_piece_lookup, 0)));
    for (size_t i = 0; i < pcs.size(); ++i) {
      if (first_tok) first_tok->push_back(uint32_t(base + size_t(w - w0)));
      const uint8_t* p = buf + pcs[i].first;
      const uint32_t n = pcs[i].second;
      if (n == 1) { *w++ = t.byte_to_id[p[0]]; continue; }
      if (at[i] >= 0) {
        const PieceCache::Hot& e = hot[at[i]];
        // still this piece's: a miss earlier in this batch may have taken the entry since
        if (e.len == n && ((e.lo ^ los[i]) | (e.hi ^ his[i])) == 0) {
          w[0] = e.ids[0];
          w[1] = e.ids[1];
          w[2] = e.ids[2];
          w += e.nids;
          continue;
        }
      }
      uint32_t* const wp = w;
      const bool looked_up = short_ok && n <= short_lim;
      const int64_t id = looked_up ? short_vocab_id(hs[i], los[i], his[i], p, n) : -1;
      if (id >= 0) *w++ = uint32_t(id);
      else w += bpe_hashed(p, n, hs[i], cache, w, looked_up);
      const uint32_t k = uint32_t(w - wp);
      if (n <= PieceCache::HOT_MAX_BYTES && k <= PieceCache::HOT_MAX_IDS) {
        cache.hot_put(PieceCache::hot_set(hs[i]), los[i], his[i], n, wp, k);
      }
    }
    out.insert(out.end(), w0, w);
    // a batch holding a huge piece (a 100K-character run) grew it: not kept with the cache
    if (scratch.capacity() > (size_t(1) << 18)) U32Scratch().swap(scratch);
  }

  // Short pieces (SMALL_MAX bytes at most) under tiktoken's rule: the leftmost lowest-rank pair,
  // merged one at a time.  ASCII pieces take tiktoken's own loop (`merge_shift`).  Pieces with
  // other bytes (a CJK run is a few tens of bytes, and most of its pairs are no merge) take
  // `merge_linked`: a linked list of the piece's bytes, each pair keyed rank << 6 | the position
  // of its first byte, so the leftmost lowest pair is the smallest key (positions grow along the
  // list), found by a branch-free scan the compiler vectorizes; a merge shifts nothing, and the
  // pair lookups ask the filter first.  Both together: cold CJK encodes 1.14-1.38x faster
  // (`bench.engine_speed --ab --cold`); the linked list cost ASCII code 6-12%, hence the two.
  // Needs every rank below 2^25 (`small_keys`, checked at load; else merge_heap does all).
  static constexpr uint32_t SMALL_MAX = 48;
  static constexpr int32_t NO_PAIR = INT32_MAX;
  bool small_keys = false;
  template <bool filtered>
  inline int32_t pair_key(uint32_t a, uint32_t b, uint32_t pos, uint32_t& merged) const {
    const uint32_t r = pair<filtered>(a, b, merged);
    return r == EMPTY32 ? NO_PAIR : int32_t((r << 6) | pos);
  }
  static inline bool has_high_byte(const uint8_t* p, uint32_t n) {
    uint8_t high = 0;
    for (uint32_t i = 0; i < n; ++i) high |= p[i];
    return high & 0x80;
  }
  uint32_t merge_small(const uint8_t* p, uint32_t n, uint32_t* out) const {
    if (!has_high_byte(p, n)) return merge_shift(p, n, out);
    return pfilter.empty() ? merge_linked<false>(p, n, out) : merge_linked<true>(p, n, out);
  }
  template <bool filtered>
  uint32_t merge_linked(const uint8_t* p, uint32_t n, uint32_t* out) const {
    uint32_t ids[SMALL_MAX], merged[SMALL_MAX];
    int32_t key[SMALL_MAX];
    uint8_t nxt[SMALL_MAX], prv[SMALL_MAX];
    for (uint32_t i = 0; i < n; ++i) {
      ids[i] = t.byte_to_id[p[i]];
      nxt[i] = uint8_t(i + 1);
      prv[i] = uint8_t(i - 1);  // 255 before the first
    }
    // the scan covers the pairs' slots rounded up to 8 (whole vectors), the rest padded
    const uint32_t lim = std::min<uint32_t>((n + 6) & ~7u, SMALL_MAX);
    for (uint32_t i = 0; i + 1 < n; ++i) key[i] = pair_key<filtered>(ids[i], ids[i + 1], i, merged[i]);
    for (uint32_t i = n - 1; i < lim; ++i) key[i] = NO_PAIR;
    while (true) {
      int32_t best = NO_PAIR;
      for (uint32_t i = 0; i < lim; ++i) best = key[i] < best ? key[i] : best;
      if (best == NO_PAIR) break;
      const uint32_t a = uint32_t(best) & 63, b = nxt[a];
      ids[a] = merged[a];
      key[b] = NO_PAIR;  // b is gone: it starts no pair
      const uint32_t c = nxt[b];
      nxt[a] = uint8_t(c);
      if (c < n) {
        prv[c] = uint8_t(a);
        key[a] = pair_key<filtered>(ids[a], ids[c], a, merged[a]);
      } else {
        key[a] = NO_PAIR;
      }
      if (a > 0) {  // position 0 is never merged away, so a > 0 has a predecessor
        const uint32_t pa = prv[a];
        key[pa] = pair_key<filtered>(ids[pa], ids[a], pa, merged[pa]);
      }
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i = nxt[i]) out[k++] = ids[i];
    return k;
  }

  // tiktoken's loop as tiktoken writes it: the leftmost lowest-rank pair found by a scan, merged
  // by shifting the arrays (O(n^2)): the fastest for ASCII pieces, which are short.
  uint32_t merge_shift(const uint8_t* p, uint32_t n, uint32_t* out) const {
    uint32_t ids[48], rank[48], merged[48];
    uint32_t m = n;
    for (uint32_t i = 0; i < n; ++i) ids[i] = t.byte_to_id[p[i]];
    for (uint32_t i = 0; i + 1 < m; ++i) rank[i] = pair(ids[i], ids[i + 1], merged[i]);
    while (m > 1) {
      uint32_t best = EMPTY32, at = 0;
      for (uint32_t i = 0; i + 1 < m; ++i)
        if (rank[i] < best) { best = rank[i]; at = i; }
      if (best == EMPTY32) break;
      ids[at] = merged[at];
      for (uint32_t i = at + 1; i + 1 < m; ++i) { ids[i] = ids[i + 1]; rank[i] = rank[i + 1]; merged[i] = merged[i + 1]; }
      --m;
      if (at > 0) rank[at - 1] = pair(ids[at - 1], ids[at], merged[at - 1]);
      if (at + 1 < m) rank[at] = pair(ids[at], ids[at + 1], merged[at]);
    }
    std::memcpy(out, ids, m * sizeof(uint32_t));
    return m;
  }

  // HF's `Word::merge_all`: a min-heap of (rank, position) with stale entries skipped (O(n log n)).
  uint32_t merge_heap(const uint8_t* p, uint32_t n, uint32_t* out) const {
    const bool filtered = has_high_byte(p, n) && !pfilter.empty();
    return filtered ? merge_heap_as<true>(p, n, out) : merge_heap_as<false>(p, n, out);
  }
  template <bool filtered>
  uint32_t merge_heap_as(const uint8_t* p, uint32_t n, uint32_t* out) const {
    struct E { uint32_t rank, pos, merged; };
    struct Cmp { bool operator()(const E& a, const E& b) const { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; } };
    std::vector<uint32_t> id(n);
    std::vector<int32_t> prv(n), nxt(n);
    std::vector<uint8_t> alive(n, 1);
    std::priority_queue<E, std::vector<E>, Cmp> q;
    for (uint32_t i = 0; i < n; ++i) { id[i] = t.byte_to_id[p[i]]; prv[i] = int32_t(i) - 1; nxt[i] = i + 1 < n ? int32_t(i + 1) : -1; }
    for (uint32_t i = 0; i + 1 < n; ++i) {
      uint32_t mg, r = pair<filtered>(id[i], id[i + 1], mg);
      if (r != EMPTY32) q.push({r, i, mg});
    }
    while (!q.empty()) {
      E top = q.top();
      q.pop();
      uint32_t a = top.pos;
      if (!alive[a] || nxt[a] < 0) continue;
      uint32_t b = uint32_t(nxt[a]), mg;
      uint32_t r = pair<filtered>(id[a], id[b], mg);
      if (r == EMPTY32 || mg != top.merged) continue;  // stale (HF's check: the pair's merged id)
      id[a] = mg;
      alive[b] = 0;
      nxt[a] = nxt[b];
      if (nxt[b] >= 0) prv[nxt[b]] = int32_t(a);
      if (prv[a] >= 0) {
        uint32_t pa = uint32_t(prv[a]);
        uint32_t r2 = pair<filtered>(id[pa], id[a], mg);
        if (r2 != EMPTY32) q.push({r2, pa, mg});
      }
      if (nxt[a] >= 0) {
        uint32_t r2 = pair<filtered>(id[a], id[uint32_t(nxt[a])], mg);
        if (r2 != EMPTY32) q.push({r2, a, mg});
      }
    }
    uint32_t k = 0;
    for (int32_t i = 0; i >= 0; i = nxt[i]) out[k++] = id[i];
    return k;
  }

  // -- pre-tokenizer scanners: piece ends for the segment s[a, b) -------------------------------
  template <class T> static inline bool is_r(T c) { return c == '\r' || c == '\n'; }

  // contraction suffix (?i:'s|'t|'re|'ve|'m|'ll|'d) at i: its end, or i
  template <class T>
  inline int64_t contraction(const T* s, int64_t i, int64_t b) const {
    if (i + 1 >= b || s[i] != '\'') return i;
    uint32_t f1 = (cls(s[i + 1]) >> FOLD_SHIFT) & 0xFF;
    if (f1 == 's' || f1 == 't' || f1 == 'm' || f1 == 'd') return i + 2;
    if (i + 2 < b) {
      uint32_t f2 = (cls(s[i + 2]) >> FOLD_SHIFT) & 0xFF;
      if ((f1 == 'r' && f2 == 'e') || (f1 == 'v' && f2 == 'e') || (f1 == 'l' && f2 == 'l')) return i + 3;
    }
    return i;
  }

  template <class T>
  inline int64_t run(const T* s, int64_t i, int64_t b, uint32_t any, uint32_t none = 0) const {
    while (i < b) {
      uint32_t c = cls(s[i]);
      if (!(c & any) || (c & none)) break;
      ++i;
    }
    return i;
  }

  // whitespace alternatives at i (s[i] is \s): \s*[\r\n]+ | \s+(?!\S) | \s+  (tt: \s++$ first)
  template <class T>
  inline int64_t whitespace(const T* s, int64_t i, int64_t b, bool tt) const {
    int64_t e = run(s, i, b, W);
    if (tt && e == b) return b;
    for (int64_t r = e - 1; r >= i; --r)
      if (is_r(s[r])) return r + 1;
    if (e == b) return e;
    if (e - i >= 2) return e - 1;
    return i + 1;
  }

  // cl100k (HF and tiktoken forms) and Qwen: one piece's end from scan position i
  template <class T>
  int64_t match_cl(const T* s, int64_t i, int64_t b) const {
    T cp = s[i];
    uint32_t c = cls(cp);
    int64_t e = contraction(s, i, b);
    if (e > i) return e;
    if (c & L) return run_letters(s, i + 1, b, L, run_alpha_L, ALPHA);
    if (!is_r(cp) && !(c & (L | N)) && i + 1 < b && (cls(s[i + 1]) & L)) return run_letters(s, i + 2, b, L, run_alpha_L, ALPHA);
    if (c & N) return digits(s, i, b, t.rules == QWEN ? 1 : 3);
    int64_t e2 = punct(s, i, b, false);
    if (e2 > i) return e2;
    return whitespace(s, i, b, t.rules == CL100K_TT);
  }

  // \p{N}{1,max} at i (s[i] is a digit)
  template <class T>
  inline int64_t digits(const T* s, int64_t i, int64_t b, int64_t max) const {
    int64_t lim = std::min<int64_t>(b, i + max), j = i + 1;
    while (j < lim && (cls(s[j]) & N)) ++j;
    return j;
  }

  // ' ?[^\s\p{L}\p{N}]+[\r\n]*' (o200k: '[\r\n/]*') at i: its end, or i when it does not match
  template <class T>
  inline int64_t punct(const T* s, int64_t i, int64_t b, bool slash) const {
    int64_t j = i;
    if (s[i] == ' ' && i + 1 < b && !(cls(s[i + 1]) & (W | L | N))) j = i + 1;
    if (cls(s[j]) & (W | L | N)) return i;
    int64_t k = j + 1;
    while (k < b && !(cls(s[k]) & (W | L | N))) ++k;
    while (k < b && (is_r(s[k]) || (slash && s[k] == '/'))) ++k;
    return k;
  }

  // o200k: U* l+ from j (with U*'s backtracking), its end or -1
  template <class T>
  inline int64_t upper_lower(const T* s, int64_t j, int64_t b) const {
    int64_t u = run(s, j, b, UP);
    if (u < b && (cls(s[u]) & LO)) return run_letters(s, u + 1, b, LO, run_lower_LO, LOWER);
    for (int64_t k = u - 1; k >= j; --k)
      if (cls(s[k]) & LO) return k + 1;  // the last B of the U run; nothing after it is l
    return -1;
  }

  template <class T>
  int64_t match_o200k(const T* s, int64_t i, int64_t b) const {
    T cp = s[i];
    uint32_t c = cls(cp);
    bool x = !is_r(cp) && !(c & (L | N));
    int64_t e;
    // (1) X? U* l+ C?
    if (x && i + 1 < b && (e = upper_lower(s, i + 1, b)) >= 0) return contraction(s, e, b);
    if ((e = upper_lower(s, i, b)) >= 0) return contraction(s, e, b);
    // (2) X? U+ l* C?
    if (x && i + 1 < b && (cls(s[i + 1]) & UP)) return contraction(s, run(s, run(s, i + 2, b, UP), b, LO), b);
    if (c & UP) return contraction(s, run(s, run(s, i + 1, b, UP), b, LO), b);
    // (3) N{1,3}
    if (c & N) return digits(s, i, b, 3);
    // (4) ' ?Q+[\r\n/]*'
    if ((e = punct(s, i, b, true)) > i) return e;
    return whitespace(s, i, b, false);
  }

  template <class T> static inline bool ascii_letter(T c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
  template <class T> static inline bool ascii_punct(T c) {
    return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') || (c >= '{' && c <= '~');
  }

  // DeepSeek stage 3 on the segment [., b): one match's end from i, or -1 (i is a gap character)
  template <class T>
  int64_t match_ds3(const T* s, int64_t i, int64_t b) const {
    T cp = s[i];
    uint32_t c = cls(cp);
    if (ascii_punct(cp) && i + 1 < b && ascii_letter(s[i + 1])) {
      int64_t j = i + 2;
      while (j < b && ascii_letter(s[j])) ++j;
      return j;
    }
    bool x = !is_r(cp) && !(c & (L | PS));
    if (x && i + 1 < b && (cls(s[i + 1]) & (L | M))) return run(s, i + 2, b, L | M);
    if (c & (L | M)) return run(s, i + 1, b, L | M);
    int64_t j = i;
    if (cp == ' ' && i + 1 < b && (cls(s[i + 1]) & PS)) j = i + 1;
    if (cls(s[j]) & PS) {
      int64_t k = run(s, j + 1, b, PS);
      while (k < b && is_r(s[k])) ++k;
      return k;
    }
    if (c & W) return whitespace(s, i, b, false);
    return -1;
  }

  // -- block scanner: cl100k-like and o200k rules over ASCII, 128 characters at a time -------
  // The per-character scanner takes a data-dependent branch per character class and per piece
  // (~20 ns a piece).  Here a stretch of ASCII is first turned into class bitmasks, and the piece
  // starts of up to 128 characters come out of a few dozen shifts, ands and adds: the per-
  // character rules of the GPU path's host model (toktier/gpu/pretok_model.py, `_starts_cl100k`),
  // which read nothing but L/N/W from the probed table, the characters \r \n ' ' and '\'', and the
  // contraction folds.  Each view starts at a known piece start (the regexes have no lookbehind,
  // so the pieces after it are those of the text cut there), and only starts that nothing past
  // the view can change are emitted; the rest, non-ASCII characters and runs longer than a view
  // go to `match_cl` (`match_o200k`), one piece at a time.  Used only where `build_block` finds
  // the probed table gives the ASCII characters exactly the classes these rules assume.  o200k
  // (`view_starts_o200k`) also reads upper/lower case and the slash; DeepSeek's three split
  // stages keep the per-character scanner.
#if defined(__SSE2__) && defined(__SIZEOF_INT128__)
  using u128 = unsigned __int128;
  static constexpr bool BLOCK_BUILT = true;
#else
  static constexpr bool BLOCK_BUILT = false;
#endif
  // B_UP (an uppercase letter) and B_SL ('/') are read by the o200k rules only; the cl100k-like
  // rules classify 7 bits (`B_CL`), o200k's 9.  DeepSeek's rules read no apostrophe: its bit 5
  // is punctuation or symbol (`B_PS`, \p{P}\p{S} from the table).
  enum BlockBit : int { B_L = 0, B_N, B_W, B_R, B_SP, B_AP, B_HI, B_UP, B_SL, B_COUNT };
  static constexpr int B_CL = B_UP, B_PS = B_AP;
  enum BlockRules : int { BR_CL = 0, BR_O200K, BR_DS };  // which rules `pretok_block` follows
  static constexpr int block_bits(int r) { return r == BR_O200K ? B_COUNT : B_CL; }
  uint16_t bcode[129] = {};  // class bits of ASCII code points; [128]: any other character
  bool block_cl = false;  // the block scanner serves this tokenizer (`build_block`)
  int block_rules = BR_CL;  // ... with these rules
  const char* block_reason = "not built";

  void build_block() {
    block_cl = false;
    if (!BLOCK_BUILT) { block_reason = "compiled without SSE2 and 128-bit integers"; return; }
    const bool o2 = t.rules == O200K, ds = t.rules == DEEPSEEK;
    if (t.rules != CL100K_HF && t.rules != CL100K_TT && t.rules != QWEN && !o2 && !ds) {
      block_reason = "rule set not covered";
      return;
    }
    for (uint32_t c = 0; c < 128; ++c) {
      const uint32_t k = t.cls[c];
      const int classes = int(bool(k & L)) + int(bool(k & N)) + int(bool(k & W)) + int(ds && (k & PS));
      if (classes > 1) { block_reason = "an ASCII character in more than one of L, N, W (PS)"; return; }
      // DeepSeek: no ASCII character is a mark or of the K class (stage 2 splits K runs off)
      if (ds && (k & (M | K))) { block_reason = "an ASCII mark or K character (DeepSeek)"; return; }
      if (((k >> FOLD_SHIFT) & 0xFF) && !(k & L)) { block_reason = "an ASCII contraction fold on a non-letter"; return; }
      // o200k's words are U* l+ | U+ l*: an ASCII letter must be exactly one of upper and lower,
      // and nothing else either (a mark or an Lm/Lo letter, both, is never ASCII)
      if (o2 && (bool(k & UP) + bool(k & LO) != (k & L ? 1 : 0) || (k & M))) {
        block_reason = "an ASCII character not exactly one of upper, lower or neither (o200k)";
        return;
      }
      // (B_UP where the rules do not read it: A-Z, what `simd_bits` gives, so the comparison holds)
      const bool up = o2 ? bool(k & UP) : (c >= 'A' && c <= 'Z');
      const bool bit5 = ds ? bool(k & PS) : c == '\'';
      bcode[c] = uint16_t((k & L ? 1 << B_L : 0) | (k & N ? 1 << B_N : 0) | (k & W ? 1 << B_W : 0) |
                          (is_r(c) ? 1 << B_R : 0) | (c == ' ' ? 1 << B_SP : 0) | (bit5 ? 1 << B_AP : 0) |
                          (up ? 1 << B_UP : 0) | (c == '/' ? 1 << B_SL : 0));
    }
    if (!(t.cls['\r'] & W) || !(t.cls['\n'] & W) || !(t.cls[' '] & W) || (t.cls['\''] & (L | N | W))) {
      block_reason = "\\r, \\n or space not whitespace, or the apostrophe not punctuation";
      return;
    }
    if (o2 && (t.cls['/'] & (L | N | W | M))) { block_reason = "the slash not punctuation (o200k)"; return; }
    bcode[128] = 1 << B_HI;
    block_cl = true;
    block_rules = o2 ? BR_O200K : ds ? BR_DS : BR_CL;
    block_reason = "";
    simd_classify = BLOCK_BUILT && (o2 ? simd_codes_match<BR_O200K>() : ds ? simd_codes_match<BR_DS>()
                                                                          : simd_codes_match<BR_CL>());
  }

  // `classify` by byte comparisons (`simd_bits`) instead of a table read per character, only
  // where they give exactly `bcode` for every code point below 256 (checked here, at load;
  // wider characters, of any str width, saturate to 255 first, which is non-ASCII like them).
  bool simd_classify = false;
  template <int R>
  bool simd_codes_match() const {
#if defined(__SSE2__) && defined(__SIZEOF_INT128__)
    constexpr int NB = block_bits(R);
    for (uint32_t c0 = 0; c0 < 256; c0 += 16) {
      alignas(16) uint8_t lane[16];
      for (uint32_t j = 0; j < 16; ++j) lane[j] = uint8_t(c0 + j);
      uint16_t got[B_COUNT];
      simd_bits<R>(_mm_load_si128(reinterpret_cast<const __m128i*>(lane)), got);
      for (uint32_t j = 0; j < 16; ++j) {
        uint16_t code = 0;
        for (int b = 0; b < NB; ++b) code |= uint16_t(((got[b] >> j) & 1) << b);
        if (code != (bcode[std::min<uint32_t>(c0 + j, 128)] & ((1u << NB) - 1))) return false;
      }
    }
    return true;
#else
    return false;
#endif
  }

#if defined(__SSE2__) && defined(__SIZEOF_INT128__)
  // Class bitmasks of a chunk of the text: bit j of words[b] is class b of character base + j.
  static constexpr int64_t CHUNK = 4096;
  static constexpr int CHUNK_WORDS = int(CHUNK / 64) + 3;  // + the words a view reads past the end
  template <int NB> struct ClassBits { uint64_t w[NB][CHUNK_WORDS]; };

  // The class bits of 16 byte-sized characters (one bit per character in each got[b]), the
  // first block_bits(R) of them, as rules R read them.
  template <int R>
  static inline void simd_bits(__m128i x, uint16_t* got) {
    const __m128i zero = _mm_setzero_si128();
    auto in_range = [&](__m128i v, char lo, char span) {  // lo <= v <= lo + span, unsigned
      return _mm_cmpeq_epi8(_mm_subs_epu8(_mm_sub_epi8(v, _mm_set1_epi8(lo)), _mm_set1_epi8(span)), zero);
    };
    auto eq = [&](char c) { return _mm_cmpeq_epi8(x, _mm_set1_epi8(c)); };
    const __m128i letter = in_range(_mm_or_si128(x, _mm_set1_epi8(0x20)), 'a', 25);
    const __m128i digit = in_range(x, '0', 9);
    const __m128i space = eq(' ');
    const __m128i ws = _mm_or_si128(space, in_range(x, '\t', 4));
    const __m128i r = _mm_or_si128(eq('\r'), eq('\n'));
    got[B_L] = uint16_t(_mm_movemask_epi8(letter));
    got[B_N] = uint16_t(_mm_movemask_epi8(digit));
    got[B_W] = uint16_t(_mm_movemask_epi8(ws));
    got[B_R] = uint16_t(_mm_movemask_epi8(r));
    got[B_SP] = uint16_t(_mm_movemask_epi8(space));
    if (R == BR_DS) {  // printable, not a letter, digit or space: ASCII's \p{P} and \p{S}
      const __m128i printable = in_range(x, '!', '~' - '!');
      got[B_PS] = uint16_t(_mm_movemask_epi8(_mm_andnot_si128(_mm_or_si128(letter, digit), printable)));
    } else {
      got[B_AP] = uint16_t(_mm_movemask_epi8(eq('\'')));
    }
    got[B_HI] = uint16_t(_mm_movemask_epi8(x));  // the top bit: 128 and up
    if (R == BR_O200K) {
      got[B_UP] = uint16_t(_mm_movemask_epi8(in_range(x, 'A', 25)));
      got[B_SL] = uint16_t(_mm_movemask_epi8(eq('/')));
    }
  }

  // 16 characters from p as bytes, wider ones saturated to 255 (only where 16 remain)
  template <class T>
  static inline __m128i narrow16(const T* p) {
    if (sizeof(T) == 1) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (sizeof(T) == 4) {  // code points are below 2^31: signed saturation keeps >= 128 at >= 128
      auto at = [&](int q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * q)); };
      return _mm_packus_epi16(_mm_packs_epi32(at(0), at(1)), _mm_packs_epi32(at(2), at(3)));
    }
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    // packus reads signed 16-bit lanes: a character >= 0x8000 would become 0, so fold those
    // to 0x7FFF first (any value >= 128 only has to stay >= 128)
    const __m128i top = _mm_set1_epi16(0x7FFF);
    auto clamp = [&](__m128i v) {
      const __m128i neg = _mm_srai_epi16(v, 15);
      return _mm_or_si128(_mm_andnot_si128(neg, v), _mm_and_si128(neg, top));
    };
    return _mm_packus_epi16(clamp(a), clamp(b));
  }

  // The class bits rules R read (`block_bits(R)` of them) of s[from, from + len).
  template <int R, class T>
  void classify(const T* s, int64_t from, int64_t len, ClassBits<block_bits(R)>& cb) const {  // len <= CHUNK
    constexpr int NB = block_bits(R);
    int64_t k = 0;
    if (simd_classify) {
      for (; k + 64 <= len; k += 64) {
        uint64_t word[NB] = {};
        for (int q = 0; q < 4; ++q) {
          uint16_t got[B_COUNT];
          simd_bits<R>(narrow16(s + from + k + 16 * q), got);
          for (int b = 0; b < NB; ++b) word[b] |= uint64_t(got[b]) << (16 * q);
        }
        for (int b = 0; b < NB; ++b) cb.w[b][k / 64] = word[b];
      }
    }
    for (; k < len; k += 64) {
      // the codes' low and high bytes (bits 0-7, 8-15)
      alignas(16) uint8_t code[2][64];
      const int64_t m = std::min<int64_t>(64, len - k);
      for (int64_t j = 0; j < m; ++j) {
        const uint16_t c = bcode[std::min<uint32_t>(uint32_t(s[from + k + j]), 128)];
        code[0][j] = uint8_t(c);
        code[1][j] = uint8_t(c >> 8);
      }
      for (int64_t j = m; j < 64; ++j) code[0][j] = code[1][j] = 0;
      for (int b = 0; b < NB; ++b) {  // bit b of each byte to the byte's top bit, then movemask
        uint64_t word = 0;
        for (int q = 0; q < 4; ++q) {
          const __m128i x = _mm_load_si128(reinterpret_cast<const __m128i*>(code[b >> 3] + 16 * q));
          word |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_slli_epi16(x, 7 - (b & 7))))) << (16 * q);
        }
        cb.w[b][k / 64] = word;
      }
    }
    // `bits_at` reads at most two words past the last classified one: zero those (and one more)
    // only, not the rest of the chunk (for a small window, ~40 stack lines written per call)
    const int64_t zend = std::min<int64_t>(CHUNK_WORDS, k / 64 + 3);
    for (int64_t z = k / 64; z < zend; ++z)
      for (int b = 0; b < NB; ++b) cb.w[b][z] = 0;
  }

  // Whether the 16 characters from i (fewer at b) are ASCII: without this, text with a non-ASCII
  // character every few positions paid for a view per piece and got 0.85x.
  template <class T>
  static inline bool ascii_ahead(const T* s, int64_t i, int64_t b) {
    uint32_t acc = 0;
    if (i + 16 <= b) {
      for (int k = 0; k < 16; ++k) acc |= uint32_t(s[i + k]);  // fixed trip count: vectorized
    } else {
      for (int64_t k = i; k < b; ++k) acc |= uint32_t(s[k]);
    }
    return acc < 0x80;
  }

  // 128 bits of a chunk's class b from bit o (the words past the classified part are zero)
  static inline u128 bits_at(const uint64_t* w, int64_t o) {
    const int64_t k = o >> 6;
    const int r = int(o & 63);
    uint64_t lo = w[k], hi = w[k + 1];
    if (r) {
      lo = (lo >> r) | (hi << (64 - r));
      hi = (hi >> r) | (w[k + 2] << (64 - r));
    }
    return (u128(hi) << 64) | lo;
  }
  static inline int ctz128(u128 x) {
    const uint64_t lo = uint64_t(x);
    return lo ? __builtin_ctzll(lo) : 64 + __builtin_ctzll(uint64_t(x >> 64));
  }
  static inline int top128(u128 x) {  // index of the highest set bit (x != 0)
    const uint64_t hi = uint64_t(x >> 64);
    return hi ? 127 - __builtin_clzll(hi) : 63 - __builtin_clzll(uint64_t(x));
  }
  // positions reachable from a seed going backwards through `run` (seeds inside run)
  static inline u128 fill_back(u128 seed, u128 run) {
    for (int k = 1; k < 128; k <<= 1) { seed |= (seed >> k) & run; run &= run >> k; }
    return seed;
  }
  // positions reachable from a seed going forwards through `run` (seeds inside run)
  static inline u128 fill_forward(u128 seed, u128 run) {
    for (int k = 1; k < 128; k <<= 1) { seed |= (seed << k) & run; run &= run << k; }
    return seed;
  }
  // \p{N}{1,3}: a digit run's first digit, then every third
  static inline u128 digit_starts(u128 Nm) {
    u128 x = Nm & ~(Nm << 1), st = x;
    while (x) { x = (x << 3) & Nm & (Nm << 1) & (Nm << 2); st |= x; }
    return st;
  }
  // A whitespace run's starts past its first character (o200k and DeepSeek): the character after
  // its last \r \n, and its last character when something follows (`has_next`)
  static inline u128 whitespace_tail_starts(u128 Wm, u128 Rm, u128 has_next) {
    const u128 Wnr = Wm & ~Rm;
    return (Wnr & (Rm << 1) & fill_back(Wnr & ~(Wm >> 1), Wnr)) | (Wnr & ~(Wm >> 1) & has_next);
  }

  // Piece starts of the view of nv characters (bit j: character i + j; bit 0 is a piece start),
  // as `_starts_cl100k`; `at_end`: the view ends where the segment does.  `join_ap` receives the
  // letter runs an apostrophe joined, whose contraction the caller decides.
  inline u128 view_starts(const u128* v, int nv, bool at_end, u128& join_ap) const {
    const u128 valid = nv >= 128 ? ~u128(0) : (u128(1) << nv) - 1;
    const u128 Lm = v[B_L], Nm = v[B_N], Wm = v[B_W], Rm = v[B_R], SP = v[B_SP];
    const u128 P = valid & ~(Lm | Nm | Wm);
    u128 st = 1;
    st |= t.rules == QWEN ? Nm : digit_starts(Nm);
    st |= P & ~(P << 1) & ~(SP << 1);  // a punctuation run, unless ' ?' took the space before it
    // letter runs: joined by the last whitespace character before them (not \r \n) or by one
    // punctuation character at a scan position (a run of one, no space before it)
    const u128 Lb = Lm & ~(Lm << 1);
    const u128 join = ((Wm & ~Rm) << 1) | ((P << 1) & ~(P << 2) & ~(SP << 2));
    st |= Lb & ~join;
    join_ap = Lb & join & (v[B_AP] << 1);
    // whitespace runs: the entry (after the \r \n a punctuation piece's [\r\n]* took), the
    // character after the run's last \r \n, and the run's last character when something follows
    const u128 Ws = Wm & ~(Wm << 1);
    const u128 seed = Ws & Rm & (P << 1);
    st |= Ws & ~seed;
    st |= (Rm + seed) & ~Rm & Wm;  // the carry runs through the leading \r \n to the entry
    const u128 Wnr = Wm & ~Rm;
    const u128 tail = fill_back(Wnr & ~(Wm >> 1), Wnr);  // no \r \n from here to the run's end
    u128 after_r = Wnr & (Rm << 1) & tail;
    if (t.rules == CL100K_TT && at_end && ((Wm >> (nv - 1)) & 1))  // \s++$ takes the last run whole
      after_r &= ~fill_back(u128(1) << (nv - 1), Wm);
    st |= after_r;
    const u128 has_next = at_end ? valid >> 1 : valid;
    st |= Wnr & ~(Wm >> 1) & has_next;
    return st & valid;
  }

  // The same for o200k (`match_o200k` over ASCII: the GPU path's host model, `_starts_o200k`).
  // Against the cl100k rules: a letter run splits before each uppercase letter that follows a
  // lowercase one (words are U* l+ | U+ l*); a contraction is a suffix of the word before it,
  // not a piece (`ap`: the apostrophes right after a letter and before one, which the caller
  // decides); and a punctuation piece takes [\r\n/]* after its run, so the \r \n and / of such a
  // trailer start nothing and are no whitespace or punctuation of their own.
  inline u128 view_starts_o200k(const u128* v, int nv, bool at_end, u128& ap) const {
    const u128 valid = nv >= 128 ? ~u128(0) : (u128(1) << nv) - 1;
    const u128 Lm = v[B_L], Nm = v[B_N], SP = v[B_SP], Um = v[B_UP];
    const u128 P0 = valid & ~(Lm | Nm | v[B_W]);
    // trailers: from an \r or \n right after punctuation, through \r \n /
    const u128 trailer = fill_forward(v[B_R] & (P0 << 1), v[B_R] | v[B_SL]);
    const u128 P = P0 & ~trailer, Wm = v[B_W] & ~trailer, Rm = v[B_R] & ~trailer;
    u128 st = 1 | digit_starts(Nm);
    st |= P & ~(P << 1) & ~(SP << 1);  // a punctuation run, unless ' ?' took the space before it
    // letter runs: joined by the last whitespace character before them (not \r \n) or by one
    // punctuation character at a scan position; split before an uppercase letter after a lowercase one
    const u128 Lb = Lm & ~(Lm << 1);
    const u128 join = ((Wm & ~Rm) << 1) | ((P << 1) & ~(P << 2) & ~(SP << 2));
    st |= Lb & ~join;
    st |= Um & ((Lm & ~Um) << 1);
    ap = v[B_AP] & (Lm << 1) & (Lm >> 1) & valid;
    // whitespace runs (a trailer is none): the first character, then as cl100k's
    st |= (Wm & ~(Wm << 1)) | whitespace_tail_starts(Wm, Rm, at_end ? valid >> 1 : valid);
    // (what follows a trailer starts a piece by the rules above: the trailer is no P and no W)
    return st & valid;
  }

  // The same for DeepSeek (`pretok_deepseek` over ASCII: `_starts_deepseek`).  Stage 1 makes each
  // digit run (3 at a time) and each stretch between digits a segment of its own: nothing joins
  // across a digit, and a whitespace run before one ends its segment (\s+(?!\S) takes it whole).
  // Stage 2's K runs are never ASCII.  In stage 3, letters are joined by one punctuation or symbol
  // character at a scan position (its first alternative) or by whitespace other than \r \n or a
  // control character (the second's prefix); a control character that prefixes nothing matches no
  // alternative, and such characters in a row are one gap piece.
  inline u128 view_starts_ds(const u128* v, int nv, bool at_end) const {
    const u128 valid = nv >= 128 ? ~u128(0) : (u128(1) << nv) - 1;
    const u128 Lm = v[B_L], Nm = v[B_N], Wm = v[B_W], Rm = v[B_R], SP = v[B_SP], PS = v[B_PS];
    const u128 O = valid & ~(Lm | Nm | Wm | PS);
    u128 st = 1 | digit_starts(Nm);
    // (the stretch after digits starts a piece by the rules below: a digit joins nothing)
    st |= PS & ~(PS << 1) & ~(SP << 1);  // a punctuation run, unless ' ?' took the space before it
    const u128 Lb = Lm & ~(Lm << 1);
    const u128 join = (((Wm & ~Rm) | O) << 1) | ((PS << 1) & ~(PS << 2) & ~(SP << 2));
    st |= Lb & ~join;
    st |= O & ((Lm >> 1) | ~(O << 1));  // a gap run's first character, and a letter run's prefix
    // whitespace runs: as cl100k's (the \r \n a punctuation piece's [\r\n]* took, the character
    // after the run's last \r \n, the run's last character when its segment goes on)
    const u128 Ws = Wm & ~(Wm << 1);
    const u128 seed = Ws & Rm & (PS << 1);
    st |= Ws & ~seed;
    st |= (Rm + seed) & ~Rm & Wm;
    st |= whitespace_tail_starts(Wm, Rm, (at_end ? valid >> 1 : valid) & ~(Nm >> 1));
    return st & valid;
  }

  // DeepSeek: one piece's end from scan position i (a piece start), as `pretok_deepseek` cuts it.
  // `seg`: the end of the stage-2 segment found by an earlier call from the same segment (so a
  // long one is walked once, not once a piece), or anything <= i.
  template <class T>
  int64_t match_ds(const T* s, int64_t i, int64_t b, int64_t& seg) const {
    if (cls(s[i]) & N) return digits(s, i, b, 3);
    if (seg <= i) {  // the segment: to the next digit or K change
      const bool k = cls(s[i]) & K;
      seg = i + 1;
      while (seg < b && !(cls(s[seg]) & N) && bool(cls(s[seg]) & K) == k) ++seg;
    }
    const int64_t e = seg;
    const int64_t m = match_ds3(s, i, e);
    if (m >= 0) return m;
    int64_t j = i + 1;  // a gap: to where stage 3 matches again
    while (j < e && match_ds3(s, j, e) < 0) ++j;
    return j;
  }

  // One piece's end from scan position i, the per-character way (the block scanner's fallback);
  // `seg` as `match_ds` keeps it.
  template <int R, class T>
  inline int64_t match_one(const T* s, int64_t i, int64_t b, int64_t& seg) const {
    if constexpr (R == BR_DS) return match_ds(s, i, b, seg);
    return R == BR_O200K ? match_o200k(s, i, b) : match_cl(s, i, b);
  }

  template <int R, class T, class F>
  void pretok_block(const T* s, int64_t a, int64_t b, F&& piece) const {
    constexpr int NB = block_bits(R);
    ClassBits<NB> cb;
    int64_t seg = a;  // (DeepSeek's fallback: the end of the stage-2 segment it last walked)
    int64_t base = a, end = a;  // cb holds [base, end)
    int64_t i = a;
    while (i < b) {
      if (!ascii_ahead(s, i, b)) {  // dense non-ASCII text (CJK...): no view would get far
        const int64_t e = match_one<R>(s, i, b, seg);
        piece(i, e);
        i = e;
        continue;
      }
      if (i + 128 > end && end < b) {
        base = i;
        end = std::min<int64_t>(b, i + CHUNK);
        classify<R>(s, base, end - base, cb);
      }
      const int64_t o = i - base;
      u128 v[NB];
      for (int c = 0; c < NB; ++c) v[c] = bits_at(cb.w[c], o);
      int nv = int(std::min<int64_t>(128, end - i));
      if (v[B_HI]) nv = std::min(nv, ctz128(v[B_HI]));  // a non-ASCII character ends the view
      const bool at_end = i + nv == b;
      int lim = nv;
      if (!at_end) {
        // Starts a later character could change stay out: those within 3 characters of the
        // view's end (a contraction reads 3 ahead) and those of a whitespace run reaching it.
        lim = nv - 3;
        if (nv && ((v[B_W] >> (nv - 1)) & 1)) {
          const u128 valid = nv >= 128 ? ~u128(0) : (u128(1) << nv) - 1;
          const u128 non_w = valid & ~v[B_W];
          lim = std::min(lim, non_w ? top128(non_w) + 1 : 0);
        }
      }
      if (lim <= 1) {  // nothing decided past i: one piece the per-character way
        const int64_t e = match_one<R>(s, i, b, seg);
        piece(i, e);
        i = e;
        continue;
      }
      if (nv < 128) for (int c = 0; c < NB; ++c) v[c] &= (u128(1) << nv) - 1;
      u128 st;
      if constexpr (R == BR_DS) {
        st = view_starts_ds(v, nv, at_end);
      } else if constexpr (R == BR_O200K) {
        u128 ap;
        st = view_starts_o200k(v, nv, at_end, ap);
        int64_t taken = -1;  // where the last contraction ended: an apostrophe there follows no word
        while (ap) {  // (?i:'s|'t|'re|'ve|'m|'ll|'d) after a word: part of its piece, the rest starts one
          const int x = ctz128(ap);
          ap &= ap - 1;
          if (x == taken) continue;
          const int64_t e = contraction(s, i + x, b) - i;
          if (e == x) continue;
          st &= ~(((e >= 128 ? ~u128(0) : (u128(1) << e) - 1)) & ~((u128(1) << x) - 1));  // none in [x, e)
          if (e < nv) st |= u128(1) << e;
          taken = e;
        }
      } else {
        u128 join_ap;
        st = view_starts(v, nv, at_end, join_ap);
        while (join_ap) {  // 's 't 'm 'd 're 've 'll before a letter run: the rest starts a piece
          const int x = ctz128(join_ap);
          join_ap &= join_ap - 1;
          const int64_t e = contraction(s, i + x - 1, b) - i;
          if (e > x && e < nv && ((v[B_L] >> e) & 1)) st |= u128(1) << e;
        }
      }
      if (lim < 128) st &= (u128(1) << lim) - 1;
      st &= st - 1;  // bit 0: i itself
      if (!st && !at_end) {
        const int64_t e = match_one<R>(s, i, b, seg);
        piece(i, e);
        i = e;
        continue;
      }
      int64_t prev = i;
      while (st) {
        const int64_t x = i + ctz128(st);
        st &= st - 1;
        piece(prev, x);
        prev = x;
      }
      if (at_end) { piece(prev, b); prev = b; }
      i = prev;
    }
  }
#else
  template <int R, class T, class F>
  void pretok_block(const T* s, int64_t a, int64_t b, F&& piece) const {
    int64_t seg = a;
    for (int64_t i = a; i < b;) {
      const int64_t e = R == BR_DS ? match_ds(s, i, b, seg) : R == BR_O200K ? match_o200k(s, i, b) : match_cl(s, i, b);
      piece(i, e);
      i = e;
    }
  }
#endif

  // Piece boundaries of the literal-free segment [a, b): calls piece(start, end) in order.
  template <class T, class F>
  void pretokenize(const T* s, int64_t a, int64_t b, F&& piece) const {
    int64_t i = a;
    if (block_cl) {  // (`use_block_scanner` turns off block_cl alone)
      if (block_rules == BR_O200K) pretok_block<BR_O200K>(s, a, b, piece);
      else if (block_rules == BR_DS) pretok_block<BR_DS>(s, a, b, piece);
      else pretok_block<BR_CL>(s, a, b, piece);
    } else if (t.rules == DEEPSEEK) {
      pretok_deepseek(s, a, b, piece);
    } else if (t.rules == O200K) {
      while (i < b) { int64_t e = match_o200k(s, i, b); piece(i, e); i = e; }
    } else {
      while (i < b) { int64_t e = match_cl(s, i, b); piece(i, e); i = e; }
    }
  }

  template <class T, class F>
  void ds_stage3(const T* s, int64_t a, int64_t b, F&& piece) const {
    int64_t i = a, gap = -1;
    while (i < b) {
      int64_t e = match_ds3(s, i, b);
      if (e < 0) { if (gap < 0) gap = i; ++i; continue; }
      if (gap >= 0) { piece(gap, i); gap = -1; }
      piece(i, e);
      i = e;
    }
    if (gap >= 0) piece(gap, b);
  }

  template <class T, class F>
  void ds_stage2(const T* s, int64_t a, int64_t b, F&& piece) const {
    int64_t i = a;
    while (i < b) {  // K runs are matches, the stretches between them gaps: each is a piece
      bool k = cls(s[i]) & K;
      int64_t e = i + 1;
      while (e < b && bool(cls(s[e]) & K) == k) ++e;
      ds_stage3(s, i, e, piece);
      i = e;
    }
  }

  template <class T, class F>
  void pretok_deepseek(const T* s, int64_t a, int64_t b, F&& piece) const {
    int64_t i = a;
    while (i < b) {  // stage 1: \p{N}{1,3} matches and the gaps between them
      int64_t e = i + 1;
      if (cls(s[i]) & N) {
        while (e < b && e < i + 3 && (cls(s[e]) & N)) ++e;
      } else {
        while (e < b && !(cls(s[e]) & N)) ++e;
      }
      ds_stage2(s, i, e, piece);
      i = e;
    }
  }

  // Whether s[0, n) holds a surrogate code point (U+D800..U+DFFF).  Blocks of 256 characters are
  // OR-reduced without an early exit so the compiler vectorizes them: the scalar loop with a
  // return per character cost ~7 instructions a character, ~11% of a 2-byte str's encode.
  template <class T>
  static bool has_surrogate(const T* s, int64_t n) {
    if (sizeof(T) == 1) return false;  // (the masks below would truncate to 0)
    const T mask = T(sizeof(T) == 2 ? 0xF800u : 0xFFFFF800u), sur = T(0xD800u);
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
      T bad = 0;
      for (int k = 0; k < 256; ++k) bad |= T((s[i + k] & mask) == sur);
      if (bad) return true;
    }
    for (; i < n; ++i)
      if ((s[i] & mask) == sur) return true;
    return false;
  }

  // -- whole texts -------------------------------------------------------------------------------
  // Encode the code points s[0, n) (a str's PEP 393 data: T = uint8_t, uint16_t or uint32_t; the
  // repair lane's windows at the same widths).  `utf8_len`: receives the text's UTF-8 length.
  // Never inlined: one compiled copy per T serves every caller, so what `bench.engine_speed` times
  // through `CoreEngine.encode` is the code the session starts' chunk workers and the lane run too
  // (a caller's own loops still compile apart: see `utf8_length`).
  template <class T>
  __attribute__((noinline))
  int encode(const T* s, int64_t n, bool ascii, bool check_nfc, PieceCache& cache, Output& out,
             int64_t* utf8_len = nullptr) const {
    if (sizeof(T) > 1 && !ascii && has_surrogate(s, n)) return SURROGATE;  // no UTF-8: the references raise
    if (check_nfc && nfc && !ascii) {
      for (int64_t i = 0; i < n; ++i)
        if (s[i] >= 0x80 && !(cls(s[i]) & NFC_INERT)) return NEEDS_NFC;
    }
    cache.hot_small = n < SMALL_ENCODE;
    std::vector<Literal> lits;
    literals(s, n, lits);
    out.ids.reserve(out.ids.size() + size_t(n / 3) + 16);
    if (out.want_starts) out.starts.reserve(out.ids.capacity());
    const bool direct = ascii && sizeof(T) == 1;  // the str's own bytes are its UTF-8
    // A batch's pieces as UTF-8, for texts converted piece by piece (an ASCII window's segments
    // are read in place): on the stack (hot in L1, as the lane's small windows want), then, for a
    // batch that outgrows it, in the lent cache's kept buffer.  A heap buffer per call was a
    // zero-filled 4 KB written by every window, and an allocation that a fragmented heap made
    // cost microseconds; the cache's buffer alone was cold for small windows (multilingual
    // 10-character appends 1.15x slower).  Nothing reads its bytes past what a conversion wrote
    // (pieces read in place are followed by arbitrary text too), so neither is zeroed.
    alignas(64) uint8_t small_pbuf[4096];
    uint8_t* pbuf = small_pbuf;
    size_t pcap = sizeof small_pbuf;
    auto grow_pbuf = [&](size_t need, size_t used) {  // room for `need` bytes, keeping the first `used`
      if (need <= pcap) return;
      U8Scratch& kept = cache.piece_utf8;
      const bool on_stack = pbuf == small_pbuf;
      if (kept.size() < std::max(need, 2 * pcap)) kept.resize(std::max(need, 2 * pcap));  // (keeps its bytes)
      if (on_stack && used) std::memcpy(kept.data(), small_pbuf, used);
      pbuf = kept.data();
      pcap = kept.size();
    };
    PieceBatch batch;  // (byte offset in the segment buffer, length)
    auto& hs = cache.batch_hashes;
    auto& id_scratch = cache.batch_ids;
    std::vector<uint32_t> first_tok;
    int64_t text_byte = 0;  // UTF-8 offset of character `text_char` in the whole text
    int64_t text_char = 0;
    auto bytes_to = [&](int64_t ci) {  // UTF-8 offset of character ci (ascending calls)
      if (ascii) return ci;
      for (; text_char < ci; ++text_char) {
        uint32_t c = uint32_t(s[text_char]);
        text_byte += c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
      }
      return text_byte;
    };
    auto flush = [&](const uint8_t* buf, int64_t base) {  // base: buf[0]'s byte offset in the text
      if (batch.empty()) return;
      first_tok.clear();
      encode_pieces(buf, batch, hs, id_scratch, cache, out.ids, out.want_starts ? &first_tok : nullptr);
      if (out.want_starts) {
        first_tok.push_back(uint32_t(out.ids.size()));
        for (size_t i = 0; i < batch.size(); ++i) {
          int64_t off = base + batch[i].first;
          for (uint32_t k = first_tok[i]; k < first_tok[i + 1]; ++k) {
            out.starts.push_back(off);
            off += blen(out.ids[k]);
          }
        }
      }
      batch.clear();
    };
    // A segment of a 1-, 2- or 4-byte str whose wider characters are sparse (mostly ASCII text
    // with a curly quote or an emoji here and there: most real contexts are such strs): its
    // UTF-8 is built in a log `pbuf` (the UTF-8 of the characters from the last flushed piece's
    // end to log_end, contiguous) whose ASCII stretches are narrowed 16 characters at a time, up
    // to NARROW_AHEAD characters past the piece that asked, so that most pieces only point into
    // the log.  Writing each piece's bytes on its own (`segment_each`) was ~12-16% of such an
    // encode of English or code.
    // Invariant: characters [k_char, log_end) are ASCII, and k_char's byte is pbuf[k_off].
    auto segment_log = [&](int64_t a, int64_t b, int64_t base) {
      int64_t bbase = base;  // pbuf[0]'s byte offset in the text
      int64_t k_char = a, log_end = a;
      size_t k_off = 0;
      auto reserve = [&](size_t need) { grow_pbuf(need, k_off + size_t(log_end - k_char)); };
      // the log through character pb at least (out of line: the pieces' loop stays small)
      auto extend = [&](int64_t pb) __attribute__((noinline)) {
        const int64_t to = std::min<int64_t>(b, std::max<int64_t>(pb, log_end + NARROW_AHEAD));
        reserve(k_off + size_t(to - k_char) + 16);
        log_end = narrow_ascii(s, log_end, to, pbuf + k_off + size_t(log_end - k_char));
        if (log_end < pb) {  // a wider character before pb: [log_end, pb) one character at a time
          const size_t at_end = k_off + size_t(log_end - k_char);
          reserve(at_end + size_t(pb - log_end) * 4 + 16);  // + room for `ascii8`'s 8-byte stores
          uint8_t* const w = put_utf8_run(s, log_end, pb, n, pbuf + at_end);
          k_char = log_end = pb;
          k_off = size_t(w - pbuf);
        }
      };
      auto piece = [&](int64_t pa, int64_t pb) {
        // pieces tile the segment: pa is the previous piece's end, so k_char <= pa <= log_end
        const size_t off_pa = k_off + size_t(pa - k_char);
        if (pb > log_end) extend(pb);
        batch.emplace_back(uint32_t(off_pa), uint32_t(k_off + size_t(pb - k_char) - off_pa));
        if (batch.size() >= PieceBatch::CAP) {
          flush(pbuf, bbase);
          // keep the narrowed characters past pb at the log's front
          const size_t cut = k_off + size_t(pb - k_char), used = k_off + size_t(log_end - k_char);
          if (used > cut) std::memmove(pbuf, pbuf + cut, used - cut);
          bbase += int64_t(cut);
          k_char = pb;
          k_off = 0;
        }
      };
      pretokenize(s, a, b, piece);
      flush(pbuf, bbase);
      text_char = b;  // `bytes_to` resumes after this segment
      text_byte = bbase + int64_t(k_off + size_t(log_end - k_char));
    };
    // A segment whose wider characters are dense (Cyrillic, CJK, mixed scripts): narrowing ahead
    // would stop within a few characters each time, so each piece is converted on its own.
    auto segment_each = [&](int64_t a, int64_t b, int64_t base) {
      int64_t bbase = base;  // pbuf[0]'s byte offset in the text
      size_t used = 0;
      auto piece = [&](int64_t pa, int64_t pb) {
        grow_pbuf(used + size_t(pb - pa) * 4 + 16, used);  // + room for `ascii8`'s 8-byte stores
        uint8_t* const w0 = pbuf + used;
        uint8_t* const w = put_utf8_run(s, pa, pb, n, w0);
        batch.emplace_back(uint32_t(used), uint32_t(w - w0));
        used += size_t(w - w0);
        if (batch.size() >= PieceBatch::CAP) { flush(pbuf, bbase); bbase += int64_t(used); used = 0; }
      };
      pretokenize(s, a, b, piece);
      flush(pbuf, bbase);
      text_char = b;  // `bytes_to` resumes after this segment
      text_byte = bbase + int64_t(used);
    };
    auto segment = [&](int64_t a, int64_t b) {
      const int64_t base = bytes_to(a);  // the segment's first byte in the text
      if (direct) {  // the segment's UTF-8 is the str's own bytes: pieces are read in place
        const uint8_t* buf = reinterpret_cast<const uint8_t*>(s) + a;
        auto piece = [&](int64_t pa, int64_t pb) {
          batch.emplace_back(uint32_t(pa - a), uint32_t(pb - pa));
          if (batch.size() >= PieceBatch::CAP) flush(buf, base);
        };
        pretokenize(s, a, b, piece);
        flush(buf, base);
        return;
      }
      // Otherwise the pieces' UTF-8 is written into a small buffer, which a batch's BPE reads
      // while it is still in L1 (converting the whole segment first, plus a per-character offset
      // table, wrote ~8 bytes a character to fresh memory and read them back later).
      if (mostly_ascii(s, a, b)) segment_log(a, b, base);
      else segment_each(a, b, base);
    };
    int64_t pos = 0;
    for (const Literal& l : lits) {
      if (l.a > pos) segment(pos, l.a);
      if (out.want_starts) out.starts.push_back(bytes_to(l.a));
      out.ids.push_back(uint32_t(l.id));
      pos = l.b;
    }
    if (pos < n) segment(pos, n);
    // the segments counted their bytes as they converted them: reading the whole text again
    // afterwards (`utf8_length`) was ~6% of a 1M-character chunk of a 2-byte str
    if (utf8_len) *utf8_len = bytes_to(n);
    if (cache.piece_utf8.size() > (size_t(1) << 20)) U8Scratch().swap(cache.piece_utf8);  // (a rare long batch)
    return OK;
  }

  // Chunks s[0, c0), s[c0, c1), ... of one text (cuts at standalone-stable boundaries:
  // `RepairLane::text_cuts`, or Python's `fullpath.chunk_cuts`), encoded on this thread and the
  // kept helpers (`run_chunks`), at most caches.size() threads at once, each with its own piece
  // cache (caches[slot]) for every chunk it takes.  outs[i] holds chunk i's tokens, starts
  // relative to the chunk (when `want_starts`); bytes[i] its UTF-8 length.  Returns the first
  // non-OK status of a chunk, or OK.
  template <class T>
  int encode_chunks(const T* s, int64_t n, bool ascii, const std::vector<int64_t>& cuts,
                    const std::vector<PieceCache*>& caches, bool want_starts, std::vector<Output>& outs,
                    std::vector<int64_t>& bytes, bool check_nfc = true) const {
    const size_t k = cuts.size() + 1;
    outs.resize(k);  // kept capacity: a caller reusing `outs` spares the page faults
    for (Output& o : outs) {
      o.ids.clear();
      o.starts.clear();
    }
    bytes.assign(k, 0);
    std::vector<int> status(k, OK);
    std::vector<char> failed(k, 0);
    auto work = [&](size_t i, size_t slot) {
      const int64_t a = i ? cuts[i - 1] : 0, b = i + 1 < k ? cuts[i] : n;
      const T* c = s + a;
      const bool chunk_ascii = ascii || all_ascii(c, b - a);
      outs[i].want_starts = want_starts;
      int64_t nb = b - a;
      try {
        status[i] = encode(c, b - a, chunk_ascii, check_nfc, *caches[slot], outs[i], &nb);
      } catch (...) {  // std::bad_alloc: reported, never thrown across the thread
        failed[i] = 1;
        return;
      }
      bytes[i] = nb;
    };
    run_chunks(k, work, caches.size());
    for (size_t i = 0; i < k; ++i)
      if (failed[i]) throw std::bad_alloc();
    for (size_t i = 0; i < k; ++i)
      if (status[i] != OK) return status[i];
    return OK;
  }

  // work(i, slot) for i in [0, k), on this thread and the engine's kept helper threads, at most
  // `slots` threads at once (`Workers::run`).  `work` must not throw.
  template <class F>
  void run_chunks(size_t k, F& work, size_t slots) const {
    if (k <= 1 || slots <= 1) {
      for (size_t i = 0; i < k; ++i) work(i, 0);
      return;
    }
    workers().run(k, work, slots);
  }

  // The helper threads of this engine's chunked encodes (one fewer than the cores), made on the
  // first chunked call, and made again in a forked child (the parent's are not there).
  mutable std::atomic<Workers*> workers_{nullptr};
  Workers& workers() const {
    Workers* w = workers_.load(std::memory_order_acquire);
    if (w != nullptr && w->owned_here()) return *w;
    const size_t threads = chunk_threads();
    Workers* made = new Workers(threads > 1 ? threads - 1 : 1);
    if (workers_.compare_exchange_strong(w, made, std::memory_order_acq_rel)) return *made;
    delete made;  // another thread installed one first (this one never started a thread)
    return *w;
  }

  // A session start's second pass over `encode_chunks`' outputs (cuts and the text as given
  // there; `bytes` its UTF-8 lengths): chunk i's ids copied to ids + (its first token's index),
  // its UTF-8 written to u8 + (its first byte), and the checkpoints of its tokens (cp[j]: the
  // byte start of token j * stride) written from the chunk's byte start by summing `token_len`,
  // a chunk at a time on the kept threads; `sums` gets each chunk's length sum and uncertain flag.  The
  // checkpoints are the canonical prefix sums (`_engine.token_checkpoints` of the concatenated
  // ids) exactly when every chunk tiles (sums.len[i] == bytes[i]); the caller checks that.
  // Done on the calling thread, these copies were ~4 ms of a 4M-character start (the UTF-8
  // copy, the concatenation and the session's copy of both, the checkpoint pass).
  template <class T>
  void assemble_chunks(const T* s, int64_t n, bool ascii, const std::vector<int64_t>& cuts,
                       const std::vector<Output>& outs, const std::vector<int64_t>& bytes, ChunkSums& sums,
                       uint32_t* ids, uint8_t* u8, uint32_t* cp, int64_t stride) const {
    const size_t k = cuts.size() + 1;
    std::vector<int64_t> id_at(k + 1, 0), byte_at(k + 1, 0);
    for (size_t i = 0; i < k; ++i) {
      id_at[i + 1] = id_at[i] + int64_t(outs[i].ids.size());
      byte_at[i + 1] = byte_at[i] + bytes[i];
    }
    sums.len.assign(k, 0);
    sums.uncertain.assign(k, 0);
    sums.bad.assign(k, 0);
    auto work = [&](size_t i, size_t) {
      const int64_t a = i ? cuts[i - 1] : 0, b = i + 1 < k ? cuts[i] : n;
      const std::vector<uint32_t>& v = outs[i].ids;
      if (!v.empty()) std::memcpy(ids + id_at[i], v.data(), v.size() * sizeof(uint32_t));
      if (u8) {
        uint8_t* w = u8 + byte_at[i];
        if (sizeof(T) == 1 && ascii) {
          std::memcpy(w, reinterpret_cast<const uint8_t*>(s) + a, size_t(b - a));
        } else {
          int64_t j = a;
          while (j < b) {
            // ASCII runs 16 characters at a time (`narrow_ascii` stores only what it converts, so
            // nothing lands past this chunk's part of u8), a wider character on its own
            const int64_t e = narrow_ascii(s, j, b, w);
            w += e - j;
            j = e;
            if (j < b) w = put_utf8(uint32_t(s[j++]), w);
          }
        }
      }
      // token g's start, from the chunk's first byte; checkpoints where g is a multiple of stride.
      // Everything the loop reads is a local: through the captures (and with the checkpoint
      // stores, which may alias anything), the vector's bounds and the tables were reloaded per
      // token (~20 instructions a token, 7-8% of a start's samples).
      const int64_t g0 = id_at[i];
      int64_t total = byte_at[i];
      int64_t next = stride > 0 ? (g0 + stride - 1) / stride * stride : std::numeric_limits<int64_t>::max();
      uint8_t flags = 0;
      const uint8_t* const un = sums.uncertain_ids;
      const uint8_t* const l8 = sums.len8;
      const size_t n8 = l8 ? sums.n_len8 : 0;
      const uint32_t* const tl = sums.token_len;
      const int64_t n_tl = sums.token_len_n;
      const uint32_t* const vp = v.data();
      const size_t nv = v.size();
      uint32_t* const cpp = cp;
      size_t t = 0;
      while (t < nv) {
        if (g0 + int64_t(t) == next) {
          if (cpp && total <= int64_t(0xFFFFFFFF)) cpp[next / stride] = uint32_t(total);
          next += stride;
        }
        // the tokens up to the next checkpoint
        const size_t stop = next - g0 >= int64_t(nv) ? nv : size_t(next - g0);
        for (; t < stop; ++t) {
          const uint32_t id = vp[t];
          if (id < n8 && l8[id]) {  // its length, and not uncertain
            total += l8[id];
            continue;
          }
          if (int64_t(id) >= n_tl) { sums.bad[i] = 1; return; }
          total += tl[id];
          if (un) flags |= un[id];
        }
      }
      sums.len[i] = total - byte_at[i];
      sums.uncertain[i] = flags != 0;
    };
    run_chunks(k, work, chunk_threads());
  }

  // The most threads a chunked call runs on: the cores (one helper fewer, and the caller).  Read
  // once per process: glibc answers hardware_concurrency by opening and reading
  // /sys/devices/system/cpu/online, ~5 us of syscalls that every session start paid (a
  // conversation's new tail segment on every generated turn).
  static size_t chunk_threads() {
    static const size_t threads = [] {
      const unsigned cores = std::thread::hardware_concurrency();
      return cores > 1 ? size_t(cores) : size_t(1);
    }();
    return threads;
  }

  // The added-token literals `encode` splits off first, in order: the `normalized=False` ones
  // over the text, then the others in the gaps between them.
  template <class T>
  void literals(const T* s, int64_t n, std::vector<Literal>& lits) const {
    if (!lit1.empty()) find_literals(lit1, s, 0, n, lits);
    if (lit2.empty()) return;
    std::vector<Literal> more;
    int64_t pos = 0;
    for (const Literal& l : lits) { find_literals(lit2, s, pos, l.a, more); pos = l.b; }
    find_literals(lit2, s, pos, n, more);
    if (!more.empty()) {
      lits.insert(lits.end(), more.begin(), more.end());
      std::sort(lits.begin(), lits.end(), [](const Literal& x, const Literal& y) { return x.a < y.a; });
    }
  }

  // Maximal runs [a, b) of characters that NFC may rewrite or compose with what precedes them
  // (non-ASCII and not NFC-inert), as flat (a, b) pairs: the only places an NFC family's
  // normalizer can change a text (`toktier.nfc_spans.nfc_edits` normalizes around them).
  template <class T>
  void nfc_runs(const T* s, int64_t n, std::vector<int64_t>& out) const {
    for (int64_t i = 0; i < n;) {
      // A block of 64 all-ASCII characters is skipped with one OR that vectorizes; any other
      // block is read a character at a time to its end (a run may end past it).
      const int64_t stop = std::min(n, i + 64);
      if (stop - i == 64) {
        uint32_t any = 0;
        for (int k = 0; k < 64; ++k) any |= uint32_t(s[i + k]);
        if (any < 0x80) {
          i = stop;
          continue;
        }
      }
      while (i < stop) {
        if (s[i] < 0x80 || (cls(s[i]) & NFC_INERT)) {
          ++i;
          continue;
        }
        int64_t j = i + 1;
        while (j < n && s[j] >= 0x80 && !(cls(s[j]) & NFC_INERT)) ++j;
        out.push_back(i);
        out.push_back(j);
        i = j;
      }
    }
  }

  // The UTF-8 byte offsets of the ascending character offsets pos[0, k) of s[0, n), in one pass.
  template <class T>
  void utf8_offsets(const T* s, int64_t n, const int64_t* pos, int64_t k, int64_t* out) const {
    int64_t at = 0, bytes = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p = std::min(std::max(pos[i], at), n);
      bytes += utf8_length(s + at, p - at);
      at = p;
      out[i] = bytes;
    }
  }

  // Piece boundaries only (character offsets; literals are pieces too): for the campaigns.
  template <class T>
  void pieces(const T* s, int64_t n, std::vector<int64_t>& starts, std::vector<int64_t>& lit_flags) const {
    std::vector<Literal> lits;
    if (!lit1.empty()) find_literals(lit1, s, 0, n, lits);
    auto piece = [&](int64_t pa, int64_t) { starts.push_back(pa); lit_flags.push_back(-1); };
    int64_t pos = 0;
    for (const Literal& l : lits) {
      if (l.a > pos) pretokenize(s, pos, l.a, piece);
      starts.push_back(l.a);
      lit_flags.push_back(l.id);
      pos = l.b;
    }
    if (pos < n) pretokenize(s, pos, n, piece);
  }

  // The first k (<= 8) of the 8 characters at s, when all k are ASCII, stored as bytes at w (8
  // bytes are written): k, else 0.  Most pieces of a UCS-2/UCS-4 text are ASCII, and a branch per
  // character of the UTF-8 conversion cost more than the scan that found the piece.
  template <class T>
  static inline int ascii8(const T* s, int k, uint8_t* w) {
#if defined(__SSE2__)
    if (sizeof(T) == 1) return 0;
    const __m128i zero = _mm_setzero_si128();
    __m128i x;
    uint32_t ok;
    if (sizeof(T) == 2) {
      x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      ok = uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(short(0xFF80))), zero)));
    } else {
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 4));
      const __m128i high = _mm_set1_epi32(int(0xFFFFFF80u));
      const uint32_t ok0 = uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi32(_mm_and_si128(x0, high), zero)));
      const uint32_t ok1 = uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi32(_mm_and_si128(x1, high), zero)));
      // 32-bit lanes to one bit pair per character, as the 16-bit case has
      ok = 0;
      for (int j = 0; j < 4; ++j) ok |= ((ok0 >> (4 * j)) & 3u) << (2 * j) | ((ok1 >> (4 * j)) & 3u) << (2 * j + 8);
      x = _mm_packs_epi32(_mm_and_si128(x0, _mm_set1_epi32(0x7F)), _mm_and_si128(x1, _mm_set1_epi32(0x7F)));
    }
    const uint32_t want = (1u << (2 * k)) - 1;
    if ((ok & want) != want) return 0;
    _mm_storel_epi64(reinterpret_cast<__m128i*>(w), _mm_packus_epi16(x, x));
    return k;
#else
    (void)s; (void)k; (void)w;
    return 0;
#endif
  }

  // Characters s[i, e) as bytes into w while they are ASCII: the index of the first one that is
  // not (or e).  Whole groups of 16 inside [i, e) are checked and stored with SSE2, so at most
  // e - i bytes are written; the rest, and a group with a wider character, one at a time.
  static constexpr int64_t NARROW_AHEAD = 512;
  template <class T>
  static inline int64_t narrow_ascii(const T* s, int64_t i, int64_t e, uint8_t* w) {
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    for (; i + 16 <= e; i += 16, w += 16) {
      __m128i x;
      if (sizeof(T) == 1) {
        x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        if (_mm_movemask_epi8(x)) break;
      } else if (sizeof(T) == 2) {
        const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 8));
        const __m128i hi = _mm_and_si128(_mm_or_si128(x0, x1), _mm_set1_epi16(short(0xFF80)));
        if (_mm_movemask_epi8(_mm_cmpeq_epi16(hi, zero)) != 0xFFFF) break;
        x = _mm_packus_epi16(x0, x1);
      } else {
        auto at = [&](int q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 4 * q)); };
        const __m128i x0 = at(0), x1 = at(1), x2 = at(2), x3 = at(3);
        const __m128i all = _mm_or_si128(_mm_or_si128(x0, x1), _mm_or_si128(x2, x3));
        const __m128i hi = _mm_and_si128(all, _mm_set1_epi32(int(0xFFFFFF80u)));
        if (_mm_movemask_epi8(_mm_cmpeq_epi32(hi, zero)) != 0xFFFF) break;
        x = _mm_packus_epi16(_mm_packs_epi32(x0, x1), _mm_packs_epi32(x2, x3));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w), x);
    }
#endif
    for (; i < e && uint32_t(s[i]) < 0x80; ++i) *w++ = uint8_t(s[i]);
    return i;
  }

  // s[i, e) as UTF-8 at w (w needs 4 bytes a character + 16): ASCII 8 characters at a time where
  // the first 8 from i are ASCII and within the text (n), else one at a time; the end written.
  template <class T>
  static inline uint8_t* put_utf8_run(const T* s, int64_t i, int64_t e, int64_t n, uint8_t* w) {
    while (i < e && i + 8 <= n) {
      const int k = ascii8(s + i, int(std::min<int64_t>(8, e - i)), w);
      if (!k) break;
      w += k;
      i += k;
    }
    for (; i < e; ++i) {
      const uint32_t c = uint32_t(s[i]);
      if (c < 0x80) *w++ = uint8_t(c);
      else w = put_utf8(c, w);
    }
    return w;
  }

  // Whether every character of s[0, n) is ASCII.  Blocks of 256 are OR-reduced without an early
  // exit so the loop vectorizes.
  template <class T>
  static bool all_ascii(const T* s, int64_t n) {
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
      uint32_t acc = 0;
      for (int k = 0; k < 256; ++k) acc |= uint32_t(s[i + k]);
      if (acc >= 0x80) return false;
    }
    uint32_t acc = 0;
    for (; i < n; ++i) acc |= uint32_t(s[i]);
    return acc < 0x80;
  }

  // The UTF-8 length of s[0, n) (no surrogates), by blocks of 256 summed branch-free so that the
  // loop vectorizes whatever the caller around it looks like (a per-character ternary chain
  // stopped vectorizing in `encode_chunks` after an unrelated change there: a 1M-character
  // session start's first pass went 2.3 -> 3.0 ms).
  template <class T>
  static int64_t utf8_length(const T* s, int64_t n) {
    int64_t total = n, i = 0;
    for (; i + 256 <= n; i += 256) {
      uint32_t extra = 0;
      for (int k = 0; k < 256; ++k) {
        const uint32_t x = uint32_t(s[i + k]);
        extra += uint32_t(x >= 0x80) + uint32_t(x >= 0x800) + uint32_t(x >= 0x10000);
      }
      total += extra;
    }
    for (; i < n; ++i) {
      const uint32_t x = uint32_t(s[i]);
      total += int64_t(x >= 0x80) + int64_t(x >= 0x800) + int64_t(x >= 0x10000);
    }
    return total;
  }

  // Whether fewer than one character in 64 of s[a, b) is outside ASCII (`encode`'s choice of
  // converter).  Blocks of 256 are counted without a branch so the loop vectorizes; it stops
  // as soon as the answer is known.
  template <class T>
  static bool mostly_ascii(const T* s, int64_t a, int64_t b) {
    const int64_t limit = (b - a) / 64;
    int64_t wide = 0, i = a;
    for (; i + 256 <= b; i += 256) {
      uint32_t w = 0;
      for (int k = 0; k < 256; ++k) w += uint32_t(s[i + k]) >= 0x80u;
      wide += w;
      if (wide > limit) return false;
    }
    for (; i < b; ++i) wide += uint32_t(s[i]) >= 0x80u;
    return wide <= limit;
  }

  static inline uint8_t* put_utf8(uint32_t c, uint8_t* w) {
    if (c < 0x80) { *w++ = uint8_t(c); }
    else if (c < 0x800) { *w++ = uint8_t(0xC0 | (c >> 6)); *w++ = uint8_t(0x80 | (c & 0x3F)); }
    else if (c < 0x10000) {
      *w++ = uint8_t(0xE0 | (c >> 12)); *w++ = uint8_t(0x80 | ((c >> 6) & 0x3F)); *w++ = uint8_t(0x80 | (c & 0x3F));
    } else {
      *w++ = uint8_t(0xF0 | (c >> 18)); *w++ = uint8_t(0x80 | ((c >> 12) & 0x3F));
      *w++ = uint8_t(0x80 | ((c >> 6) & 0x3F)); *w++ = uint8_t(0x80 | (c & 0x3F));
    }
    return w;
  }

  static inline void put_utf8(uint32_t c, std::vector<uint8_t>& o) {
    if (c < 0x80) o.push_back(uint8_t(c));
    else if (c < 0x800) { o.push_back(uint8_t(0xC0 | (c >> 6))); o.push_back(uint8_t(0x80 | (c & 0x3F))); }
    else if (c < 0x10000) {
      o.push_back(uint8_t(0xE0 | (c >> 12))); o.push_back(uint8_t(0x80 | ((c >> 6) & 0x3F)));
      o.push_back(uint8_t(0x80 | (c & 0x3F)));
    } else {
      o.push_back(uint8_t(0xF0 | (c >> 18))); o.push_back(uint8_t(0x80 | ((c >> 12) & 0x3F)));
      o.push_back(uint8_t(0x80 | ((c >> 6) & 0x3F))); o.push_back(uint8_t(0x80 | (c & 0x3F)));
    }
  }
};

}  // namespace ttn
