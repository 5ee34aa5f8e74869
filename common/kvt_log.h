/* kvt_log: leveled logging to stderr, assertions and a rate-limited error reporter.
 *
 * Lines carry the syslog priority prefix journald understands ("<4>"); when not under
 * journald (no JOURNAL_STREAM) a UTC timestamp is added. Any thread may log: one line is one
 * write(2), so lines never interleave. The level is set at start-up and again by a SIGHUP reload
 * (main thread); every thread reads it (an atomic int: a line may still go out at the old
 * level while it changes). */
#ifndef KVT_LOG_H
#define KVT_LOG_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

typedef enum {
    KVT_LOG_ERROR = 3,
    KVT_LOG_WARN = 4,
    KVT_LOG_INFO = 6,
    KVT_LOG_DEBUG = 7,
} kvt_log_level_t;

extern _Atomic int kvt__log_level;

void kvt_log_set_level(kvt_log_level_t level);
kvt_log_level_t kvt_log_get_level(void);

/* Parses "error", "warn", "info", "debug"; returns 0 or KVT_EINVAL. */
int kvt_log_level_parse(const char *s, kvt_log_level_t *out);

const char *kvt_log_level_name(kvt_log_level_t level);

void kvt_log_emit(kvt_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Tests the level before evaluating the arguments. */
#define kvt_log(level, ...)                                                                    \
    do {                                                                                       \
        if ((int)(level) <= kvt__log_level)                                                    \
            kvt_log_emit((level), __VA_ARGS__);                                                \
    } while (0)

/* Async-signal-safe: writes a fixed string with write(2) only. */
void kvt_log_raw_from_handler(const char *msg);

/* Always compiled in: logs file:line and the expression, then aborts with a core. For
 * invariants only, never for input. */
#define kvt_assert(expr)                                                                       \
    ((expr) ? (void)0 : kvt__assert_fail(#expr, __FILE__, __LINE__))
void kvt__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

/* Rate-limited reporter for repeated errors: the first report of a window is logged, the
 * rest are counted and summarised as "... (suppressed N in 10s)" with the next logged line.
 * Thread-safe. Declare one per error site with KVT_ERRREP_INIT. */
typedef struct kvt_errrep {
    pthread_mutex_t lock;
    uint64_t window_ms;
    uint64_t window_start;
    uint64_t suppressed;
} kvt_errrep_t;

#define KVT_ERRREP_INIT(ms) {PTHREAD_MUTEX_INITIALIZER, (ms), 0, 0}

void kvt_errrep_report(kvt_errrep_t *rep, kvt_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Monotonic clock in milliseconds / nanoseconds, and wall clock in seconds. */
uint64_t kvt_now_ms(void);
uint64_t kvt_now_ns(void);
double kvt_wall_s(void);

/* A condition variable that times out on the monotonic clock, and the deadline timeout_ms
 * from now on that clock for its pthread_cond_timedwait. */
void kvt_cond_init_mono(pthread_cond_t *c);
struct timespec kvt_mono_deadline(int64_t timeout_ms);

#endif
