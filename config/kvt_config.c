/* DESIGN: kvt_config owns the option table s_options[] and everything that walks it: embedded
 * defaults, the JSON loader, command-line flags, KVTIER_* environment variables, validation,
 * --print-config output and --help text. One row per option (Redis static_configs[] style): to
 * add an option, add a field to kvt_config_t, one row here and a line in docs/configuration.md.
 * There are no per-option code paths besides the small validators a row may name.
 *
 * Called by daemon/main.c on the main thread at start-up (kvt_config_load), and by unit tests and
 * fuzzers. It keeps no mutable global state, so separate configs are independent. It never writes
 * to stdout/stderr (kvt_config_usage writes only to the FILE it is given): every error is one line
 * in the caller's err buffer, and the caller decides how to report it (main exits with status 2).
 *
 * Order of sources: defaults < JSON file < flags < environment, then kvt_config_finish fills
 * derived defaults (listen, l2) and checks cross-field rules. Applying a source is not
 * transactional: after an error the config is half-applied and must only be destroyed. */
#include "kvt_config.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_ring.h"
#include "kvt_size.h"

#include <ctype.h>
#include <grp.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

typedef enum {
    S_STRING,      /* char * (may carry a validator, e.g. log_level) */
    S_STRING_LIST, /* char *[N] plus an int count at count_off */
    S_SIZE,        /* uint64_t bytes: JSON integer, or "512M"-style text */
    S_UINT32,
    S_UINT64,
    S_DOUBLE,
    S_BOOL,
} s_type_t;

#define S_HIDDEN 0x1u   /* test-only knob: not in --help; in --print-config only when changed */
#define S_OPEN_MIN 0x2u /* DOUBLE: the lower bound is exclusive, (min, max] */

/* Validates a string (or one list item) beyond its type; writes the reason, without the option
 * name, to why. Returns 0 or KVT_EINVAL. */
typedef int (*s_check_fn)(const char *value, char *why, size_t whylen);

typedef struct {
    const char *name; /* JSON path; "debug.fault_mode" is {"debug": {"fault_mode": }} */
    const char *flag; /* "--" + name with '_' and '.' as '-' (checked at start-up) */
    const char *env;  /* "KVTIER_" + upper-case name with '.' as '_' (checked too) */
    s_type_t type;
    size_t off;                /* offsetof(kvt_config_t, field) */
    size_t count_off;          /* lists: offsetof the int count */
    int max_items;             /* lists: capacity of the array, from its declaration */
    const char *items;         /* lists: plural noun for "at most N endpoints" */
    const char *const *starts; /* lists: prefixes that begin a new item when splitting on ',' */
    uint64_t min, max;         /* SIZE and integers: inclusive bounds */
    double dmin, dmax;         /* DOUBLE: bounds, see S_OPEN_MIN */
    const char *def;           /* default as text, parsed like a flag; NULL: empty / derived */
    unsigned flags;
    s_check_fn check;
    const char *metavar;       /* --help: "--l1-size SIZE" */
    const char *shown_default; /* --help: derived defaults ("ipc://RUN_DIR/kvtier.sock") */
    const char *help;
} s_opt_t;

static int s_check_endpoint(const char *v, char *why, size_t whylen);
static int s_check_optional_endpoint(const char *v, char *why, size_t whylen);
static int s_check_http(const char *v, char *why, size_t whylen);
static int s_check_nonempty(const char *v, char *why, size_t whylen);
static int s_check_l2(const char *v, char *why, size_t whylen);
static int s_check_log_level(const char *v, char *why, size_t whylen);
static int s_check_fault_mode(const char *v, char *why, size_t whylen);
static int s_check_hugepages(const char *v, char *why, size_t whylen);

static const char *const s_endpoint_starts[] = {"ipc://", "tcp://", NULL};
static const char *const s_l2_starts[] = {"fs:", "redis:", "mock:", "plugin:", "none", NULL};

#define S_OFF(field) offsetof(kvt_config_t, field)
#define S_CAP(field) ((int)(sizeof(((kvt_config_t *)0)->field) / sizeof(char *)))

#define S_STR(n_, f_, e_, field_, def_, fl_, chk_, meta_, help_)                                   \
    {                                                                                              \
        .name = n_, .flag = f_, .env = e_, .type = S_STRING, .off = S_OFF(field_), .def = def_,    \
        .flags = fl_, .check = chk_, .metavar = meta_, .help = help_                               \
    }
#define S_LIST(n_, f_, e_, field_, count_, items_, starts_, chk_, meta_, shown_, help_)            \
    {                                                                                              \
        .name = n_, .flag = f_, .env = e_, .type = S_STRING_LIST, .off = S_OFF(field_),            \
        .count_off = S_OFF(count_), .max_items = S_CAP(field_), .items = items_,                   \
        .starts = starts_, .check = chk_, .metavar = meta_, .shown_default = shown_, .help = help_ \
    }
#define S_NUM(n_, f_, e_, type_, field_, min_, max_, def_, fl_, meta_, help_)                      \
    {                                                                                              \
        .name = n_, .flag = f_, .env = e_, .type = type_, .off = S_OFF(field_), .min = min_,       \
        .max = max_, .def = def_, .flags = fl_, .metavar = meta_, .help = help_                    \
    }
#define S_DBL(n_, f_, e_, field_, min_, max_, def_, fl_, meta_, help_)                             \
    {                                                                                              \
        .name = n_, .flag = f_, .env = e_, .type = S_DOUBLE, .off = S_OFF(field_), .dmin = min_,   \
        .dmax = max_, .def = def_, .flags = fl_, .metavar = meta_, .help = help_                   \
    }
#define S_BOOLEAN(n_, f_, e_, field_, def_, fl_, help_)                                            \
    {                                                                                              \
        .name = n_, .flag = f_, .env = e_, .type = S_BOOL, .off = S_OFF(field_), .def = def_,      \
        .flags = fl_, .metavar = "BOOL", .help = help_                                             \
    }

#define S_K (1ull << 10)
#define S_M (1ull << 20)
#define S_G (1ull << 30)
#define S_T (1ull << 40)

