/* DESIGN: a small handle around pthread_create: the body's verdict (asked to stop, or not) goes
 * to kvt_sup_thread_exit when it returns, so no thread can end without the supervisor knowing
 * how. The handle is written by the starting thread before pthread_create and only read by the
 * new thread, so it needs no lock. */
#include "kvt_thread.h"

#include "kvt_log.h"

#include <pthread.h>
#include <stdlib.h>

#define S_IDLE_MAX_MS 200

struct kvt_thread {
    pthread_t tid;
    kvt_sup_thread_t *beat; /* NULL: unsupervised */
    uint32_t max_silence_ms;
    kvt_thread_fn fn;
    void *arg;
};

static void *s_main(void *p)
{
    kvt_thread_t *t = p;
    bool expected = t->fn(t, t->arg);
    if (t->beat)
        kvt_sup_thread_exit(t->beat, expected);
    return NULL;
}

kvt_thread_t *kvt_thread_start(kvt_sup_t *sup, const char *name, uint32_t max_silence_ms,
                               kvt_thread_fn fn, void *arg)
{
    kvt_thread_t *t = calloc(1, sizeof *t);
    kvt_assert(t);
    t->beat = sup ? kvt_sup_register(sup, name, max_silence_ms) : NULL;
    t->max_silence_ms = max_silence_ms;
    t->fn = fn;
    t->arg = arg;
    if (pthread_create(&t->tid, NULL, s_main, t) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

void kvt_thread_join(kvt_thread_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    pthread_join((*self_p)->tid, NULL);
    free(*self_p);
    *self_p = NULL;
}

bool kvt_thread_beat(kvt_thread_t *t)
{
    return t->beat ? kvt_sup_beat(t->beat) : true;
}

int64_t kvt_thread_idle_ms(const kvt_thread_t *t)
{
    if (!t->beat) /* still wakes: bodies do periodic work (L2 health probes) between pops */
        return S_IDLE_MAX_MS;
    uint32_t ms = t->max_silence_ms / 10;
    return ms < S_IDLE_MAX_MS ? ms : S_IDLE_MAX_MS;
}
