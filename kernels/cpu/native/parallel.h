/* The kernels' parallel loops, run by the thread pool of thread_pool.c.
 *
 * A loop is a count of independent items (a GEMM's (row chunk, panel) pairs, a norm's rows, an
 * attention (sequence, head, tile)); each item is computed by the same code whichever thread takes
 * it, so a result's bits never depend on the thread count or on who ran what. The pool hands the
 * items out one claim at a time and the caller works through them too: it never waits for a thread
 * that has not started (a pool thread still asleep, or preempted by the gateway on a busy machine,
 * simply takes no item), only for items already claimed (docs/design/engine-threads.md).
 *
 * thread_pool.c is its own library, loaded first and globally (native_build.load); each kernel
 * library takes its entry as a weak symbol: where it is absent the loop runs on the caller alone. */

#ifndef LLMSERVE_PARALLEL_H
#define LLMSERVE_PARALLEL_H

#include <stdint.h>

/* Items [begin, end) of the loop whose context is ctx. */
typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);

extern void llmserve_pool_for(int32_t num_threads, int64_t n, int64_t grain, range_fn fn, void *ctx)
    __attribute__((weak));
extern void llmserve_pool_for_guided(int32_t num_threads, int64_t n, int64_t min_grain, range_fn fn, void *ctx)
    __attribute__((weak));

/* fn over items [0, n), `grain` items a claim, on up to num_threads threads (the caller's among
 * them); on the caller alone where `parallel` is false (too little work to share). */
static inline void parallel_for(int32_t num_threads, int parallel, int64_t n, int64_t grain, range_fn fn,
                                void *ctx) {
    if (n <= 0) return;
    if (parallel && num_threads > 1 && n > grain && llmserve_pool_for)
        llmserve_pool_for(num_threads, n, grain, fn, ctx);
    else
        fn(ctx, 0, n);
}

/* As parallel_for, the items claimed in ranges that shrink as the loop goes (thread_pool.c's
 * llmserve_pool_for_guided): for many equal, short items, where a claim an item costs more than the
 * item's own work spends. */
static inline void parallel_for_guided(int32_t num_threads, int parallel, int64_t n, int64_t min_grain,
                                       range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (parallel && num_threads > 1 && n > min_grain && llmserve_pool_for_guided)
        llmserve_pool_for_guided(num_threads, n, min_grain, fn, ctx);
    else
        parallel_for(num_threads, parallel, n, min_grain, fn, ctx);
}

#endif
