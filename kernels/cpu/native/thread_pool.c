/* The native kernels' thread pool (parallel.h says how a kernel uses it).
 *
 * Why not OpenMP's: an OpenMP loop ends at a barrier that waits for every thread of its team, so a
 * team thread that has no core (the gateway, a tokenizer worker or the engine's gRPC thread took it
 * for the token just streamed) holds the whole loop until the scheduler gives it one back, and its
 * static share of the items waits with it; the idle team threads spin meanwhile, taking cores those
 * processes need. Here a loop's items are claimed one at a time by whoever runs (the caller first),
 * the caller waits only for items already claimed, and a pool thread spins a short while after its
 * last item (the gap between two kernels of a layer) and then sleeps (the gap between two steps,
 * when the other processes run). docs/design/engine-threads.md has the measurements.
 *
 * The state a loop is claimed through is one 64-bit word: the loop's generation (24 bits), its
 * claim count (20) and the next claim (20). A thread claims with a compare-and-swap on the whole
 * word, so a claim is never taken from a loop that has ended, however late the thread comes; a
 * claim's function and context are read after the claim succeeds, when the caller cannot have
 * moved on (it waits for every claimed item to be done). One caller at a time: a second (another
 * Python thread calling a kernel, or a kernel called from inside an item) runs its loop alone,
 * which computes the same bits. After fork() the child starts its own threads on first use. */

#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "parallel.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

#define MAX_THREADS 256
#define CLAIM_BITS 20
#define CLAIM_MASK ((UINT64_C(1) << CLAIM_BITS) - 1)
#define MAX_CLAIMS ((int64_t)CLAIM_MASK)
#define GEN_MASK ((UINT64_C(1) << (64 - 2 * CLAIM_BITS)) - 1)

static inline uint64_t pack(uint64_t gen, uint64_t claims, uint64_t next) {
    return (gen << (2 * CLAIM_BITS)) | (claims << CLAIM_BITS) | next;
}
static inline uint64_t gen_of(uint64_t s) { return s >> (2 * CLAIM_BITS); }
static inline int64_t claims_of(uint64_t s) { return (int64_t)((s >> CLAIM_BITS) & CLAIM_MASK); }
static inline int64_t next_of(uint64_t s) { return (int64_t)(s & CLAIM_MASK); }

/* The loop in progress (written by its caller before it publishes the generation, read-only while
 * the loop runs). Each group below has a cache line of its own: the claim word is written by every
 * claim, and a line it shared with the job's fields (or the counter of finished claims) would move
 * between the cores on each read of those as well. */
#define LINE _Alignas(64)
static LINE range_fn _Atomic job_fn;
static void *_Atomic job_ctx;
static _Atomic int64_t job_n, job_grain;
static _Atomic int job_helpers; /* pool threads that may take part: the caller's num_threads - 1 */
static _Atomic int job_guided;  /* claims cover job_starts' ranges (llmserve_pool_for_guided) */
#define MAX_GUIDED 256
static int64_t job_starts[MAX_GUIDED + 1]; /* claim c: items [job_starts[c], job_starts[c + 1]) */
static LINE _Atomic uint64_t state; /* gen | claims | next */
static LINE _Atomic int64_t done;   /* claims finished by pool threads in this loop */

/* Sleeping: threads wait on wake_seq, which each published loop bumps. */
static LINE _Atomic uint32_t wake_seq;
static _Atomic int sleepers;

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int started;     /* pool threads running (under start_lock) */
static uint64_t gen;    /* the last published generation (under run_lock) */
static int64_t spin_ns = -1;

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}
static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take one claim of the loop whose state is s and run it; 0 when s has none left (or moved on). */
static int run_one(uint64_t s, int64_t *ran) {
    if (next_of(s) >= claims_of(s)) return 0;
    if (!atomic_compare_exchange_weak_explicit(&state, &s, s + 1, memory_order_acquire, memory_order_relaxed))
        return 1; /* lost the race: look again */
    const int64_t claim = next_of(s);
    int64_t begin, end;
    if (atomic_load_explicit(&job_guided, memory_order_relaxed)) {
        begin = job_starts[claim];
        end = job_starts[claim + 1];
    } else {
        const int64_t grain = atomic_load_explicit(&job_grain, memory_order_relaxed);
        const int64_t n = atomic_load_explicit(&job_n, memory_order_relaxed);
        begin = claim * grain;
        end = begin + grain < n ? begin + grain : n;
    }
    atomic_load_explicit(&job_fn, memory_order_relaxed)(atomic_load_explicit(&job_ctx, memory_order_relaxed),
                                                        begin, end);
    ++*ran;
    return 1;
}

