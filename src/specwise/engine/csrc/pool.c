/* specwise CPU kernels: the thread pool every parallel section runs on.
 *
 * A section is `units` independent pieces of work; whoever is free claims the next one (the calling thread
 * included), so a worker the OS has descheduled — a busy neighbour on the same cores, a compile — delays the pass
 * by at most the unit it holds, never by its whole share. Idle workers spin for SPIN_NS, then sleep. Which thread
 * runs a unit never changes what the unit computes (the contract: no element is split across units). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "internal.h"
#include "simd.h"

#define SPIN_NS 200000L


/* ticket = generation (16 bits) | threads allowed (8) | units (20) | next unit to claim (20): one atomic word, so a
 * claim (a compare-and-swap that bumps `next`) can only succeed for a live section and a unit it really has. */
#define T_GEN(t) ((t) >> 48)
#define T_THREADS(t) ((int)(((t) >> 40) & 0xff))
#define T_UNITS(t) ((int)(((t) >> 20) & 0xfffff))
#define T_NEXT(t) ((int)((t) & 0xfffff))
#define MAX_UNITS 0xfffff

static struct {
  pthread_mutex_t run_lock; /* one section at a time, whoever calls */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int started;
  _Atomic uint64_t ticket;
  _Atomic int done; /* units finished in the current section */
  _Atomic int sleepers;
  unit_fn fn;
  void* ctx;
} pool = {.run_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int worker_ids[MAX_THREADS];

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}


/* Claim and run units of the section `gen` until none is left; thread is the caller's index. */
static void work_on(uint64_t gen, int thread) {
  uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
  while (T_GEN(t) == gen && T_NEXT(t) < T_UNITS(t)) {
    if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire)) {
      pool.fn(pool.ctx, T_NEXT(t), thread);
      atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
      t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
  }
}

static void* worker(void* arg) {
  const int id = *(const int*)arg; /* thread index: 1.. */
  uint64_t seen = T_GEN(atomic_load(&pool.ticket));
  for (;;) {
    const long start = now_ns();
    int spins = 0;
    while (T_GEN(atomic_load_explicit(&pool.ticket, memory_order_acquire)) == seen) {
      cpu_relax();
      if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.sleepers, 1);
        while (T_GEN(atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.mu);
        break;
      }
    }
    const uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    seen = T_GEN(t);
    if (id < T_THREADS(t)) work_on(seen, id);
  }
  return NULL;
}

/* Run fn(ctx, u, thread) for u = 0..units-1 on up to T threads (thread < T), the caller taking part. */
void sw_parallel(unit_fn fn, void* ctx, int units, int T) {
  if (T > MAX_THREADS) T = MAX_THREADS;
  if (T <= 1 || units <= 1 || units > MAX_UNITS) {
    for (int u = 0; u < units; u++) fn(ctx, u, 0);
    return;
  }
  pthread_mutex_lock(&pool.run_lock);
  while (pool.started < T - 1) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    worker_ids[pool.started] = pool.started + 1;
    const int ok = pthread_create(&th, &attr, worker, &worker_ids[pool.started]) == 0;
    pthread_attr_destroy(&attr);
    if (!ok) break;
    pool.started++;
  }
  if (T - 1 > pool.started) T = pool.started + 1;
  pool.fn = fn;
  pool.ctx = ctx;
  atomic_store(&pool.done, 0);
  const uint64_t gen = (T_GEN(atomic_load(&pool.ticket)) + 1) & 0xffff;
  /* sequentially consistent: ordered before the read of sleepers below, so a worker going to sleep either sees the
   * new generation or is seen and woken */
  atomic_store(&pool.ticket, gen << 48 | (uint64_t)T << 40 | (uint64_t)units << 20);
  if (atomic_load(&pool.sleepers) > 0) {
    pthread_mutex_lock(&pool.mu);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
  }
  work_on(gen, 0);
  for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < units; spins++) {
    if (spins < 4096)
      cpu_relax();
    else
      sched_yield(); /* a unit is held by a worker the OS took away: let it run */
  }
  pthread_mutex_unlock(&pool.run_lock);
}