/* The order of rows is the order of --help and --print-config. */
static const s_opt_t s_options[] = {
    S_LIST("listen", "--listen", "KVTIER_LISTEN", listen, n_listen, "endpoints", s_endpoint_starts,
           s_check_endpoint, "ENDPOINT", "ipc://RUN_DIR/kvtier.sock",
           "ZMQ endpoint to bind (repeatable); tcp:// must be loopback"),
    S_STR("http", "--http", "KVTIER_HTTP", http, "127.0.0.1:8080", 0, s_check_http, "ADDR:PORT",
          "HTTP health/metrics/status address; \"\" disables HTTP"),
    S_NUM("http_max_connections", "--http-max-connections", "KVTIER_HTTP_MAX_CONNECTIONS", S_UINT32,
          http_max_connections, 16, 65536, "1024", 0, "N",
          "most HTTP connections at once (at most half the free file descriptors)"),
    S_NUM("http_timeout_s", "--http-timeout-s", "KVTIER_HTTP_TIMEOUT_S", S_UINT32, http_timeout_s,
          1, 3600, "3", 0, "S", "an HTTP connection idle (or sending nothing) this long is closed"),
    S_STR("http_hosts", "--http-hosts", "KVTIER_HTTP_HOSTS", http_hosts, "", 0, NULL, "NAMES",
          "host names besides IP addresses, localhost and this machine's name that HTTP answers "
          "to (comma-separated)"),
    S_STR("events", "--events", "KVTIER_EVENTS", events, "", 0, s_check_optional_endpoint,
          "ENDPOINT", "ZMQ PUB endpoint for cache events; \"\" for none"),
    S_NUM("event_log_size", "--event-log-size", "KVTIER_EVENT_LOG_SIZE", S_UINT32, event_log_size,
          0, 1048576, "32768", 0, "N",
          "L1/L2 change records kept for the events socket and LMCache's poll_kv_events (0: no "
          "log, no events)"),
    S_STR("run_dir", "--run-dir", "KVTIER_RUN_DIR", run_dir, "./var/run", 0, s_check_nonempty,
          "DIR", "runtime directory (ipc socket)"),
    S_STR("data_dir", "--data-dir", "KVTIER_DATA_DIR", data_dir, "./var/data", 0, s_check_nonempty,
          "DIR", "data directory (home of the default fs L2)"),
    S_NUM("l1_size", "--l1-size", "KVTIER_L1_SIZE", S_SIZE, l1_size, S_M, S_T, "1G", 0, "SIZE",
          "L1 shared-memory arena size"),
    S_NUM("chunk_tokens", "--chunk-tokens", "KVTIER_CHUNK_TOKENS", S_UINT32, chunk_tokens, 1,
          1048576, "256", 0, "N", "tokens per KV chunk"),
    S_NUM("lease_ms", "--lease-ms", "KVTIER_LEASE_MS", S_UINT32, lease_ms, 100, 86400000, "30000",
          0, "MS", "lease lifetime; a silent client instance loses its leases"),
    S_DBL("high_watermark", "--high-watermark", "KVTIER_HIGH_WATERMARK", high_watermark, 0.0, 1.0,
          "0.90", S_OPEN_MIN, "F", "L1 fill fraction at which eviction starts"),
    S_DBL("low_watermark", "--low-watermark", "KVTIER_LOW_WATERMARK", low_watermark, 0.0, 1.0,
          "0.80", S_OPEN_MIN, "F", "L1 fill fraction eviction brings it down to (< high)"),
    S_LIST("l2", "--l2", "KVTIER_L2", l2, n_l2, "adapters", s_l2_starts, s_check_l2, "SPEC",
           "fs:DATA_DIR/l2",
           "L2 adapter (repeatable): fs:DIR, redis:HOST:PORT, mock:OPTS, plugin:PATH, none"),
    S_STR("log_level", "--log-level", "KVTIER_LOG_LEVEL", log_level, "info", 0, s_check_log_level,
          "LEVEL", "error, warn, info or debug"),
    S_NUM("max_message", "--max-message", "KVTIER_MAX_MESSAGE", S_SIZE, max_message, 4 * S_K,
          4 * S_G, "256M", 0, "SIZE", "largest request, all frames together"),
    S_NUM("max_keys", "--max-keys", "KVTIER_MAX_KEYS", S_UINT32, max_keys, 1, 1048576, "65536", 0,
          "N", "most keys in one request"),
    S_NUM("max_prefetch_jobs", "--max-prefetch-jobs", "KVTIER_MAX_PREFETCH_JOBS", S_UINT32,
          max_prefetch_jobs, 1, 1048576, "65536", 0, "N",
          "most prefetch jobs kept at once; past it a LOOKUP starts none"),
    S_NUM("l2_lookup_timeout_ms", "--l2-lookup-timeout-ms", "KVTIER_L2_LOOKUP_TIMEOUT_MS", S_UINT32,
          l2_lookup_timeout_ms, 10, 60000, "1000", 0, "MS",
          "longest the L2 part of one lookup probes (both doors); past it the prefix is cut short"),
    S_NUM("l2_lookup_threads", "--l2-lookup-threads", "KVTIER_L2_LOOKUP_THREADS", S_UINT32,
          l2_lookup_threads, 1, 64, "8", 0, "N",
          "threads that run the L2 part of lookups, for both doors (with an L2 tier)"),
    S_NUM("l2_prefetch_threads", "--l2-prefetch-threads", "KVTIER_L2_PREFETCH_THREADS", S_UINT32,
          l2_prefetch_threads, 1, 64, "16", 0, "N",
          "threads that load prefetched objects from L2 into L1 (with an L2 tier)"),
    S_NUM("l2_write_threads", "--l2-write-threads", "KVTIER_L2_WRITE_THREADS", S_UINT32,
          l2_write_threads, 1, 16, "16", 0, "N",
          "threads per L2 adapter that write objects behind (at most the adapter's own limit)"),
    S_DBL("l2_backlog_max", "--l2-backlog-max", "KVTIER_L2_BACKLOG_MAX", l2_backlog_max, 0.0, 1.0,
          "0.5", S_OPEN_MIN, "F",
          "L1 fraction that objects waiting for their L2 write may fill; past it eviction takes "
          "the oldest of them unwritten (counted); 1: they wait, L1 refuses new objects instead"),
    S_NUM("workers", "--workers", "KVTIER_WORKERS", S_UINT32, workers, 1, 16, "2", 0, "N",
          "worker threads for inline PUT/GET copies and CLEAR"),
    S_NUM("io_threads", "--io-threads", "KVTIER_IO_THREADS", S_UINT32, io_threads, 1, 16, "2", 0,
          "N", "zmq I/O threads of the request socket (connections are spread over them)"),
    S_NUM("max_connections", "--max-connections", "KVTIER_MAX_CONNECTIONS", S_UINT32,
          max_connections, 8, 1048576, "4096", 0, "N",
          "client connections open at once (fewer when the open-files limit is lower)"),
    S_NUM("max_instances", "--max-instances", "KVTIER_MAX_INSTANCES", S_UINT32, max_instances, 1,
          1048576, "4096", 0, "N", "client instances (HELLO) alive at once"),
    S_NUM("max_instances_per_connection", "--max-instances-per-connection",
          "KVTIER_MAX_INSTANCES_PER_CONNECTION", S_UINT32, max_instances_per_connection, 1, 1024,
          "16", 0, "N", "instances one connection may act for at once"),
    S_NUM("reply_timeout_ms", "--reply-timeout-ms", "KVTIER_REPLY_TIMEOUT_MS", S_UINT32,
          reply_timeout_ms, 100, 86400000, "30000", 0, "MS",
          "a connection whose replies stay unsent this long is disconnected"),
    S_NUM("max_reply_pinned", "--max-reply-pinned", "KVTIER_MAX_REPLY_PINNED", S_SIZE,
          max_reply_pinned, S_M, S_T, "256M", 0, "SIZE",
          "L1 bytes unsent GET replies may pin per connection; past it GET answers busy"),
    S_NUM("max_reply_backlog", "--max-reply-backlog", "KVTIER_MAX_REPLY_BACKLOG", S_SIZE,
          max_reply_backlog, 64 * S_K, S_T, "64M", 0, "SIZE",
          "memory unsent replies may hold per connection; past it the connection is cut"),
    S_BOOLEAN("allow_unpinned", "--allow-unpinned", "KVTIER_ALLOW_UNPINNED", allow_unpinned,
              "false", 0, "start with a warning when the L1 arena cannot be mlock()ed"),
    S_NUM("max_leased_bytes", "--max-leased-bytes", "KVTIER_MAX_LEASED_BYTES", S_SIZE,
          max_leased_bytes, 0, S_T, "0", 0, "SIZE",
          "L1 bytes one client instance may hold under leases (0: no limit)"),
    S_BOOLEAN("resident_map", "--resident-map", "KVTIER_RESIDENT_MAP", resident_map, "true", 0,
              "share a map of the keys in L1 with fast-path clients, which then find a batch "
              "in L1 without a request"),
    S_NUM("resident_slots", "--resident-slots", "KVTIER_RESIDENT_SLOTS", S_UINT32, resident_slots,
          0, 134217728, "0", 0, "N",
          "slots of the residency map (8 bytes each; holds about half as many keys; 0: two per "
          "64 KiB of L1)"),
    S_BOOLEAN("l1_checksum", "--l1-checksum", "KVTIER_L1_CHECKSUM", l1_checksum, "false", 0,
              "checksum L1 objects at COMMIT; GET and write-behind skip damaged ones"),
    S_BOOLEAN("l1.adopt", "--l1-adopt", "KVTIER_L1_ADOPT", l1_adopt, "true", 0,
              "keep the L1 arena across a restart: the next daemon on this run dir adopts it"),
    S_STR("l1.hugepages", "--l1-hugepages", "KVTIER_L1_HUGEPAGES", l1_hugepages, "auto", 0,
          s_check_hugepages, "MODE",
          "L1 arena on 2 MiB pages: auto (hugetlbfs when it has the pages), on (or refuse to "
          "start), off"),
    S_STR("l1.hugepages_dir", "--l1-hugepages-dir", "KVTIER_L1_HUGEPAGES_DIR", l1_hugepages_dir, "",
          0, NULL, "DIR",
          "hugetlbfs mount for the arena; \"\": the first one with 2 MiB pages in /proc/mounts"),
    S_STR("shm_group", "--shm-group", "KVTIER_SHM_GROUP", shm_group, "", 0, NULL, "GROUP",
          "group that may map the L1 arena (mode 0660); \"\" keeps it 0600"),
    S_BOOLEAN("allow_insecure_remote", "--allow-insecure-remote", "KVTIER_ALLOW_INSECURE_REMOTE",
              allow_insecure_remote, "false", 0,
              "allow non-loopback tcp/HTTP binds (no authentication!)"),
    S_STR("curve.server_cert", "--curve-server-cert", "KVTIER_CURVE_SERVER_CERT", curve_server_cert,
          "", 0, NULL, "FILE",
          "CURVE on tcp listen endpoints: the daemon's secret certificate (zcert)"),
    S_STR("curve.clients", "--curve-clients", "KVTIER_CURVE_CLIENTS", curve_clients, "", 0, NULL,
          "DIR", "CURVE: directory of the client public certificates allowed to connect"),
    S_BOOLEAN("curve.require", "--curve-require", "KVTIER_CURVE_REQUIRE", curve_require, "false", 0,
              "refuse every tcp:// listen endpoint without CURVE, loopback ones too"),
    S_STR("lmcache.listen", "--lmcache-listen", "KVTIER_LMCACHE_LISTEN", lmcache_listen, "", 0,
          s_check_optional_endpoint, "ENDPOINT",
          "LMCache-compatible endpoint (vLLM's LMCacheMPConnector); \"\" for none"),
    S_NUM("lmcache.reap_timeout_s", "--lmcache-reap-timeout-s", "KVTIER_LMCACHE_REAP_TIMEOUT_S",
          S_UINT32, lmcache_reap_timeout_s, 0, 86400, "120", 0, "S",
          "an LMCache worker silent this long loses its registration (0: never)"),
    S_NUM("lmcache.max_requests", "--lmcache-max-requests", "KVTIER_LMCACHE_MAX_REQUESTS", S_UINT32,
          lmcache_max_requests, 16, 1048576, "16384", 0, "N",
          "LMCache requests whose lookup state is kept at once (the oldest goes first)"),
    S_BOOLEAN("fastpath.enabled", "--fastpath-enabled", "KVTIER_FASTPATH_ENABLED", fastpath_enabled,
              "true", 0,
              "offer same-machine clients a request/reply ring pair in shared memory at HELLO"),
    S_NUM("fastpath.rings", "--fastpath-rings", "KVTIER_FASTPATH_RINGS", S_UINT32, fastpath_rings,
          1, 127, "64", 0, "N", "fast-path ring pairs open at once; past it HELLO offers none"),
    S_NUM("fastpath.ring_bytes", "--fastpath-ring-bytes", "KVTIER_FASTPATH_RING_BYTES", S_SIZE,
          fastpath_ring_bytes, 4 * S_K, 16 * S_M, "64K", 0, "SIZE",
          "data bytes of each fast-path ring (a power of two); larger messages go over ZMQ"),
    S_NUM("fastpath.spin_us", "--fastpath-spin-us", "KVTIER_FASTPATH_SPIN_US", S_UINT32,
          fastpath_spin_us, 0, 10000, "50", 0, "US",
          "the fast-path thread polls this long after its last request before it sleeps"),
    S_STR("debug.fault_thread", "--debug-fault-thread", "KVTIER_DEBUG_FAULT_THREAD",
          debug_fault_thread, "", S_HIDDEN, NULL, "NAME", "test: thread to fault, \"\" for none"),
    S_STR("debug.fault_mode", "--debug-fault-mode", "KVTIER_DEBUG_FAULT_MODE", debug_fault_mode,
          "stall", S_HIDDEN, s_check_fault_mode, "MODE", "test: stall or exit"),
    S_NUM("debug.fault_after_ms", "--debug-fault-after-ms", "KVTIER_DEBUG_FAULT_AFTER_MS", S_UINT32,
          debug_fault_after_ms, 0, UINT32_MAX, "0", S_HIDDEN, "MS", "test: delay before the fault"),
    S_NUM("debug.fault_for_ms", "--debug-fault-for-ms", "KVTIER_DEBUG_FAULT_FOR_MS", S_UINT32,
          debug_fault_for_ms, 0, UINT32_MAX, "0", S_HIDDEN, "MS", "test: how long a stall lasts"),
    S_NUM("debug.journal_compact_bytes", "--debug-journal-compact-bytes",
          "KVTIER_DEBUG_JOURNAL_COMPACT_BYTES", S_SIZE, debug_journal_compact_bytes, 4096, S_T,
          "16M", S_HIDDEN, "SIZE",
          "test hook: the L1 journal is compacted once past this size (and 4x its live records)"),
    S_NUM("debug.fail_alloc_every", "--debug-fail-alloc-every", "KVTIER_DEBUG_FAIL_ALLOC_EVERY",
          S_UINT32, debug_fail_alloc_every, 0, UINT32_MAX, "0", S_HIDDEN, "N",
          "test: every Nth L1 allocation fails (0: never)"),
};

