/* DESIGN: process-wide log level, set at start-up and by a SIGHUP reload, read by every thread
 * (an atomic: a stale level only changes which lines are printed). Each line is formatted into a
 * stack buffer and written with one write(2) so that concurrent threads never interleave within a
 * line. */
#include "kvt_log.h"

#include "kvt_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

_Atomic int kvt__log_level = KVT_LOG_INFO;

static const struct {
    kvt_log_level_t level;
    const char *name;
} s_levels[] = {
    {KVT_LOG_ERROR, "error"},
    {KVT_LOG_WARN, "warn"},
    {KVT_LOG_INFO, "info"},
    {KVT_LOG_DEBUG, "debug"},
};

void kvt_log_set_level(kvt_log_level_t level)
{
    kvt__log_level = (int)level;
}

kvt_log_level_t kvt_log_get_level(void)
{
    return (kvt_log_level_t)kvt__log_level;
}

int kvt_log_level_parse(const char *s, kvt_log_level_t *out)
{
    for (size_t i = 0; i < sizeof s_levels / sizeof s_levels[0]; i++)
        if (strcmp(s, s_levels[i].name) == 0) {
            *out = s_levels[i].level;
            return 0;
        }
    return KVT_EINVAL;
}

const char *kvt_log_level_name(kvt_log_level_t level)
{
    for (size_t i = 0; i < sizeof s_levels / sizeof s_levels[0]; i++)
        if (s_levels[i].level == level)
            return s_levels[i].name;
    return "info";
}

static void s_vemit(kvt_log_level_t level, const char *suffix, const char *fmt, va_list ap)
{
    char line[2048];
    size_t n = 0;
    n += (size_t)snprintf(line, sizeof line, "<%d>", (int)level);
    if (!getenv("JOURNAL_STREAM")) {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n += strftime(line + n, sizeof line - n, "%Y-%m-%dT%H:%M:%S", &tm);
        n += (size_t)snprintf(line + n, sizeof line - n, ".%03ldZ ", ts.tv_nsec / 1000000);
    }
    n += (size_t)snprintf(line + n, sizeof line - n, "%s: ", kvt_log_level_name(level));
    if (n < sizeof line) {
        int w = vsnprintf(line + n, sizeof line - n, fmt, ap);
        n = w < 0 ? n : n + (size_t)w;
    }
    if (suffix && n < sizeof line)
        n += (size_t)snprintf(line + n, sizeof line - n, "%s", suffix);
    if (n >= sizeof line - 1)
        n = sizeof line - 2;
    line[n++] = '\n';
    ssize_t rc = write(STDERR_FILENO, line, n);
    (void)rc;
}

void kvt_log_emit(kvt_log_level_t level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    s_vemit(level, NULL, fmt, ap);
    va_end(ap);
}

void kvt_log_raw_from_handler(const char *msg)
{
    ssize_t rc = write(STDERR_FILENO, msg, strlen(msg));
    (void)rc;
}

void kvt__assert_fail(const char *expr, const char *file, int line)
{
    kvt_log_emit(KVT_LOG_ERROR, "assertion failed at %s:%d: %s", file, line, expr);
    abort();
}

void kvt_errrep_report(kvt_errrep_t *rep, kvt_log_level_t level, const char *fmt, ...)
{
    if ((int)level > kvt__log_level)
        return;
    uint64_t now = kvt_now_ms();
    uint64_t suppressed = 0;
    bool emit = false;
    pthread_mutex_lock(&rep->lock);
    if (rep->window_start == 0 || now - rep->window_start >= rep->window_ms) {
        suppressed = rep->suppressed;
        rep->suppressed = 0;
        rep->window_start = now;
        emit = true;
    } else {
        rep->suppressed++;
    }
    pthread_mutex_unlock(&rep->lock);
    if (!emit)
        return;
    char suffix[96] = "";
    if (suppressed)
        snprintf(suffix, sizeof suffix, " (suppressed %llu in %llus)",
                 (unsigned long long)suppressed, (unsigned long long)(rep->window_ms / 1000));
    va_list ap;
    va_start(ap, fmt);
    s_vemit(level, suffix, fmt, ap);
    va_end(ap);
}

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kvt_now_ms(void)
{
    return kvt_now_ns() / 1000000ull;
}

void kvt_cond_init_mono(pthread_cond_t *c)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(c, &ca);
    pthread_condattr_destroy(&ca);
}

struct timespec kvt_mono_deadline(int64_t timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(timeout_ms / 1000);
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

double kvt_wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}
