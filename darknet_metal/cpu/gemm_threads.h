/* The CPU executor's GEMM threads (used by blas.pyx only).
 *
 * A large GEMM is cut into parts (blocks of output columns or rows, see blas.pyx), and the
 * parts are handed out one at a time to whichever thread asks first: the calling thread and
 * a few helper threads (the CPU count minus one by default; DARKNET_METAL_CPU_THREADS sets
 * the total). After a job a helper polls for the next one for DM_SPIN_NS (2 ms), then
 * sleeps on a condition variable: waking a sleeping thread costs ~50 us on a virtual machine,
 * which the 16 back-to-back small GEMMs of a Winograd layer would pay each time; and with a
 * 200 us poll, helpers that slept between the layers of a pass left the first passes after
 * a few hundred milliseconds of idling at one thread's speed or worse (yolov3-tiny 45 against
 * 24 ms on a 2-core virtual machine; polling through a pass's gaps, 26-29 ms). For its first
 * DM_PAUSE_NS (0.5 ms) the poll keeps the core (a pause instruction between looks), then it
 * yields the core to any other runnable thread at each turn. Yielding from the start cost a
 * third of the speed beside other processes' load: the scheduler gives a yielding thread's
 * turn to the other work for the rest of its slice (a 4 ms tick), so a helper that yielded in
 * the short gap between two jobs of a pass came back after the caller had done the next few
 * jobs alone (it did 15% of the parts, against 47% on a quiet machine), and a caller that
 * yielded while a helper finished the last part lost its core the same way (yolov3-tiny
 * beside two busy loops 43 ms yielding at once, 31 ms after 0.5 ms; docs/performance-history.md).
 * The poll is bounded: it cannot starve other work the way BLAS's own spinning workers do.
 * A helper woken from its sleep onto the CPU its caller runs on moves itself to another one
 * (dm_leave_cpu) instead of sharing a core with the caller until the scheduler balances.
 * The caller polls the same way for the parts helpers are finishing, and waits only for
 * parts a helper has already started: when the cores are busy with other work and a helper
 * is not scheduled, the caller does its parts too instead of waiting for it. One job runs at
 * a time; a GEMM issued while the pool is busy (another thread's network) runs whole on its
 * caller.
 *
 * While our GEMMs run, the BLAS library's own thread count is held at one (each part is one
 * single-threaded BLAS call), and the previous count is restored when the last of our GEMMs
 * in flight returns, so other users of that BLAS in the process keep their setting. The
 * set/get functions are looked up once in the library that provides sgemm (scipy-openblas32's
 * OpenBLAS: scipy_openblas_*, or a plain OpenBLAS: openblas_*); a BLAS without them is
 * left alone.
 */
#ifndef DARKNET_METAL_CPU_GEMM_THREADS_H
#define DARKNET_METAL_CPU_GEMM_THREADS_H

/* dladdr and RTLD_NOLOAD are GNU extensions in glibc (Python.h defines this too). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>

/* How long a helper polls for the next job before it sleeps, in nanoseconds. */
#define DM_SPIN_NS 2000000L
/* How long the poll keeps the core before it starts yielding it, in nanoseconds. */
#define DM_PAUSE_NS 500000L

#define DM_GEMM_MAX_THREADS 64

typedef void (*dm_part_fn)(void *ctx, int part);

typedef struct {
    pthread_mutex_t lock;    /* guards everything below but `busy` */
    pthread_cond_t work;     /* helpers: a job was posted */
    pthread_cond_t done;     /* caller: a helper finished a part */
    pthread_mutex_t busy;    /* held by the caller of the running job */
    int threads;             /* total, caller included */
    int helpers_started;
    unsigned long generation;
    dm_part_fn fn;
    void *ctx;
    int parts, next, finished;
    int caller_cpu;          /* the CPU the running job's caller posted it from, or -1 */
    /* BLAS thread count: held at one while `blas_users` > 0. */
    int blas_users, blas_saved;
} dm_gemm_pool_t;