#define S_NOPTS (sizeof s_options / sizeof s_options[0])

/* Action flags: they pick what the process does and are not config options. */
static const struct {
    const char *flag;
    kvt_config_action_t action;
    const char *help;
} s_actions[] = {
    {"--check-config", KVT_CONFIG_CHECK, "validate the configuration and exit (0 or 2)"},
    {"--print-config", KVT_CONFIG_PRINT, "print the effective configuration as JSON and exit"},
    {"--version", KVT_CONFIG_VERSION, "print the version and exit"},
    {"--help", KVT_CONFIG_HELP, "print this help and exit"},
    {"-h", KVT_CONFIG_HELP, NULL},
};

#define S_CONFIG_FLAG "--config"
#define S_CONFIG_ENV "KVTIER_CONFIG"
#define S_SHOW_LEN 64         /* user text quoted in messages is cut to this */
#define S_MAX_FILE (1u << 20) /* a config file is small; a bigger one is a wrong path */

/* ---------------------------------------------------------------- errors and small helpers */

/* err is one line: control characters (a value with a newline, a jansson message quoting the
 * input) would break "one line naming the problem", so they become '?'. */
static int s_fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int s_fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
        for (char *p = err; *p; p++)
            if (iscntrl((unsigned char)*p))
                *p = '?';
    }
    return KVT_EINVAL;
}

/* "reason" -> "prefix: reason", keeping one line. */
static void s_prefix(char *err, size_t errlen, const char *prefix)
{
    if (!err || errlen == 0)
        return;
    char tmp[KVT_ERR_LEN * 4];
    snprintf(tmp, sizeof tmp, "%s", err);
    s_fail(err, errlen, "%s: %s", prefix, tmp);
}

/* Copies user text for a message, cut to S_SHOW_LEN with "..." so the reason stays visible. */
static const char *s_show(const char *s, char *buf, size_t len)
{
    size_t n = strlen(s);
    size_t cap = len - 1 < S_SHOW_LEN ? len - 1 : S_SHOW_LEN;
    if (n <= cap) {
        memcpy(buf, s, n + 1);
    } else {
        memcpy(buf, s, cap - 3);
        memcpy(buf + cap - 3, "...", 4);
    }
    return buf;
}

static char *s_strdup(const char *s)
{
    char *p = strdup(s);
    kvt_assert(p != NULL); /* small bookkeeping allocation: OOM aborts (STYLE 4) */
    return p;
}

static char *s_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *s_printf(const char *fmt, ...)
{
    va_list ap;
    char *p = NULL;
    va_start(ap, fmt);
    int n = vasprintf(&p, fmt, ap);
    va_end(ap);
    kvt_assert(n >= 0 && p != NULL);
    return p;
}

/* 1073741824 -> "1G", 1536 -> "1536": exact binary multiples only, so it parses back. */
static const char *s_fmt_size(uint64_t v, char *buf, size_t len)
{
    static const char units[] = "KMGT";
    for (int i = 3; i >= 0; i--) {
        uint64_t m = 1ull << (10 * (i + 1));
        if (v >= m && v % m == 0) {
            snprintf(buf, len, "%" PRIu64 "%c", v / m, units[i]);
            return buf;
        }
    }
    snprintf(buf, len, "%" PRIu64, v);
    return buf;
}

/* Shortest %g text that reads back as the same double. */
static const char *s_fmt_double(double d, char *buf, size_t len)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    return buf;
}

/* Watermarks read best with two decimals ("0.90"), as DESIGN writes them, when that is exact. */
static const char *s_fmt_fraction(double d, char *buf, size_t len)
{
    snprintf(buf, len, "%.2f", d);
    if (strtod(buf, NULL) != d)
        s_fmt_double(d, buf, len);
    return buf;
}

/* A JSON value as it appears in the file, cut short, for "expected X, got Y". */
static const char *s_json_brief(const json_t *v, char *buf, size_t len)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    s_show(s ? s : "?", buf, len);
    free(s);
    return buf;
}

