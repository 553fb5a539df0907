/* A pool of helper threads that the decode thread shares between its parallel loops (the matrix
 * products, attention): fs_pool_run(pl, fn, ctx, n_items, chunk) calls fn(ctx, begin, end) over
 * [0, n_items) in tasks of `chunk` items, on the caller and the helpers, and returns when all ran.
 *
 * Tasks are claimed one at a time under a mutex. Which thread runs which task must not change any
 * number (callers keep every output's arithmetic inside one task), so the claiming may be dynamic:
 * when a helper's core is busy with another process (the event loop, on a 2-core machine), the
 * caller simply takes the tasks that helper has not claimed, and waits only for the running ones.
 * Between runs a helper spins for spin_ns (the next loop of a decode step usually comes within
 * tens of microseconds, and waking a sleeping thread costs about as much), then sleeps on a
 * condition variable; the caller spins as long for the last running task before it sleeps.
 * One caller at a time: the pool belongs to one thread (the decode thread).
 *
 * Between a decode step's products the memory is idle: a helper waits while the caller quantizes the
 * next activations or runs the element-wise ops, and at a product's end one thread waits for the
 * other's last task. fs_pool_then(pl, p, bytes) names the first bytes of the caller's next product;
 * from the start of the next run on, a thread that would spin prefetches them instead, a slice at a
 * time (a prefetch never faults and changes no number), so the next product starts on cached rows. */
#ifndef FASTSERVE_POOL_H
#define FASTSERVE_POOL_H

#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <unistd.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define FS_POOL_MAX_THREADS 64

typedef void (*fs_task_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct fs_pool {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int n_helpers, stop, active;     /* written under mu; stop, active and gen also read unlocked */
    uint64_t gen;
    int64_t spin_ns;
    pid_t owner;
    fs_task_fn fn;
    void *ctx;
    int64_t n_items, chunk, n_tasks, next;
    const uint8_t *then;             /* fs_pool_then's region: written by the owner, read unlocked */
    int64_t then_bytes, then_at;     /* then_at: the next slice to prefetch, claimed atomically */
    uint64_t then_gen;               /* armed from this run on (gen >= then_gen) */
    pthread_t th[FS_POOL_MAX_THREADS];
} fs_pool;

#define FS_POOL_THEN_SLICE 2048      /* bytes a waiting thread prefetches between two looks at its wait */

static inline int64_t fs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void fs_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One slice of the armed fs_pool_then region into the cache, else a pause. A reader may see the
 * region of the call before (the owner rewrites it unlocked): then it prefetches old rows, harmless. */
static inline void fs_pool_wait_step(fs_pool *pl)
{
    const int64_t n = __atomic_load_n(&pl->then_bytes, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&pl->gen, __ATOMIC_ACQUIRE) < __atomic_load_n(&pl->then_gen, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&pl->then_at, __ATOMIC_RELAXED) >= n) {
        fs_relax();
        return;
    }
    const int64_t at = __atomic_fetch_add(&pl->then_at, FS_POOL_THEN_SLICE, __ATOMIC_RELAXED);
    const uint8_t *p = __atomic_load_n(&pl->then, __ATOMIC_RELAXED);
    for (int64_t off = at; off < at + FS_POOL_THEN_SLICE && off < n; off += 64)
        __builtin_prefetch(p + off, 0, 2);
}

/* The owner's next product reads [p, p + bytes) first: prefetched by waiting threads from the next
 * run's start (not before: while the caller prepares that run they would fetch ahead of it). */
static inline void fs_pool_then(fs_pool *pl, const uint8_t *p, int64_t bytes)
{
    if (!pl)
        return;
    __atomic_store_n(&pl->then_gen, UINT64_MAX, __ATOMIC_RELEASE);
    __atomic_store_n(&pl->then_bytes, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pl->then, p, __ATOMIC_RELAXED);
    __atomic_store_n(&pl->then_at, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pl->then_bytes, p ? bytes : 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pl->then_gen, pl->gen + 1, __ATOMIC_RELEASE);
}

/* Spins (unlocked) until the pool's running tasks are done or spin_ns pass; returns 1 when they are. */
static inline int fs_spin_until_idle(fs_pool *pl)
{
    int64_t t0 = fs_now_ns();
    for (int i = 1;; i++) {
        if (__atomic_load_n(&pl->active, __ATOMIC_ACQUIRE) == 0)
            return 1;
        fs_pool_wait_step(pl);
        if ((i & 63) == 0 && fs_now_ns() - t0 > pl->spin_ns)
            return 0;
    }
}

static inline int fs_spin_while_gen(fs_pool *pl, uint64_t seen)
{
    int64_t t0 = fs_now_ns();
    for (int i = 1;; i++) {
        if (__atomic_load_n(&pl->gen, __ATOMIC_ACQUIRE) != seen || __atomic_load_n(&pl->stop, __ATOMIC_ACQUIRE))
            return 1;
        fs_pool_wait_step(pl);
        if ((i & 63) == 0 && fs_now_ns() - t0 > pl->spin_ns)
            return 0;
    }
}

