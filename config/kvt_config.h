/* kvt_config: the daemon's configuration — one declarative option table, loaded from embedded
 * defaults, then a JSON file (--config), then command-line flags, then KVTIER_* environment
 * variables, then validated as a whole. The result is treated as immutable once the daemon
 * starts and is passed down as `const kvt_config_t *`; there is no global settings struct.
 * Called from the main thread at start-up only (and from unit tests / fuzzers). */
#ifndef KVT_CONFIG_H
#define KVT_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define KVT_MAX_LISTEN 8
#define KVT_MAX_L2 8
#define KVT_ERR_LEN 256

typedef struct kvt_config {
    char *listen[KVT_MAX_LISTEN]; /* ZMQ endpoints; default ipc://RUN_DIR/kvtier.sock */
    int n_listen;
    char *http;     /* "ADDR:PORT", or "" to disable HTTP */
    uint32_t http_max_connections; /* bounded at start by RLIMIT_NOFILE (kvt_http) */
    uint32_t http_timeout_s;       /* idle HTTP connections are closed after this */
    char *http_hosts;              /* extra Host names HTTP answers to, comma-separated */
    char *events;   /* ZMQ PUB endpoint, or "" for none */
    uint32_t event_log_size; /* records of the event log (storage/kvt_evlog); 0: none */
    char *run_dir;  /* ipc socket, pid-style runtime files */
    char *data_dir; /* default home of the fs L2 */
    uint64_t l1_size;
    uint32_t chunk_tokens;
    uint32_t lease_ms;
    double high_watermark;
    double low_watermark;
    char *l2[KVT_MAX_L2]; /* adapter specs: "fs:DIR", "redis:HOST:PORT", "mock:...", "none" */
    int n_l2;
    char *log_level; /* error | warn | info | debug */
    uint64_t max_message; /* bytes in one whole request, all frames */
    uint32_t max_keys;    /* keys in one request */
    uint32_t max_prefetch_jobs; /* live prefetch jobs; past it LOOKUP starts none */
    /* the L2 part of a lookup, either door: its deadline, and the service's threads for it;
     * the threads that load prefetched objects */
    uint32_t l2_lookup_timeout_ms;
    uint32_t l2_lookup_threads;
    uint32_t l2_prefetch_threads;
    uint32_t l2_write_threads; /* write-behind threads per adapter (at most its max_threads) */
    double
        l2_backlog_max; /* L1 fraction objects waiting for L2 may fill before eviction takes them */
    uint32_t workers;     /* worker threads for slow requests */
    uint32_t io_threads;  /* zmq I/O threads */
    /* what one client, or all of them, may hold of the daemon */
    uint32_t max_connections;      /* client connections open at once */
    uint32_t max_instances;        /* client instances alive at once */
    uint32_t max_instances_per_connection;
    uint32_t reply_timeout_ms;     /* replies not moving this long: the connection is cut */
    uint64_t max_reply_pinned;     /* L1 bytes unsent GET replies may pin, per connection */
    uint64_t max_reply_backlog;    /* daemon memory unsent replies may hold, per connection */
    bool allow_unpinned;
    /* bytes one client instance may hold under leases (reservations and read pins), 0: no
     * limit; the daemon's own leases are never limited */
    uint64_t max_leased_bytes;
    /* the residency map (common/kvt_resident) that fast-path clients read, and its slots (0:
     * sized from the L1: two per 64 KiB) */
    bool resident_map;
    uint32_t resident_slots;
    /* XXH3-64 of every L1 object at COMMIT, checked by GET and before write-behind */
    bool l1_checksum;
    /* the arena outlives the daemon (a stable name, kept at stop) and the next one adopts what
     * the journal (RUN_DIR/kvtier-l1.journal) says it holds */
    bool l1_adopt;
    /* the arena on 2 MiB pages: "auto" (hugetlbfs when a mount has enough free pages, else
     * /dev/shm), "on" (hugetlbfs or refuse to start), "off" (/dev/shm, no THP request) */
    char *l1_hugepages;
    char *l1_hugepages_dir; /* hugetlbfs mount, "" for the first 2 MiB one in /proc/mounts */
    char *shm_group; /* group allowed to map the arena (0660), "" for owner only (0600) */
    bool allow_insecure_remote;
    /* CURVE on every tcp:// listen endpoint (both set, or neither): the daemon's secret
     * certificate (czmq zcert format) and a directory of the client public certificates
     * allowed to connect. With them, a non-loopback tcp listen needs no allow_insecure_remote. */
    char *curve_server_cert;
    char *curve_clients;
    bool curve_require; /* every tcp:// listen endpoint must have CURVE, loopback ones too */
    /* the LMCache-compatible door (daemon/kvt_lmcache_door): its ROUTER endpoint ("" = off), how
     * long a registered worker may stay silent before it is dropped (0: never), and how many
     * requests' lookup state it keeps at once */
    char *lmcache_listen;
    uint32_t lmcache_reap_timeout_s;
    uint32_t lmcache_max_requests;
    /* the same-machine fast path (daemon/kvt_fastpath): ring pairs offered at HELLO, at most
     * fastpath_rings at once, each ring fastpath_ring_bytes (a power of two) of the arena's
     * tail; the fast-path thread spins fastpath_spin_us after its last request before sleeping */
    bool fastpath_enabled;
    uint32_t fastpath_rings;
    uint64_t fastpath_ring_bytes;
    uint32_t fastpath_spin_us;
    /* hidden test knobs (never in --print-config unless set): make a supervised thread stall
     * or exit, to test the supervisor and /readyz */
    char *debug_fault_thread; /* thread name, "" for none */
    char *debug_fault_mode;   /* "stall" | "exit" */
    uint32_t debug_fault_after_ms;
    uint32_t debug_fault_for_ms;
    /* hidden test knob: every Nth L1 block allocation fails as if the arena were full and
     * nothing evictable (0: never), to test that requests then fail with no_space */
    uint32_t debug_fail_alloc_every;
    uint64_t debug_journal_compact_bytes; /* test hook: journal compaction threshold */
    /* not an option: the file kvt_config_load read (--config or KVTIER_CONFIG), NULL for none;
     * SIGHUP reads it again */
    char *config_file;
} kvt_config_t;