static void *s_field(kvt_config_t *self, const s_opt_t *o)
{
    return (char *)self + o->off;
}

static const void *s_cfield(const kvt_config_t *self, const s_opt_t *o)
{
    return (const char *)self + o->off;
}

static int *s_count(kvt_config_t *self, const s_opt_t *o)
{
    return (int *)(void *)((char *)self + o->count_off);
}

static int s_ccount(const kvt_config_t *self, const s_opt_t *o)
{
    return *(const int *)(const void *)((const char *)self + o->count_off);
}

static const s_opt_t *s_find(const char *name)
{
    for (size_t i = 0; i < S_NOPTS; i++)
        if (strcmp(s_options[i].name, name) == 0)
            return &s_options[i];
    return NULL;
}

static const s_opt_t *s_find_flag(const char *flag, size_t n)
{
    for (size_t i = 0; i < S_NOPTS; i++)
        if (strlen(s_options[i].flag) == n && strncmp(s_options[i].flag, flag, n) == 0)
            return &s_options[i];
    return NULL;
}

/* "debug" is a group because some option is named "debug.*". */
static bool s_is_group(const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < S_NOPTS; i++)
        if (strncmp(s_options[i].name, name, n) == 0 && s_options[i].name[n] == '.')
            return true;
    return false;
}

/* Edit distance, for "did you mean". Names are short; longer input gets no suggestion. */
static size_t s_distance(const char *a, size_t la, const char *b)
{
    size_t lb = strlen(b), row[64];
    if (la >= 64 || lb >= 64)
        return SIZE_MAX;
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* The closest visible option name (or flag) within two edits; NULL if none. Hidden knobs are
 * never suggested: they are for tests only. */
static const char *s_suggest(const char *word, size_t n, bool flag)
{
    const char *best = NULL;
    size_t best_d = 3;
    if (n < 4)
        return NULL;
    for (size_t i = 0; i < S_NOPTS; i++) {
        if (s_options[i].flags & S_HIDDEN)
            continue;
        const char *cand = flag ? s_options[i].flag : s_options[i].name;
        size_t d = s_distance(word, n, cand);
        if (d < best_d) {
            best_d = d;
            best = cand;
        }
    }
    return best;
}

/* The flag and env columns are written out so that grep finds them; this keeps them honest. */
static void s_check_table(void)
{
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        char flag[96], env[96];
        size_t n = strlen(o->name);
        kvt_assert(n + 8 < sizeof flag);
        snprintf(flag, sizeof flag, "--%s", o->name);
        snprintf(env, sizeof env, "KVTIER_%s", o->name);
        for (char *p = flag; *p; p++)
            if (*p == '_' || *p == '.')
                *p = '-';
        for (char *p = env; *p; p++)
            *p = *p == '.' ? '_' : (char)toupper((unsigned char)*p);
        kvt_assert(strcmp(flag, o->flag) == 0);
        kvt_assert(strcmp(env, o->env) == 0);
        /* to_json nests one level only */
        const char *dot = strchr(o->name, '.');
        kvt_assert(dot == NULL || strchr(dot + 1, '.') == NULL);
        kvt_assert(o->type != S_UINT32 || o->max <= UINT32_MAX);
        /* sizes and UINT64 are printed as JSON integers (int64) */
        kvt_assert(o->max <= INT64_MAX);
        kvt_assert(o->type != S_STRING_LIST || (o->max_items > 0 && o->items && o->starts));
        kvt_assert(o->min <= o->max);
    }
}

/* ------------------------------------------------------------------------------ validators */

static bool s_is_loopback(const char *host)
{
    return strcmp(host, "127.0.0.1") == 0 || strcmp(host, "::1") == 0 ||
           strcmp(host, "localhost") == 0;
}

/* "HOST:PORT" or "[V6]:PORT" -> host (brackets removed) and the port text. */
static bool s_split_hostport(const char *s, char *host, size_t hostlen, const char **port)
{
    const char *colon;
    const char *h = s;
    size_t n;
    if (s[0] == '[') {
        const char *rb = strchr(s, ']');
        if (!rb || rb[1] != ':')
            return false;
        h = s + 1;
        n = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon)
            return false;
        n = (size_t)(colon - s);
    }
    if (n == 0 || n >= hostlen)
        return false;
    memcpy(host, h, n);
    host[n] = '\0';
    *port = colon + 1;
    return true;
}

static bool s_port_ok(const char *p, bool allow_star)
{
    if (allow_star && strcmp(p, "*") == 0)
        return true; /* ZMQ: pick a free port */
    size_t n = strspn(p, "0123456789");
    if (n == 0 || n > 5 || p[n] != '\0')
        return false;
    long v = strtol(p, NULL, 10);
    return v >= 1 && v <= 65535;
}

/* The host of a tcp:// endpoint or an ADDR:PORT, for the loopback rule; false if malformed. */
static bool s_host_of(const char *v, char *host, size_t hostlen)
{
    const char *port;
    if (strncmp(v, "tcp://", 6) == 0)
        v += 6;
    return s_split_hostport(v, host, hostlen, &port);
}

static int s_check_endpoint(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1], host[256];
    const char *port;
    if (strncmp(v, "ipc://", 6) == 0 && v[6] != '\0') {
        /* bind() would fail much later with a vague ENAMETOOLONG */
        size_t max = sizeof(((struct sockaddr_un *)0)->sun_path) - 1;
        if (strlen(v + 6) > max)
            return s_fail(why, whylen, "'%s': ipc path is longer than %zu bytes",
                          s_show(v, shown, sizeof shown), max);
        return 0;
    }
    if (strncmp(v, "tcp://", 6) == 0 && s_split_hostport(v + 6, host, sizeof host, &port) &&
        s_port_ok(port, true))
        return 0;
    return s_fail(why, whylen, "'%s' is not an endpoint (use ipc://PATH or tcp://HOST:PORT)",
                  s_show(v, shown, sizeof shown));
}

static int s_check_optional_endpoint(const char *v, char *why, size_t whylen)
{
    return *v == '\0' ? 0 : s_check_endpoint(v, why, whylen);
}

static int s_check_http(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1], host[256];
    const char *port;
    if (*v == '\0' || (s_split_hostport(v, host, sizeof host, &port) && s_port_ok(port, false)))
        return 0;
    return s_fail(why, whylen,
                  "'%s' is not ADDR:PORT with a port in 1-65535 (use \"\" to disable HTTP)",
                  s_show(v, shown, sizeof shown));
}

static int s_check_nonempty(const char *v, char *why, size_t whylen)
{
    return *v ? 0 : s_fail(why, whylen, "must not be empty");
}

static int s_check_l2(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1];
    if (strcmp(v, "none") == 0)
        return 0;
    for (const char *const *p = s_l2_starts; *p; p++) {
        size_t n = strlen(*p);
        if ((*p)[n - 1] == ':' && strncmp(v, *p, n) == 0 && v[n] != '\0')
            return 0;
    }
    return s_fail(why, whylen,
                  "'%s' is not an L2 spec (use fs:DIR, redis:HOST:PORT, mock:OPTS, "
                  "plugin:PATH or none)",
                  s_show(v, shown, sizeof shown));
}

static int s_check_log_level(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1];
    kvt_log_level_t level;
    if (kvt_log_level_parse(v, &level) == 0)
        return 0;
    return s_fail(why, whylen, "'%s' is not one of error, warn, info, debug",
                  s_show(v, shown, sizeof shown));
}

static int s_check_fault_mode(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1];
    if (strcmp(v, "stall") == 0 || strcmp(v, "exit") == 0)
        return 0;
    return s_fail(why, whylen, "'%s' is not one of stall, exit", s_show(v, shown, sizeof shown));
}

static int s_check_hugepages(const char *v, char *why, size_t whylen)
{
    char shown[S_SHOW_LEN + 1];
    if (strcmp(v, "auto") == 0 || strcmp(v, "on") == 0 || strcmp(v, "off") == 0)
        return 0;
    return s_fail(why, whylen, "'%s' is not one of auto, on, off", s_show(v, shown, sizeof shown));
}

/* --------------------------------------------------------------------------- value parsing */

/* Plain decimal digits: 0, KVT_EINVAL (not an integer) or KVT_ETOOBIG (an integer too big for
 * 64 bits), as kvt_size_parse answers for sizes. */
