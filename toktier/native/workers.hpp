// TokTier native engine: helper threads kept between calls for chunked encodes.
//
// A chunked encode (a session start, or the repair lane's window of 8 KB and more) used to
// start a std::thread per extra chunk and join it.  On the 2-core VMs these numbers come from,
// a fresh thread's chunk ran much slower than the same chunk on a kept thread (new stack, a
// malloc arena to attach, caches of a core that did other work): a 64K-character text in two
// chunks took 0.42 ms against 0.27 ms for the same two halves on a kept Python pool, and a
// 16K-character append was slower on two threads than on one (2026-12-02, bench.append_ab).
//
// `Workers::run(k, work, slots)` calls work(i, slot) for every i in [0, k), the calling thread
// included: the caller claims chunks like any helper, so a call finishes even when every helper
// is busy with another call's chunks (several server threads may encode at once), and k may
// exceed the helper count.  `slot` names the thread within the call: the caller is 0, and each
// helper that joins takes the next one, at most `slots` threads in all, so a caller can lend
// each thread one piece cache and cut a text into more chunks than threads (the chunks then
// balance the threads' loads; with a cache per chunk, each extra chunk cost a cold cache).
// Helpers start on the first call and sleep on a condition variable between calls (no
// spinning: on a 2-core machine a spinning helper takes the core from the event loop).
//
// fork(): helper threads do not exist in a child, and the pool's mutex may have been held at
// the fork.  A pool notices it is in another process (`owned_here`), runs every chunk on the
// calling thread there, and is never destroyed there (destroying it would wait for threads
// that are gone); `Engine` makes a new pool for the child.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace ttn {

class Workers {
 public:
  explicit Workers(size_t helpers) : helpers_(helpers), pid_(getpid()) {}
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  ~Workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& th : threads_) th.join();
  }

  bool owned_here() const { return getpid() == pid_; }

  // work(i, slot) for i in [0, k), on this thread (slot 0) and at most slots - 1 helpers (slots
  // 1, 2, ...: one per helper that joins); returns when all are done.  `work` must not throw.
  template <class F>
  void run(size_t k, F& work, size_t slots) {
    if (k == 0) return;
    Job job{&call<F>, &work, k, std::max<size_t>(slots, 1)};
    size_t helpers = 0;
    if (k > 1 && job.slots > 1 && owned_here()) {
      std::lock_guard<std::mutex> lk(mu_);
      start_locked();
      helpers = helpers_;  // read under the lock: `start_locked` may lower it
      if (helpers > 0) {
        job.seq = ++seq_;
        jobs_.push_back(&job);
      }
    }
    if (helpers == 0) {
      for (size_t i = 0; i < k; ++i) work(i, 0);
      return;
    }
    const size_t wanted = std::min(k, job.slots) - 1;  // helpers this call can use
    if (wanted >= helpers) wake_.notify_all();
    else for (size_t i = 0; i < wanted; ++i) wake_.notify_one();
    std::unique_lock<std::mutex> lk(mu_);
    while (job.next < job.k) {
      const size_t i = claim_locked(job);
      lk.unlock();
      job.fn(job.ctx, i, 0);
      lk.lock();
      ++job.done;
    }
    // helpers still on their chunks: the last one to finish wakes this thread
    finished_.wait(lk, [&] { return job.done == job.k; });
  }

 private:
  struct Job {
    void (*fn)(void*, size_t, size_t);
    void* ctx;
    size_t k;
    size_t slots;      // the most threads on it at once, the caller included
    uint64_t seq = 0;  // unique per queued job (a Job's address is reused call after call)
    size_t next = 0;   // the next chunk to claim (under mu_)
    size_t done = 0;   // chunks finished (under mu_)
    size_t joined = 1;  // slots taken (under mu_); the caller holds slot 0
  };

  template <class F>
  static void call(void* ctx, size_t i, size_t slot) { (*static_cast<F*>(ctx))(i, slot); }

  // The first queued job a helper may take a chunk of: the one it holds a slot in (`seq`), or one
  // with a slot free.  nullptr: none.
  Job* open_job_locked(uint64_t seq) const {
    for (Job* j : jobs_)
      if (j->seq == seq || j->joined < j->slots) return j;
    return nullptr;
  }

  // The job's next chunk; the job leaves the queue with its last one, so no thread finds it
  // there once every chunk is claimed (and none touches it after its `done` count is full).
  size_t claim_locked(Job& job) {
    const size_t i = job.next++;
    if (job.next == job.k) {
      for (auto it = jobs_.begin(); it != jobs_.end(); ++it)
        if (*it == &job) { jobs_.erase(it); break; }
    }
    return i;
  }

  void start_locked() {
    if (!threads_.empty()) return;
    threads_.reserve(helpers_);
    for (size_t i = 0; i < helpers_; ++i) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (...) {  // no thread to be had (std::system_error): the callers do the chunks
        break;
      }
    }
    helpers_ = threads_.size();
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    uint64_t my_seq = 0;  // the job this helper last held a slot in, and that slot
    size_t my_slot = 0;
    while (true) {
      Job* found = nullptr;
      wake_.wait(lk, [&] { return stop_ || (found = open_job_locked(my_seq)) != nullptr; });
      if (stop_) return;
      Job& job = *found;
      if (job.seq != my_seq) {
        my_seq = job.seq;
        my_slot = job.joined++;
      }
      const size_t i = claim_locked(job);
      lk.unlock();
      job.fn(job.ctx, i, my_slot);
      lk.lock();
      if (++job.done == job.k) finished_.notify_all();
    }
  }

  size_t helpers_;
  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable wake_, finished_;
  std::deque<Job*> jobs_;
  std::vector<std::thread> threads_;
  uint64_t seq_ = 0;  // the last job number given (under mu_)
  bool stop_ = false;
};

}  // namespace ttn