static dm_gemm_pool_t dm_pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, NULL, NULL, 0, 0, 0, -1, 0, 0};
static pthread_once_t dm_pool_once = PTHREAD_ONCE_INIT;
static void (*dm_blas_set_threads)(int) = NULL;
static int (*dm_blas_get_threads)(void) = NULL;
static void *dm_blas_probe = NULL; /* an address inside the BLAS library (sgemm) */

/* A hint to the core that this thread is polling (lets a sibling hyperthread run). */
static inline void dm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb" ::: "memory");
#endif
}

/* One turn of a bounded poll begun at t0: a few pause instructions for the first DM_PAUSE_NS,
 * after that a yield (other runnable work on this core goes first; alone, the poll goes on);
 * false once DM_SPIN_NS have passed. */
static int dm_poll_turn(const struct timespec *t0) {
    struct timespec t1;
    long elapsed;
    int i;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    elapsed = (t1.tv_sec - t0->tv_sec) * 1000000000L + (t1.tv_nsec - t0->tv_nsec);
    if (elapsed < DM_PAUSE_NS)
        for (i = 0; i < 16; i++) dm_cpu_relax();
    else
        sched_yield();
    return elapsed <= DM_SPIN_NS;
}

/* Moves the calling thread off `cpu` (to another CPU it may run on), leaving its affinity as
 * it was. A helper woken from its sleep is often placed on the waking caller's CPU (the
 * scheduler's wake-affine choice, frequent after the process idled ~50 ms or more): the two
 * then share one core until the balancer moves one of them, a scheduler tick or two later,
 * and a yolov3-tiny pass took 18 instead of 12 ms on a 2-core virtual machine in about half
 * the passes after a 100 ms pause (every such pass was one where the two threads traded
 * CPUs). Restricting the mask moves the thread at once; restoring it does not move it back. */
static void dm_leave_cpu(int cpu) {
#if defined(__linux__)
    cpu_set_t allowed, others;
    if (cpu < 0 || cpu >= CPU_SETSIZE) return;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu, &allowed)) return;
    others = allowed;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) == 0) return;
    if (sched_setaffinity(0, sizeof others, &others) == 0)
        sched_setaffinity(0, sizeof allowed, &allowed);
#else
    (void)cpu;
#endif
}

/* The CPU the calling thread runs on, or -1 where that cannot be read. */
static int dm_current_cpu(void) {
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
}

static void *dm_gemm_helper(void *arg) {
    dm_gemm_pool_t *p = &dm_pool;
    unsigned long seen;
    (void)arg;
    pthread_mutex_lock(&p->lock);
    seen = p->generation;
    for (;;) {
        if (p->generation == seen) {
            struct timespec t0;
            pthread_mutex_unlock(&p->lock);
            clock_gettime(CLOCK_MONOTONIC, &t0);
            while (__atomic_load_n(&p->generation, __ATOMIC_ACQUIRE) == seen &&
                   dm_poll_turn(&t0)) {
            }
            pthread_mutex_lock(&p->lock);
        }
        if (p->generation == seen) {
            while (p->generation == seen) pthread_cond_wait(&p->work, &p->lock);
            if (p->caller_cpu >= 0 && dm_current_cpu() == p->caller_cpu) {
                int cpu = p->caller_cpu;
                pthread_mutex_unlock(&p->lock);
                dm_leave_cpu(cpu);
                pthread_mutex_lock(&p->lock);
            }
        }
        seen = p->generation;
        while (p->next < p->parts) {
            int part = p->next++;
            dm_part_fn fn = p->fn;
            void *ctx = p->ctx;
            pthread_mutex_unlock(&p->lock);
            fn(ctx, part);
            pthread_mutex_lock(&p->lock);
            if (__atomic_add_fetch(&p->finished, 1, __ATOMIC_RELEASE) == p->parts)
                pthread_cond_signal(&p->done);
        }
    }
    return NULL;
}

static void dm_pool_after_fork(void) {
    /* The child has the calling thread only: start again without helpers. */
    dm_gemm_pool_t *p = &dm_pool;
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->busy, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->helpers_started = 0;
    p->parts = p->next = p->finished = 0;
    p->blas_users = 0;
}