static int s_parse_u64(const char *s, uint64_t *out)
{
    uint64_t v = 0;
    if (!isdigit((unsigned char)*s))
        return KVT_EINVAL;
    for (; isdigit((unsigned char)*s); s++) {
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return strspn(s, "0123456789") == strlen(s) ? KVT_ETOOBIG : KVT_EINVAL;
        v = v * 10 + d;
    }
    if (*s != '\0')
        return KVT_EINVAL;
    *out = v;
    return 0;
}

static int s_parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = false;
            return 0;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------------------- storing */

/* Range check and store of SIZE / UINT32 / UINT64; `shown` is the value as the user wrote it. */
static int s_store_uint(kvt_config_t *self, const s_opt_t *o, uint64_t v, const char *shown,
                        char *err, size_t errlen)
{
    if (v < o->min || v > o->max) {
        char lo[32], hi[32];
        if (o->type == S_SIZE) {
            s_fmt_size(o->min, lo, sizeof lo);
            s_fmt_size(o->max, hi, sizeof hi);
        } else {
            snprintf(lo, sizeof lo, "%" PRIu64, o->min);
            snprintf(hi, sizeof hi, "%" PRIu64, o->max);
        }
        return s_fail(err, errlen, "%s: %s is out of range [%s, %s]", o->name, shown, lo, hi);
    }
    if (o->type == S_UINT32)
        *(uint32_t *)s_field(self, o) = (uint32_t)v;
    else
        *(uint64_t *)s_field(self, o) = v;
    return 0;
}

static int s_store_double(kvt_config_t *self, const s_opt_t *o, double d, const char *shown,
                          char *err, size_t errlen)
{
    bool open_min = (o->flags & S_OPEN_MIN) != 0;
    if ((open_min ? !(d > o->dmin) : !(d >= o->dmin)) || !(d <= o->dmax)) {
        char lo[32], hi[32];
        return s_fail(err, errlen, "%s: %s is out of range %c%s, %s]", o->name, shown,
                      open_min ? '(' : '[', s_fmt_double(o->dmin, lo, sizeof lo),
                      s_fmt_double(o->dmax, hi, sizeof hi));
    }
    *(double *)s_field(self, o) = d;
    return 0;
}

/* Runs the row's validator and makes sure the text can be printed back as JSON (jansson
 * refuses invalid UTF-8), so --print-config output always loads again. */
static int s_check_text(const s_opt_t *o, const char *v, char *err, size_t errlen)
{
    char why[KVT_ERR_LEN];
    if (o->check && o->check(v, why, sizeof why) != 0)
        return s_fail(err, errlen, "%s: %s", o->name, why);
    json_t *probe = json_string(v);
    if (!probe)
        return s_fail(err, errlen, "%s: value is not valid UTF-8", o->name);
    json_decref(probe);
    return 0;
}

static int s_store_string(kvt_config_t *self, const s_opt_t *o, const char *v, char *err,
                          size_t errlen)
{
    int rc = s_check_text(o, v, err, errlen);
    if (rc != 0)
        return rc;
    char **slot = s_field(self, o);
    free(*slot);
    *slot = s_strdup(v);
    return 0;
}

static void s_list_clear(kvt_config_t *self, const s_opt_t *o)
{
    char **items = s_field(self, o);
    int *n = s_count(self, o);
    for (int i = 0; i < *n; i++) {
        free(items[i]);
        items[i] = NULL;
    }
    *n = 0;
}

static int s_list_append(kvt_config_t *self, const s_opt_t *o, const char *v, char *err,
                         size_t errlen)
{
    char **items = s_field(self, o);
    int *n = s_count(self, o);
    if (*n >= o->max_items)
        return s_fail(err, errlen, "%s: at most %d %s", o->name, o->max_items, o->items);
    int rc = s_check_text(o, v, err, errlen);
    if (rc != 0)
        return rc;
    items[(*n)++] = s_strdup(v);
    return 0;
}

static bool s_starts_item(const s_opt_t *o, const char *piece)
{
    for (const char *const *p = o->starts; *p; p++)
        if (strncmp(piece, *p, strlen(*p)) == 0)
            return true;
    return false;
}