static void *pool_thread(void *arg) {
    /* Its index (0 .. started - 1), and the generation published last before it was started: the
     * loop its caller is about to publish is one to join. */
    const int index = (int)((uintptr_t)arg & 0xff);
    uint64_t seen = (uintptr_t)arg >> 8;
    for (;;) {
        uint64_t s = atomic_load_explicit(&state, memory_order_acquire);
        if (gen_of(s) != seen && index < atomic_load_explicit(&job_helpers, memory_order_relaxed)) {
            int64_t ran = 0;
            while (gen_of(s) != seen && run_one(s, &ran)) s = atomic_load_explicit(&state, memory_order_acquire);
            if (ran) atomic_fetch_add_explicit(&done, ran, memory_order_release);
            seen = gen_of(s);
            continue;
        }
        seen = gen_of(s);
        /* Nothing to take: spin a while (the next kernel of this layer comes in microseconds),
         * then sleep until a loop is published. */
        const int64_t until = now_ns() + spin_ns;
        int found = 0;
        for (int i = 1;; ++i) {
            CPU_RELAX();
            if (gen_of(atomic_load_explicit(&state, memory_order_relaxed)) != seen) {
                found = 1;
                break;
            }
            if ((i & 255) == 0 && now_ns() >= until) break;
        }
        if (found) continue;
        const uint32_t seq = atomic_load(&wake_seq);
        atomic_fetch_add(&sleepers, 1);
        if (gen_of(atomic_load(&state)) == seen) futex_wait(&wake_seq, seq);
        atomic_fetch_sub(&sleepers, 1);
    }
    return NULL;
}

/* In a fork()ed child: none of the threads came along, nor any loop another thread was running. */
static void forget_threads(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    run_lock = fresh;
    start_lock = fresh;
    started = 0;
    atomic_store(&sleepers, 0);
}

static void start_threads(int wanted) {
    pthread_mutex_lock(&start_lock);
    if (spin_ns < 0) {
        const char *env = getenv("LLMSERVE_POOL_SPIN_US");
        spin_ns = env && *env ? (int64_t)(atof(env) * 1000.0) : 100000;
        pthread_atfork(NULL, NULL, forget_threads);
    }
    if (wanted > MAX_THREADS - 1) wanted = MAX_THREADS - 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (started < wanted) {
        pthread_t t;
        const uintptr_t arg = (uintptr_t)started | (uintptr_t)(gen << 8); /* (under run_lock: gen is stable) */
        if (pthread_create(&t, &attr, pool_thread, (void *)arg) != 0) break; /* fewer helpers */
        ++started;
    }
    pthread_attr_destroy(&attr);
    pthread_mutex_unlock(&start_lock);
}

/* Publishes the loop whose fields the caller set (claims of them), runs claims on the caller until
 * none is left, waits for those the pool threads took, and releases run_lock. */
static void run_published(int32_t num_threads, int64_t claims) {
    atomic_store_explicit(&job_helpers, num_threads - 1, memory_order_relaxed);
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    gen = (gen + 1) & GEN_MASK;
    atomic_store(&state, pack(gen, (uint64_t)claims, 0)); /* publishes the fields set before */
    atomic_fetch_add(&wake_seq, 1);
    if (atomic_load(&sleepers) > 0) futex_wake_all(&wake_seq);
    int64_t mine = 0;
    for (uint64_t s = atomic_load_explicit(&state, memory_order_acquire); run_one(s, &mine);)
        s = atomic_load_explicit(&state, memory_order_acquire);
    /* Only claims already taken are left: wait for them (a preempted holder gets the core back
     * sooner if this thread yields now and then). */
    for (int i = 1; atomic_load_explicit(&done, memory_order_acquire) != claims - mine; ++i) {
        CPU_RELAX();
        if ((i & 1023) == 0) sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
}

void llmserve_pool_for(int32_t num_threads, int64_t n, int64_t grain, range_fn fn, void *ctx) {
    if (grain < 1) grain = 1;
    if (n <= 0) return;
    if (num_threads <= 1 || n <= grain || pthread_mutex_trylock(&run_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (started < num_threads - 1) start_threads(num_threads - 1);
    if ((n + grain - 1) / grain > MAX_CLAIMS) grain = (n + MAX_CLAIMS - 1) / MAX_CLAIMS;
    atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&job_n, n, memory_order_relaxed);
    atomic_store_explicit(&job_grain, grain, memory_order_relaxed);
    atomic_store_explicit(&job_guided, 0, memory_order_relaxed);
    run_published(num_threads, (n + grain - 1) / grain);
}

/* As llmserve_pool_for, with claims that shrink as the loop goes (guided scheduling): each takes
 * ceil(left / (2 * num_threads)) items, at least min_grain, so a loop of many equal, short items (a
 * GEMV's panels) costs a few dozen claims rather than one a panel (each claim moves the claim word
 * between the cores), and its last claims are still small enough to end the threads together. The
 * ranges depend only on n, min_grain and num_threads, and an item's result never depends on who runs
 * it (parallel.h). */
void llmserve_pool_for_guided(int32_t num_threads, int64_t n, int64_t min_grain, range_fn fn, void *ctx) {
    if (min_grain < 1) min_grain = 1;
    if (n <= 0) return;
    if (num_threads <= 1 || n <= min_grain || pthread_mutex_trylock(&run_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (started < num_threads - 1) start_threads(num_threads - 1);
    int64_t claims = 0, at = 0;
    while (at < n) {
        int64_t size = (n - at + 2 * (int64_t)num_threads - 1) / (2 * (int64_t)num_threads);
        if (size < min_grain) size = min_grain;
        if (claims == MAX_GUIDED - 1 || size > n - at) size = n - at; /* the table's last: the rest */
        job_starts[claims++] = at;
        at += size;
    }
    job_starts[claims] = n;
    atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&job_n, n, memory_order_relaxed);
    atomic_store_explicit(&job_grain, min_grain, memory_order_relaxed);
    atomic_store_explicit(&job_guided, 1, memory_order_relaxed);
    run_published(num_threads, claims);
}

/* For tests: the pool threads started so far. */
int32_t llmserve_pool_threads(void) { return started; }