static inline void fs_task_range(const fs_pool *pl, int64_t t, int64_t *b, int64_t *e)
{
    *b = t * pl->chunk;
    *e = *b + pl->chunk < pl->n_items ? *b + pl->chunk : pl->n_items;
}

static inline void *fs_helper_main(void *arg)
{
    fs_pool *pl = (fs_pool *)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pl->mu);
    for (;;) {
        if (pl->spin_ns > 0 && !pl->stop && pl->gen == seen) {
            pthread_mutex_unlock(&pl->mu);
            fs_spin_while_gen(pl, seen);
            pthread_mutex_lock(&pl->mu);
        }
        while (!pl->stop && pl->gen == seen)
            pthread_cond_wait(&pl->work, &pl->mu);
        if (pl->stop)
            break;
        seen = pl->gen;
        while (pl->next < pl->n_tasks) {
            int64_t b, e;
            fs_task_range(pl, pl->next++, &b, &e);
            fs_task_fn fn = pl->fn;
            void *ctx = pl->ctx;
            __atomic_store_n(&pl->active, pl->active + 1, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&pl->mu);
            fn(ctx, b, e);
            pthread_mutex_lock(&pl->mu);
            __atomic_store_n(&pl->active, pl->active - 1, __ATOMIC_RELEASE);
            if (pl->active == 0)
                pthread_cond_signal(&pl->done);
        }
    }
    pthread_mutex_unlock(&pl->mu);
    return NULL;
}

static inline void fs_pool_free(fs_pool *pl)
{
    if (!pl)
        return;
    if (pl->owner == getpid()) {     /* a forked child has none of the parent's threads */
        pthread_mutex_lock(&pl->mu);
        __atomic_store_n(&pl->stop, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&pl->work);
        pthread_mutex_unlock(&pl->mu);
        for (int i = 0; i < pl->n_helpers; i++)
            pthread_join(pl->th[i], NULL);
        pthread_mutex_destroy(&pl->mu);
        pthread_cond_destroy(&pl->work);
        pthread_cond_destroy(&pl->done);
    }
    free(pl);
}

/* A pool of n_threads - 1 helpers (the caller is the n-th thread); NULL when out of resources. */
static inline fs_pool *fs_pool_new(int n_threads, int64_t spin_ns)
{
    fs_pool *pl = (fs_pool *)calloc(1, sizeof(fs_pool));
    if (!pl)
        return NULL;
    pl->spin_ns = spin_ns;
    pthread_mutex_init(&pl->mu, NULL);
    pthread_cond_init(&pl->work, NULL);
    pthread_cond_init(&pl->done, NULL);
    pl->owner = getpid();
    int want = n_threads - 1 < FS_POOL_MAX_THREADS ? n_threads - 1 : FS_POOL_MAX_THREADS;
    for (int i = 0; i < want; i++) {
        if (pthread_create(&pl->th[i], NULL, fs_helper_main, pl) != 0) {
            fs_pool_free(pl);
            return NULL;
        }
        pl->n_helpers++;
    }
    return pl;
}

/* Runs fn over [0, n_items) in tasks of chunk items on the caller and the pool's helpers (pl may be
 * NULL, or have no helpers: then the caller runs everything, in one call). */
static inline void fs_pool_run(fs_pool *pl, fs_task_fn fn, void *ctx, int64_t n_items, int64_t chunk)
{
    if (n_items <= 0)
        return;
    if (chunk < 1)
        chunk = 1;
    if (!pl || pl->n_helpers == 0 || n_items <= chunk || pl->owner != getpid()) {
        fn(ctx, 0, n_items);
        return;
    }
    pthread_mutex_lock(&pl->mu);
    pl->fn = fn;
    pl->ctx = ctx;
    pl->n_items = n_items;
    pl->chunk = chunk;
    pl->n_tasks = (n_items + chunk - 1) / chunk;
    pl->next = 0;
    __atomic_store_n(&pl->gen, pl->gen + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pl->work);
    while (pl->next < pl->n_tasks) {
        int64_t b, e;
        fs_task_range(pl, pl->next++, &b, &e);
        pthread_mutex_unlock(&pl->mu);
        fn(ctx, b, e);
        pthread_mutex_lock(&pl->mu);
    }
    if (pl->active > 0 && pl->spin_ns > 0) {
        pthread_mutex_unlock(&pl->mu);
        fs_spin_until_idle(pl);
        pthread_mutex_lock(&pl->mu);
    }
    while (pl->active > 0)
        pthread_cond_wait(&pl->done, &pl->mu);
    pthread_mutex_unlock(&pl->mu);
}

#endif /* FASTSERVE_POOL_H */