static char *s_trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* Replaces a list from "a,b,c" (environment syntax). Commas also occur inside one item
 * ("mock:latency_ms=5,fail_rate=0.1"), so a piece starts a new item only when it begins like
 * one (a row's `starts` prefixes); otherwise it is glued back to the previous item. "" leaves
 * the list empty, which kvt_config_finish turns into the derived default. */
static int s_list_set_split(kvt_config_t *self, const s_opt_t *o, const char *text, char *err,
                            size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    int rc = 0;
    s_list_clear(self, o);
    if (*text == '\0')
        return 0;
    s_show(text, shown, sizeof shown);
    char *copy = s_strdup(text);
    char *item = NULL; /* the item being assembled */
    for (char *p = copy;;) {
        char *comma = strchr(p, ',');
        if (comma)
            *comma = '\0';
        char *piece = s_trim(p);
        if (*piece == '\0') {
            rc = s_fail(err, errlen, "%s: empty item in '%s'", o->name, shown);
            break;
        }
        if (item && !s_starts_item(o, piece)) {
            char *joined = s_printf("%s,%s", item, piece);
            free(item);
            item = joined;
        } else {
            if (item) {
                rc = s_list_append(self, o, item, err, errlen);
                free(item);
                item = NULL;
                if (rc != 0)
                    break;
            }
            item = s_strdup(piece);
        }
        if (!comma)
            break;
        p = comma + 1;
    }
    if (rc == 0 && item)
        rc = s_list_append(self, o, item, err, errlen);
    free(item);
    free(copy);
    return rc;
}

/* Applies a textual value (flag, environment, kvt_config_set). Lists: `append` adds one item
 * as is (a flag); otherwise the text is a comma-separated list that replaces (environment). */
static int s_set_text(kvt_config_t *self, const s_opt_t *o, const char *v, bool append, char *err,
                      size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    s_show(v, shown, sizeof shown);
    switch (o->type) {
    case S_STRING:
        return s_store_string(self, o, v, err, errlen);
    case S_STRING_LIST:
        return append ? s_list_append(self, o, v, err, errlen)
                      : s_list_set_split(self, o, v, err, errlen);
    case S_SIZE: {
        uint64_t x = 0;
        int rc = kvt_size_parse(v, &x);
        if (rc == KVT_EINVAL)
            return s_fail(err, errlen, "%s: '%s' is not a size (use e.g. 512M, 4G)", o->name,
                          shown);
        if (rc == KVT_ETOOBIG)
            x = UINT64_MAX; /* out of range whatever the bounds */
        return s_store_uint(self, o, x, shown, err, errlen);
    }
    case S_UINT32:
    case S_UINT64: {
        uint64_t x = 0;
        int rc = s_parse_u64(v, &x);
        if (rc == KVT_EINVAL)
            return s_fail(err, errlen, "%s: '%s' is not an integer", o->name, shown);
        if (rc == KVT_ETOOBIG)
            x = UINT64_MAX;
        return s_store_uint(self, o, x, shown, err, errlen);
    }
    case S_DOUBLE: {
        char *end = NULL;
        errno = 0;
        double d = (*v && !isspace((unsigned char)*v)) ? strtod(v, &end) : NAN;
        if (!end || *end != '\0' || !isfinite(d))
            return s_fail(err, errlen, "%s: '%s' is not a number", o->name, shown);
        return s_store_double(self, o, d, shown, err, errlen);
    }
    case S_BOOL: {
        bool b;
        if (s_parse_bool(v, &b) != 0)
            return s_fail(err, errlen, "%s: '%s' is not a boolean (use true or false)", o->name,
                          shown);
        *(bool *)s_field(self, o) = b;
        return 0;
    }
    }
    kvt_assert(!"unknown option type");
    return KVT_EINVAL;
}

static const char *s_expected(s_type_t t)
{
    switch (t) {
    case S_STRING:
        return "expected a string";
    case S_STRING_LIST:
        return "expected a string or an array of strings";
    case S_SIZE:
        return "expected a size (e.g. 512M, 4G)";
    case S_UINT32:
    case S_UINT64:
        return "expected an integer";
    case S_DOUBLE:
        return "expected a number";
    case S_BOOL:
        return "expected true or false";
    }
    return "unexpected value";
}

/* A JSON string value, refusing embedded NULs that C strings would silently cut. */
static const char *s_json_text(const json_t *v)
{
    const char *s = json_string_value(v);
    return s && strlen(s) == json_string_length(v) ? s : NULL;
}

static int s_set_json(kvt_config_t *self, const s_opt_t *o, const json_t *v, char *err,
                      size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    switch (o->type) {
    case S_STRING:
        if (!json_is_string(v))
            break;
        if (!s_json_text(v))
            return s_fail(err, errlen, "%s: contains a NUL character", o->name);
        return s_store_string(self, o, s_json_text(v), err, errlen);
    case S_STRING_LIST: {
        if (json_is_string(v)) {
            if (!s_json_text(v))
                return s_fail(err, errlen, "%s: contains a NUL character", o->name);
            s_list_clear(self, o);
            return s_list_append(self, o, s_json_text(v), err, errlen);
        }
        if (!json_is_array(v))
            break;
        size_t i;
        const json_t *item;
        json_array_foreach(v, i, item)
        {
            if (!json_is_string(item))
                goto wrong_type;
            if (!s_json_text(item))
                return s_fail(err, errlen, "%s: contains a NUL character", o->name);
        }
        s_list_clear(self, o);
        json_array_foreach(v, i, item)
        {
            int rc = s_list_append(self, o, s_json_text(item), err, errlen);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    case S_SIZE:
        if (json_is_string(v)) {
            if (!s_json_text(v))
                return s_fail(err, errlen, "%s: contains a NUL character", o->name);
            return s_set_text(self, o, s_json_text(v), false, err, errlen);
        }
        __attribute__((fallthrough)); /* else an integer count of bytes */
    case S_UINT32:
    case S_UINT64: {
        if (!json_is_integer(v))
            break;
        json_int_t x = json_integer_value(v);
        snprintf(shown, sizeof shown, "%" JSON_INTEGER_FORMAT, x);
        return s_store_uint(self, o, x < 0 ? UINT64_MAX : (uint64_t)x, shown, err, errlen);
    }
    case S_DOUBLE:
        if (!json_is_number(v))
            break;
        return s_store_double(self, o, json_number_value(v),
                              s_fmt_double(json_number_value(v), shown, sizeof shown), err, errlen);
    case S_BOOL:
        if (!json_is_boolean(v))
            break;
        *(bool *)s_field(self, o) = json_is_true(v);
        return 0;
    }
wrong_type:
    return s_fail(err, errlen, "%s: %s, got %s", o->name, s_expected(o->type),
                  s_json_brief(v, shown, sizeof shown));
}

/* ------------------------------------------------------------------------------ public API */

kvt_config_t *kvt_config_new(void)
{
    s_check_table();
    kvt_config_t *self = calloc(1, sizeof *self);
    kvt_assert(self != NULL);
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        if (!o->def)
            continue;
        char why[KVT_ERR_LEN];
        int rc = s_set_text(self, o, o->def, false, why, sizeof why);
        kvt_assert(rc == 0); /* a default that fails its own row is a bug in the table */
    }
    return self;
}

void kvt_config_destroy(kvt_config_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_config_t *self = *self_p;
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        if (o->type == S_STRING) {
            char **slot = s_field(self, o);
            free(*slot);
            *slot = NULL;
        } else if (o->type == S_STRING_LIST) {
            s_list_clear(self, o);
        }
    }
    free(self->config_file);
    free(self);
    *self_p = NULL;
}

int kvt_config_set(kvt_config_t *self, const char *name, const char *value, bool append, char *err,
                   size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    const s_opt_t *o = name ? s_find(name) : NULL;
    if (!o)
        return s_fail(err, errlen, "unknown option '%s'",
                      s_show(name ? name : "", shown, sizeof shown));
    if (!value)
        return s_fail(err, errlen, "%s: needs a value", o->name);
    return s_set_text(self, o, value, append, err, errlen);
}

static int s_apply_object(kvt_config_t *self, const json_t *obj, const char *prefix,
                          const char *origin, char *err, size_t errlen)
{
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)obj, key, val)
    {
        char shown[S_SHOW_LEN + 1];
        char *full = s_printf("%s%s", prefix, key);
        const s_opt_t *o = strchr(key, '.') ? NULL : s_find(full);
        int rc = 0;
        if (o) {
            rc = s_set_json(self, o, val, err, errlen);
            if (rc != 0)
                s_prefix(err, errlen, origin);
        } else if (!strchr(key, '.') && s_is_group(full)) {
            if (!json_is_object(val)) {
                char got[S_SHOW_LEN + 1];
                rc = s_fail(err, errlen, "%s: %s: expected an object, got %s", origin, full,
                            s_json_brief(val, got, sizeof got));
            } else {
                char *sub = s_printf("%s.", full);
                rc = s_apply_object(self, val, sub, origin, err, errlen);
                free(sub);
            }
        } else if (strchr(key, '.') && s_find(full)) {
            /* a dotted key would allow the same option twice without a duplicate-key error */
            const char *dot = strchr(full, '.');
            rc = s_fail(err, errlen,
                        "%s: unknown option '%s' (write it nested: \"%.*s\": "
                        "{\"%s\": ...})",
                        origin, full, (int)(dot - full), full, dot + 1);
        } else {
            const char *hint = s_suggest(full, strlen(full), false);
            if (hint)
                rc = s_fail(err, errlen, "%s: unknown option '%s' (did you mean '%s'?)", origin,
                            s_show(full, shown, sizeof shown), hint);
            else
                rc = s_fail(err, errlen, "%s: unknown option '%s'", origin,
                            s_show(full, shown, sizeof shown));
        }
        free(full);
        if (rc != 0)
            return rc;
    }
    return 0;
}

int kvt_config_apply_json(kvt_config_t *self, const char *text, size_t len, const char *origin,
                          char *err, size_t errlen)
{
    json_error_t je;
    if (!origin)
        origin = "config";
    if (!text)
        return s_fail(err, errlen, "%s: no text", origin);
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (je.line > 0)
            return s_fail(err, errlen, "%s:%d:%d: %s", origin, je.line, je.column, je.text);
        return s_fail(err, errlen, "%s: %s", origin, je.text);
    }
    int rc;
    if (!json_is_object(root)) {
        char got[S_SHOW_LEN + 1];
        rc = s_fail(err, errlen, "%s: top level must be a JSON object, got %s", origin,
                    s_json_brief(root, got, sizeof got));
    } else {
        rc = s_apply_object(self, root, "", origin, err, errlen);
    }
    json_decref(root);
    return rc;
}

int kvt_config_apply_file(kvt_config_t *self, const char *path, char *err, size_t errlen)
{
    /* O_NONBLOCK: a FIFO (or a device) at the path must not hang whoever reads it (at start,
     * or the SIGHUP reload); it is refused below, by what fstat says it is */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return s_fail(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return s_fail(err, errlen, "%s: not a regular file (a config file is one)", path);
    }
    if ((uint64_t)st.st_size > S_MAX_FILE) {
        close(fd);
        return s_fail(err, errlen, "%s: larger than %u bytes, not a config file", path,
                      S_MAX_FILE);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return s_fail(err, errlen, "%s: cannot read: %s", path, strerror(errno));
    }
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    kvt_assert(buf != NULL);
    int rc = 0;
    for (;;) {
        if (len == cap) {
            if (cap >= S_MAX_FILE) {
                rc = s_fail(err, errlen, "%s: larger than %u bytes, not a config file", path,
                            S_MAX_FILE);
                break;
            }
            cap *= 2;
            char *bigger = realloc(buf, cap);
            kvt_assert(bigger != NULL);
            buf = bigger;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f))
                rc = s_fail(err, errlen, "%s: cannot read: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (rc == 0)
        rc = kvt_config_apply_json(self, buf, len, path, err, errlen);
    free(buf);
    return rc;
}

int kvt_config_apply_env(kvt_config_t *self, char *err, size_t errlen)
{
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        const char *v = getenv(o->env);
        if (!v)
            continue;
        int rc = s_set_text(self, o, v, false, err, errlen);
        if (rc != 0) {
            s_prefix(err, errlen, o->env);
            return rc;
        }
    }
    return 0;
}

/* Non-loopback binds are refused unless the operator says so (STYLE 12): without CURVE the
 * protocol has no authentication, and POST /clear is one request away. CURVE covers the listen
 * endpoints only; events and HTTP stay plain, so they still need allow_insecure_remote. */