static void dm_pool_init(void) {
    dm_gemm_pool_t *p = &dm_pool;
    const char *env = getenv("DARKNET_METAL_CPU_THREADS");
    long n = env != NULL && *env ? strtol(env, NULL, 10) : 0;
    Dl_info info;
    void *lib = NULL;
    if (n < 1) n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > DM_GEMM_MAX_THREADS) n = DM_GEMM_MAX_THREADS;
    p->threads = (int)n;
    pthread_atfork(NULL, NULL, dm_pool_after_fork);
    if (dm_blas_probe != NULL && dladdr(dm_blas_probe, &info) && info.dli_fname != NULL)
        lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib != NULL) {
        void *set = dlsym(lib, "scipy_openblas_set_num_threads");
        void *get = dlsym(lib, "scipy_openblas_get_num_threads");
        if (set == NULL || get == NULL) {
            set = dlsym(lib, "openblas_set_num_threads");
            get = dlsym(lib, "openblas_get_num_threads");
        }
        if (set != NULL && get != NULL) {
            *(void **)&dm_blas_set_threads = set;
            *(void **)&dm_blas_get_threads = get;
        }
        /* The library stays loaded (blas.pyx holds it); dropping our reference is safe. */
        dlclose(lib);
    }
}

/* The number of threads a split GEMM uses, caller included. `probe` is any function of the
 * BLAS library (read on the first call only). */
static int dm_gemm_threads(void *probe) {
    if (dm_blas_probe == NULL) dm_blas_probe = probe;
    pthread_once(&dm_pool_once, dm_pool_init);
    return dm_pool.threads;
}

static void dm_blas_single_enter(void) {
    dm_gemm_pool_t *p = &dm_pool;
    if (dm_blas_set_threads == NULL) return;
    pthread_mutex_lock(&p->lock);
    if (p->blas_users++ == 0) {
        p->blas_saved = dm_blas_get_threads();
        if (p->blas_saved != 1) dm_blas_set_threads(1);
    }
    pthread_mutex_unlock(&p->lock);
}

static void dm_blas_single_exit(void) {
    dm_gemm_pool_t *p = &dm_pool;
    if (dm_blas_set_threads == NULL) return;
    pthread_mutex_lock(&p->lock);
    if (--p->blas_users == 0 && p->blas_saved != 1) dm_blas_set_threads(p->blas_saved);
    pthread_mutex_unlock(&p->lock);
}

/* Runs fn(ctx, 0..parts-1) on the pool; returns when all parts are done. */
static void dm_gemm_run(dm_part_fn fn, void *ctx, int parts) {
    dm_gemm_pool_t *p = &dm_pool;
    int part, i;
    if (p->threads <= 1 || parts <= 1 || pthread_mutex_trylock(&p->busy) != 0) {
        for (part = 0; part < parts; part++) fn(ctx, part);
        return;
    }
    pthread_mutex_lock(&p->lock);
    for (i = p->helpers_started; i < p->threads - 1; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, dm_gemm_helper, NULL) == 0) p->helpers_started++;
        pthread_attr_destroy(&attr);
    }
    p->fn = fn;
    p->ctx = ctx;
    p->parts = parts;
    p->next = 0;
    p->finished = 0;
    p->caller_cpu = dm_current_cpu();
    p->generation++;
    if (p->helpers_started > 0) pthread_cond_broadcast(&p->work);
    while (p->next < p->parts) {
        part = p->next++;
        pthread_mutex_unlock(&p->lock);
        fn(ctx, part);
        pthread_mutex_lock(&p->lock);
        __atomic_add_fetch(&p->finished, 1, __ATOMIC_RELAXED);
    }
    if (p->finished < p->parts) {
        /* The helpers' last parts: polled for like a helper polls for jobs (sleeping here
         * and being woken by the helper's signal cost ~30 us a job on a virtual machine:
         * 2% of a yolov4-tiny pass), then waited for. */
        struct timespec t0;
        pthread_mutex_unlock(&p->lock);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        while (__atomic_load_n(&p->finished, __ATOMIC_ACQUIRE) < parts && dm_poll_turn(&t0)) {
        }
        pthread_mutex_lock(&p->lock);
    }
    while (p->finished < p->parts) pthread_cond_wait(&p->done, &p->lock);
    p->parts = p->next = p->finished = 0;
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&p->busy);
}

#endif