/* What the command line asks the process to do. */
typedef enum {
    KVT_CONFIG_RUN = 0,
    KVT_CONFIG_CHECK, /* --check-config */
    KVT_CONFIG_PRINT, /* --print-config */
    KVT_CONFIG_VERSION,
    KVT_CONFIG_HELP,
} kvt_config_action_t;

/* A config holding the embedded defaults (derived defaults such as listen and l2 are filled
 * in by kvt_config_finish). Aborts only on OOM of small bookkeeping. */
kvt_config_t *kvt_config_new(void);

void kvt_config_destroy(kvt_config_t **self_p);

/* Applies a JSON config text (an object); unknown keys, duplicate keys, wrong types and
 * out-of-range values are rejected. `origin` names the source in messages (a file name).
 * Returns 0 or KVT_EINVAL with one line in err naming the option and the reason. */
int kvt_config_apply_json(kvt_config_t *self, const char *text, size_t len, const char *origin,
                          char *err, size_t errlen);

/* Reads and applies a JSON config file. */
int kvt_config_apply_file(kvt_config_t *self, const char *path, char *err, size_t errlen);

/* Applies one option by its JSON name ("l1_size", "debug.fault_mode") from a string value, as
 * flags and environment variables do. List options append when `append` is set. */
int kvt_config_set(kvt_config_t *self, const char *name, const char *value, bool append,
                   char *err, size_t errlen);

/* Applies KVTIER_* environment variables (KVTIER_L1_SIZE, KVTIER_LISTEN=a,b, ...). */
int kvt_config_apply_env(kvt_config_t *self, char *err, size_t errlen);

/* Fills derived defaults (listen, l2 from run_dir/data_dir) and validates cross-field rules
 * (low < high watermark, non-loopback tcp needs allow_insecure_remote, ...). */
int kvt_config_finish(kvt_config_t *self, char *err, size_t errlen);

/* The whole start-up sequence for argv: defaults, --config FILE, flags, environment, finish.
 * Sets *action. Returns 0, or KVT_EINVAL with one line in err (the caller exits 2). */
int kvt_config_load(kvt_config_t *self, int argc, char *const argv[], kvt_config_action_t *action,
                    char *err, size_t errlen);

/* The effective config as a JSON text that is itself a valid config file. Caller frees. */
char *kvt_config_to_json(const kvt_config_t *self);

/* Writes --help text to `out` (a FILE *). */
void kvt_config_usage(void *out);

/* The group of shm_group (a name or a number): 0 and *gid; 1 when shm_group is empty;
 * KVT_EINVAL when no such group exists. */
int kvt_config_shm_gid(const kvt_config_t *self, gid_t *gid);

/* Bytes of one fast-path ring pair's memory (a memfd of its own; page-rounded). */
uint64_t kvt_config_fastpath_pair_bytes(const kvt_config_t *self);

#endif