static int s_check_bind(const kvt_config_t *self, const char *name, const char *v, char *err,
                        size_t errlen)
{
    bool curve = self->curve_server_cert[0] && strcmp(name, "listen") == 0;
    char host[256], shown[S_SHOW_LEN + 1];
    bool tcp_like = strncmp(v, "tcp://", 6) == 0 || strcmp(name, "http") == 0;
    /* libzmq binds addresses or interface names, never host names (it would fail with ENODEV) */
    if (strncmp(v, "tcp://", 6) == 0 && s_host_of(v, host, sizeof host) &&
        strcmp(host, "localhost") == 0)
        return s_fail(err, errlen, "%s: %s: ZeroMQ binds IP addresses, not host names (use "
                                   "127.0.0.1)",
                      name, s_show(v, shown, sizeof shown));
    if (self->allow_insecure_remote || curve || !tcp_like || *v == '\0')
        return 0;
    if (s_host_of(v, host, sizeof host) && s_is_loopback(host))
        return 0;
    if (strcmp(name, "listen") == 0)
        return s_fail(err, errlen,
                      "%s: %s is not loopback; set allow_insecure_remote to allow it, or "
                      "configure curve.server_cert and curve.clients",
                      name, s_show(v, shown, sizeof shown));
    return s_fail(err, errlen, "%s: %s is not loopback; set allow_insecure_remote to allow it",
                  name, s_show(v, shown, sizeof shown));
}

/* Without CURVE every local user can use a loopback tcp endpoint (and read, write or clear the
 * cache); curve.require lets an operator rule that out instead of relying on the warning. */
static int s_check_curve_required(const kvt_config_t *self, const char *v, char *err, size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    if (!self->curve_require || self->curve_server_cert[0] || strncmp(v, "tcp://", 6) != 0)
        return 0;
    return s_fail(err, errlen,
                  "listen: %s has no CURVE and curve.require is set: configure "
                  "curve.server_cert and curve.clients, or listen on ipc:// only",
                  s_show(v, shown, sizeof shown));
}

/* The LMCache client has no CURVE: under curve.require its door must be ipc://. */
static int s_check_lmcache_curve(const kvt_config_t *self, char *err, size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    if (!self->curve_require || strncmp(self->lmcache_listen, "tcp://", 6) != 0)
        return 0;
    return s_fail(err, errlen,
                  "lmcache.listen: %s is plain tcp and curve.require is set (the LMCache client "
                  "has no CURVE): use an ipc:// endpoint",
                  s_show(self->lmcache_listen, shown, sizeof shown));
}

int kvt_config_shm_gid(const kvt_config_t *self, gid_t *gid)
{
    if (!self->shm_group || !self->shm_group[0])
        return 1;
    char *end = NULL;
    long v = strtol(self->shm_group, &end, 10);
    if (end && *end == '\0' && v >= 0) {
        *gid = (gid_t)v;
        return 0;
    }
    struct group *g = getgrnam(self->shm_group);
    if (!g)
        return KVT_EINVAL;
    *gid = g->gr_gid;
    return 0;
}

int kvt_config_finish(kvt_config_t *self, char *err, size_t errlen)
{
    int rc;
    if (self->n_listen == 0) {
        size_t n = strlen(self->run_dir);
        while (n > 1 && self->run_dir[n - 1] == '/')
            n--;
        char *ep = s_printf("ipc://%.*s/kvtier.sock", (int)n, self->run_dir);
        rc = s_list_append(self, s_find("listen"), ep, err, errlen);
        free(ep);
        if (rc != 0)
            return rc;
    }
    if (self->n_l2 == 0) {
        size_t n = strlen(self->data_dir);
        while (n > 1 && self->data_dir[n - 1] == '/')
            n--;
        char *spec = s_printf("fs:%.*s/l2", (int)n, self->data_dir);
        rc = s_list_append(self, s_find("l2"), spec, err, errlen);
        free(spec);
        if (rc != 0)
            return rc;
    }
    /* CURVE half-configured would be a server nobody can reach, or one anybody can */
    if (!self->curve_server_cert[0] != !self->curve_clients[0])
        return s_fail(err, errlen, "%s: must be set together with %s",
                      self->curve_server_cert[0] ? "curve.server_cert" : "curve.clients",
                      self->curve_server_cert[0] ? "curve.clients" : "curve.server_cert");
    for (int i = 0; i < self->n_listen; i++)
        if ((rc = s_check_bind(self, "listen", self->listen[i], err, errlen)) != 0 ||
            (rc = s_check_curve_required(self, self->listen[i], err, errlen)) != 0)
            return rc;
    if ((rc = s_check_bind(self, "events", self->events, err, errlen)) != 0)
        return rc;
    if (self->events[0] && !self->event_log_size)
        return s_fail(err, errlen, "events: needs the event log (event_log_size > 0)");
    if ((rc = s_check_bind(self, "lmcache.listen", self->lmcache_listen, err, errlen)) != 0 ||
        (rc = s_check_lmcache_curve(self, err, errlen)) != 0)
        return rc;
    if ((rc = s_check_bind(self, "http", self->http, err, errlen)) != 0)
        return rc;
    for (int i = 0; i < self->n_l2 && self->n_l2 > 1; i++)
        if (strcmp(self->l2[i], "none") == 0)
            return s_fail(err, errlen, "l2: none cannot be combined with other adapters");
    /* LMCache clients open the arena by its POSIX shm name, which a hugetlbfs file has not */
    if (strcmp(self->l1_hugepages, "on") == 0 && self->lmcache_listen[0])
        return s_fail(err, errlen,
                      "l1.hugepages: on cannot be combined with lmcache.listen (LMCache clients "
                      "open the arena by name in /dev/shm, which has no reserved huge pages)");
    if (self->fastpath_ring_bytes & (self->fastpath_ring_bytes - 1))
        return s_fail(err, errlen, "fastpath.ring_bytes: must be a power of two (%llu is not)",
                      (unsigned long long)self->fastpath_ring_bytes);
    gid_t gid;
    if (kvt_config_shm_gid(self, &gid) < 0)
        return s_fail(err, errlen, "shm_group: no group named '%s' on this system",
                      self->shm_group);
    if (!(self->low_watermark < self->high_watermark)) {
        char lo[32], hi[32];
        return s_fail(err, errlen, "low_watermark: must be below high_watermark (%s >= %s)",
                      s_fmt_fraction(self->low_watermark, lo, sizeof lo),
                      s_fmt_fraction(self->high_watermark, hi, sizeof hi));
    }
    return 0;
}

/* ------------------------------------------------------------------------------ command line */

typedef struct {
    const s_opt_t *opt; /* a config option, or NULL */
    kvt_config_action_t action;
    bool is_action;
    bool is_config; /* --config FILE */
    const char *value;
} s_arg_t;

/* Classifies argv[*i] and takes its value ("--x=V" or the next argument, which must not look
 * like a flag: "--l1-size --help" is a missing value, not a size). Booleans take a value only
 * with '='. Advances *i past a consumed value. */
static int s_parse_arg(int argc, char *const argv[], int *i, s_arg_t *a, char *err, size_t errlen)
{
    char shown[S_SHOW_LEN + 1];
    const char *arg = argv[*i];
    memset(a, 0, sizeof *a);
    if (arg[0] != '-' || arg[1] == '\0')
        return s_fail(err, errlen, "unexpected argument '%s' (see --help)",
                      s_show(arg, shown, sizeof shown));
    const char *eq = strchr(arg, '=');
    size_t n = eq ? (size_t)(eq - arg) : strlen(arg);
    int nshow = n > S_SHOW_LEN ? S_SHOW_LEN : (int)n;
    for (size_t k = 0; k < sizeof s_actions / sizeof s_actions[0]; k++) {
        if (strlen(s_actions[k].flag) == n && strncmp(arg, s_actions[k].flag, n) == 0) {
            if (eq)
                return s_fail(err, errlen, "%.*s takes no value", nshow, arg);
            a->is_action = true;
            a->action = s_actions[k].action;
            return 0;
        }
    }
    a->is_config = n == strlen(S_CONFIG_FLAG) && strncmp(arg, S_CONFIG_FLAG, n) == 0;
    if (!a->is_config) {
        a->opt = s_find_flag(arg, n);
        if (!a->opt) {
            const char *hint = s_suggest(arg, n, true);
            if (hint)
                return s_fail(err, errlen, "unknown option %.*s (did you mean %s? see --help)",
                              nshow, arg, hint);
            return s_fail(err, errlen, "unknown option %.*s (see --help)", nshow, arg);
        }
    }
    if (eq)
        a->value = eq + 1;
    else if (a->opt && a->opt->type == S_BOOL)
        a->value = "true";
    else if (*i + 1 < argc && strncmp(argv[*i + 1], "--", 2) != 0)
        a->value = argv[++*i];
    else
        return s_fail(err, errlen, "%.*s needs a value", nshow, arg);
    if (a->is_config && *a->value == '\0')
        return s_fail(err, errlen, "%s needs a value", S_CONFIG_FLAG);
    return 0;
}

int kvt_config_load(kvt_config_t *self, int argc, char *const argv[], kvt_config_action_t *action,
                    char *err, size_t errlen)
{
    kvt_config_action_t act = KVT_CONFIG_RUN, early = KVT_CONFIG_RUN;
    const char *config_path = NULL;
    bool bad = false;
    s_arg_t a;
    int rc;

    if (err && errlen > 0)
        err[0] = '\0';
    *action = KVT_CONFIG_RUN;
    /* Pass 1: syntax, actions and --config, which applies before every other flag wherever it
     * stands. --help and --version win over errors, so a broken command line can ask for help
     * and a broken config file does not hide the version. */
    for (int i = 1; i < argc; i++) {
        char why[KVT_ERR_LEN];
        if (s_parse_arg(argc, argv, &i, &a, why, sizeof why) != 0) {
            if (!bad)
                s_fail(err, errlen, "%s", why);
            bad = true;
        } else if (a.is_action && (a.action == KVT_CONFIG_HELP || a.action == KVT_CONFIG_VERSION)) {
            if (early == KVT_CONFIG_RUN)
                early = a.action;
        } else if (a.is_action) {
            if (act != KVT_CONFIG_PRINT)
                act = a.action; /* --print-config validates too, so it wins over --check */
        } else if (a.is_config) {
            if (config_path && !bad) {
                s_fail(err, errlen, "%s given twice", S_CONFIG_FLAG);
                bad = true;
            }
            config_path = a.value;
        }
    }
    if (early != KVT_CONFIG_RUN) {
        if (err && errlen > 0)
            err[0] = '\0';
        *action = early;
        return 0;
    }
    if (bad)
        return KVT_EINVAL;

    if (!config_path) {
        const char *env = getenv(S_CONFIG_ENV);
        if (env && *env)
            config_path = env;
    }
    if (config_path && (rc = kvt_config_apply_file(self, config_path, err, errlen)) != 0)
        return rc;
    free(self->config_file);
    self->config_file = config_path ? s_strdup(config_path) : NULL;

    /* Pass 2: flags in order. The first --listen / --l2 replaces what the file said; later
     * ones append, so "--l2 none" really means no L2. */
    bool seen[S_NOPTS] = {false};
    for (int i = 1; i < argc; i++) {
        if ((rc = s_parse_arg(argc, argv, &i, &a, err, errlen)) != 0)
            return rc;
        if (!a.opt)
            continue;
        size_t k = (size_t)(a.opt - s_options);
        if (a.opt->type == S_STRING_LIST && !seen[k])
            s_list_clear(self, a.opt);
        seen[k] = true;
        if ((rc = s_set_text(self, a.opt, a.value, true, err, errlen)) != 0)
            return rc;
    }

    if ((rc = kvt_config_apply_env(self, err, errlen)) != 0)
        return rc;
    if ((rc = kvt_config_finish(self, err, errlen)) != 0)
        return rc;
    *action = act;
    return 0;
}

/* ---------------------------------------------------------------------------- output */

static bool s_equal(const kvt_config_t *a, const kvt_config_t *b, const s_opt_t *o)
{
    const void *x = s_cfield(a, o), *y = s_cfield(b, o);
    switch (o->type) {
    case S_STRING:
        return strcmp(*(char *const *)x, *(char *const *)y) == 0;
    case S_STRING_LIST: {
        int n = s_ccount(a, o);
        if (n != s_ccount(b, o))
            return false;
        for (int i = 0; i < n; i++)
            if (strcmp(((char *const *)x)[i], ((char *const *)y)[i]) != 0)
                return false;
        return true;
    }
    case S_SIZE:
    case S_UINT64:
        return *(const uint64_t *)x == *(const uint64_t *)y;
    case S_UINT32:
        return *(const uint32_t *)x == *(const uint32_t *)y;
    case S_DOUBLE:
        return *(const double *)x == *(const double *)y;
    case S_BOOL:
        return *(const bool *)x == *(const bool *)y;
    }
    return false;
}

static json_t *s_to_json_value(const kvt_config_t *self, const s_opt_t *o)
{
    const void *x = s_cfield(self, o);
    json_t *v = NULL;
    switch (o->type) {
    case S_STRING:
        v = json_string(*(char *const *)x);
        break;
    case S_STRING_LIST:
        v = json_array();
        for (int i = 0; v && i < s_ccount(self, o); i++)
            kvt_assert(json_array_append_new(v, json_string(((char *const *)x)[i])) == 0);
        break;
    case S_SIZE:
    case S_UINT64:
        v = json_integer((json_int_t) * (const uint64_t *)x);
        break;
    case S_UINT32:
        v = json_integer((json_int_t) * (const uint32_t *)x);
        break;
    case S_DOUBLE:
        v = json_real(*(const double *)x);
        break;
    case S_BOOL:
        v = json_boolean(*(const bool *)x);
        break;
    }
    kvt_assert(v != NULL); /* strings were checked as UTF-8 when set */
    return v;
}

char *kvt_config_to_json(const kvt_config_t *self)
{
    kvt_config_t *defaults = kvt_config_new();
    json_t *root = json_object();
    int precision = 15;
    kvt_assert(root != NULL);
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        if ((o->flags & S_HIDDEN) && s_equal(self, defaults, o))
            continue;
        if (o->type == S_DOUBLE) {
            /* 15 digits print 0.9 as 0.9, not 0.90000000000000002; fall back to 17 (exact)
             * when some value needs them, so the output always loads back identical. */
            char buf[40];
            double d = *(const double *)s_cfield(self, o);
            snprintf(buf, sizeof buf, "%.15g", d);
            if (strtod(buf, NULL) != d)
                precision = 17;
        }
        json_t *parent = root;
        const char *key = o->name;
        const char *dot = strchr(o->name, '.');
        if (dot) {
            char *group = s_printf("%.*s", (int)(dot - o->name), o->name);
            parent = json_object_get(root, group);
            if (!parent) {
                parent = json_object();
                kvt_assert(parent && json_object_set_new(root, group, parent) == 0);
            }
            free(group);
            key = dot + 1;
        }
        kvt_assert(json_object_set_new(parent, key, s_to_json_value(self, o)) == 0);
    }
    char *text =
        json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(precision));
    json_decref(root);
    kvt_config_destroy(&defaults);
    return text;
}

void kvt_config_usage(void *out)
{
    FILE *f = out;
    char left[64];
    fprintf(f, "Usage: kvtierd [OPTIONS]\n"
               "\n"
               "Sources, later wins: defaults < --config FILE < flags < KVTIER_* environment.\n"
               "SIZE takes K/M/G/T suffixes (binary: 4G = 4*2^30). --listen and --l2 repeat;\n"
               "their environment variables take comma-separated lists.\n"
               "\n");
    fprintf(f, "  %-32s %s [env %s]\n", "--config FILE", "JSON config file", S_CONFIG_ENV);
    for (size_t k = 0; k < sizeof s_actions / sizeof s_actions[0]; k++) {
        if (!s_actions[k].help)
            continue;
        if (s_actions[k].action == KVT_CONFIG_HELP)
            snprintf(left, sizeof left, "-h, %s", s_actions[k].flag);
        else
            snprintf(left, sizeof left, "%s", s_actions[k].flag);
        fprintf(f, "  %-32s %s\n", left, s_actions[k].help);
    }
    for (size_t i = 0; i < S_NOPTS; i++) {
        const s_opt_t *o = &s_options[i];
        if (o->flags & S_HIDDEN)
            continue;
        if (o->type == S_BOOL)
            snprintf(left, sizeof left, "%s[=%s]", o->flag, o->metavar);
        else
            snprintf(left, sizeof left, "%s %s", o->flag, o->metavar);
        const char *def = o->shown_default ? o->shown_default : o->def;
        fprintf(f, "  %-32s %s [env %s, default %s]\n", left, o->help, o->env,
                def && *def ? def : "\"\"");
    }
}

uint64_t kvt_config_fastpath_pair_bytes(const kvt_config_t *self)
{
    uint64_t ring = KVT_RING_HDR_SIZE + self->fastpath_ring_bytes; /* kvt_ring_region_size */
    return (2 * ring + 4095) / 4096 * 4096;
}
