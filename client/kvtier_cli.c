/* kvtier: a small command-line client of kvtierd, built on libkvtier.
 *   kvtier [-e ENDPOINT] [-t TIMEOUT_MS] [--curve-serverkey KEY|FILE] [--curve-cert PATH]
 *          COMMAND [ARGS]
 *   ping | stats | put | get | lookup | clear | hash | keygen   (see s_usage)
 * ENDPOINT defaults to $KVTIER_ENDPOINT, else KVT_CLI_DEFAULT_ENDPOINT: ipc://var/run/kvtier.sock
 * (make run's socket) unless the build sets it (make KVT_CLI_ENDPOINT=...; the Debian package
 * builds it with the service's ipc:///run/kvtier/kvtier.sock).
 * Keys are written as 32 hex digits, the 16 key bytes in order. Objects go through PUT/GET (the
 * bytes ride the socket), so the CLI works against a daemon on another host too.
 * Exit status: 0 ok, 1 the daemon answered an error, could not be reached or has no such
 * object, 2 usage. */
#include "kvt_error.h"
#include "kvt_utf8.h"
#include "kvtier.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#ifndef KVT_CLI_DEFAULT_ENDPOINT
#define KVT_CLI_DEFAULT_ENDPOINT "ipc://var/run/kvtier.sock"
#endif
#define S_DEFAULT_NS "default"
#define S_DEFAULT_CHUNK_TOKENS 256 /* the daemon's default --chunk-tokens */

static int s_usage(void)
{
    fprintf(stderr,
            "usage: kvtier [-e ENDPOINT] [-t TIMEOUT_MS] [--curve-serverkey KEY|FILE]\n"
            "              [--curve-cert PATH] COMMAND\n"
            "  ping\n"
            "  stats\n"
            "  put    [--ns NS] [--salt S] [--key HEX32] [--label L] FILE\n"
            "         (key: XXH3-128 of the bytes; L: UTF-8 naming it in the events)\n"
            "  get    [--ns NS] [--salt S] [-o OUT] HEX32\n"
            "  lookup [--ns NS] [--salt S] HEX32...\n"
            "  clear  [--ns NS | --all]\n"
            "  hash   [--chunk-tokens N] [--salt S] TOKEN...    (local, no daemon)\n"
            "  keygen PATH     CURVE key pair: PATH (public) and PATH_secret (local, no daemon)\n"
            "NS defaults to \"default\"; ENDPOINT to $KVTIER_ENDPOINT, else "
            KVT_CLI_DEFAULT_ENDPOINT "\n"
            "CURVE (tcp:// only): --curve-serverkey / --curve-cert, or $KVTIER_CURVE_SERVERKEY /\n"
            "$KVTIER_CURVE_CERT\n");
    return 2;
}

static int s_usage_msg(const char *what, const char *arg)
{
    fprintf(stderr, "kvtier: %s: %s\n", what, arg);
    return s_usage();
}

/* The options one command accepts, parsed from argv into one struct; positional arguments are
 * collected in order ("--" ends the options). */
typedef struct {
    const char *ns, *salt, *key, *out, *label;
    bool all, ns_given;
    long chunk_tokens;
    char **pos;
    int npos;
} s_args_t;

enum {
    S_OPT_NS = 1,
    S_OPT_SALT = 2,
    S_OPT_KEY = 4,
    S_OPT_OUT = 8,
    S_OPT_ALL = 16,
    S_OPT_CT = 32,
    S_OPT_LABEL = 64
};

static int s_parse(int argc, char **argv, unsigned allowed, s_args_t *a)
{
    memset(a, 0, sizeof *a);
    a->ns = S_DEFAULT_NS;
    a->chunk_tokens = S_DEFAULT_CHUNK_TOKENS;
    a->pos = argv; /* positional arguments are compacted in place */
    bool opts = true;
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i];
        bool has_val = i + 1 < argc;
        if (opts && !strcmp(o, "--")) {
            opts = false;
        } else if (opts && (allowed & S_OPT_NS) && !strcmp(o, "--ns")) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            a->ns = argv[++i];
            a->ns_given = true;
        } else if (opts && (allowed & S_OPT_SALT) && !strcmp(o, "--salt")) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            a->salt = argv[++i];
        } else if (opts && (allowed & S_OPT_KEY) && !strcmp(o, "--key")) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            a->key = argv[++i];
        } else if (opts && (allowed & S_OPT_LABEL) && !strcmp(o, "--label")) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            a->label = argv[++i];
        } else if (opts && (allowed & S_OPT_OUT) && (!strcmp(o, "-o") || !strcmp(o, "--out"))) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            a->out = argv[++i];
        } else if (opts && (allowed & S_OPT_ALL) && !strcmp(o, "--all")) {
            a->all = true;
        } else if (opts && (allowed & S_OPT_CT) && !strcmp(o, "--chunk-tokens")) {
            if (!has_val)
                return s_usage_msg("missing value for", o);
            char *end;
            errno = 0;
            a->chunk_tokens = strtol(argv[++i], &end, 10);
            if (errno || *end || end == argv[i] || a->chunk_tokens <= 0 ||
                a->chunk_tokens > UINT32_MAX)
                return s_usage_msg("--chunk-tokens wants a positive integer, not", argv[i]);
        } else if (opts && o[0] == '-' && o[1] != '\0') {
            return s_usage_msg("unknown option", o);
        } else {
            a->pos[a->npos++] = argv[i];
        }
    }
    return 0;
}

static int s_hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int s_parse_key(const char *hex, uint8_t key[KVTIER_KEY_LEN])
{
    if (strlen(hex) != 2 * KVTIER_KEY_LEN)
        return -1;
    for (int i = 0; i < KVTIER_KEY_LEN; i++) {
        int hi = s_hexval(hex[2 * i]), lo = s_hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        key[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

static void s_print_key(const uint8_t key[KVTIER_KEY_LEN])
{
    for (int i = 0; i < KVTIER_KEY_LEN; i++)
        printf("%02x", key[i]);
    putchar('\n');
}

/* Reads a whole file ("-": stdin) into a malloc'd buffer. */
static int s_read_file(const char *path, uint8_t **data, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        fprintf(stderr, "kvtier: put: cannot open %s: %s\n", path, strerror(errno));
        return 1;
    }
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    int rc = buf ? 0 : 1;
    while (rc == 0) {
        if (n == cap) {
            uint8_t *b = cap > SIZE_MAX / 2 ? NULL : realloc(buf, cap * 2);
            if (!b) {
                rc = 1;
                break;
            }
            buf = b;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (rc == 0 && ferror(f))
        rc = 1;
    if (rc)
        fprintf(stderr, "kvtier: put: cannot read %s: %s\n", path,
                buf ? strerror(errno) : "out of memory");
    if (f != stdin)
        fclose(f);
    if (rc) {
        free(buf);
        return rc;
    }
    *data = buf;
    *len = n;
    return 0;
}

/* Writes all of buf to path ("-" or NULL: stdout). */
static int s_write_file(const char *path, const void *buf, size_t len)
{
    bool to_stdout = !path || !strcmp(path, "-");
    FILE *f = to_stdout ? stdout : fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "kvtier: get: cannot open %s: %s\n", path, strerror(errno));
        return 1;
    }
    bool ok = fwrite(buf, 1, len, f) == len;
    ok = (to_stdout ? fflush(f) : fclose(f)) == 0 && ok;
    if (!ok) {
        fprintf(stderr, "kvtier: get: cannot write %s: %s\n", to_stdout ? "stdout" : path,
                strerror(errno));
        return 1;
    }
    return 0;
}

/* ---- commands: each returns the exit status; a daemon error leaves rc < 0 for main ---- */

static int s_cmd_hash(int argc, char **argv)
{
    s_args_t a;
    int rc = s_parse(argc, argv, S_OPT_SALT | S_OPT_CT, &a);
    if (rc)
        return rc;
    if (a.npos == 0)
        return s_usage_msg("hash", "needs at least one TOKEN");
    uint32_t *tokens = malloc((size_t)a.npos * sizeof *tokens);
    size_t nkeys = (size_t)a.npos / (size_t)a.chunk_tokens;
    uint8_t(*keys)[KVTIER_KEY_LEN] = malloc((nkeys ? nkeys : 1) * KVTIER_KEY_LEN);
    if (!tokens || !keys) {
        fprintf(stderr, "kvtier: hash: out of memory\n");
        rc = 1;
    }
    for (int i = 0; rc == 0 && i < a.npos; i++) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(a.pos[i], &end, 10);
        if (errno || *end || end == a.pos[i] || a.pos[i][0] == '-' || v > UINT32_MAX)
            rc = s_usage_msg("a TOKEN is an unsigned 32-bit integer, not", a.pos[i]);
        else
            tokens[i] = (uint32_t)v;
    }
    if (rc == 0) {
        uint32_t n = kvtier_hash_tokens_local(tokens, (size_t)a.npos, (uint32_t)a.chunk_tokens,
                                              a.salt, keys);
        for (uint32_t i = 0; i < n; i++)
            s_print_key(keys[i]);
    }
    free(tokens);
    free(keys);
    return rc;
}

static int s_cmd_put(kvtier_t *c, const s_args_t *a)
{
    uint8_t key[KVTIER_KEY_LEN], *data = NULL;
    size_t len = 0;
    if (s_read_file(a->pos[0], &data, &len))
        return 1;
    if (a->key) {
        s_parse_key(a->key, key); /* checked before connecting */
    } else {
        /* content addressing, like a media hash for an embedding: same bytes, same key */
        XXH128_canonical_t h;
        XXH128_canonicalFromHash(&h, XXH3_128bits(data, len));
        memcpy(key, h.digest, sizeof key);
    }
    const void *ptrs[1] = {data};
    uint32_t stored = 0;
    const char *labels[1] = {a->label};
    int rc = kvtier_put_labeled(c, a->ns, a->salt, (const uint8_t(*)[KVTIER_KEY_LEN])key, 1,
                                a->label ? labels : NULL, ptrs, &len, &stored);
    free(data);
    if (rc)
        return rc;
    s_print_key(key);
    printf("stored %u\n", stored);
    return 0;
}

static int s_cmd_get(kvtier_t *c, const s_args_t *a)
{
    uint8_t key[KVTIER_KEY_LEN];
    s_parse_key(a->pos[0], key);
    kvtier_buf_t buf;
    uint32_t found = 0;
    int rc = kvtier_get(c, a->ns, a->salt, (const uint8_t(*)[KVTIER_KEY_LEN])key, 1, &buf, &found);
    if (rc)
        return rc;
    if (found == 0) {
        fprintf(stderr, "kvtier: get: %s not found\n", a->pos[0]);
        return 1;
    }
    rc = s_write_file(a->out, buf.data, buf.len);
    free(buf.data);
    return rc;
}

static int s_cmd_lookup(kvtier_t *c, const s_args_t *a)
{
    uint8_t(*keys)[KVTIER_KEY_LEN] = malloc((size_t)a->npos * KVTIER_KEY_LEN);
    if (!keys) {
        fprintf(stderr, "kvtier: lookup: out of memory\n");
        return 1;
    }
    for (int i = 0; i < a->npos; i++)
        s_parse_key(a->pos[i], keys[i]);
    uint32_t hits = 0, l1 = 0;
    int rc = kvtier_lookup(c, a->ns, a->salt, (const uint8_t(*)[KVTIER_KEY_LEN])keys,
                           (uint32_t)a->npos, 0, &hits, &l1, NULL, NULL);
    free(keys);
    if (rc == 0)
        printf("hits %u l1 %u\n", hits, l1);
    return rc;
}

static int s_cmd_clear(kvtier_t *c, const s_args_t *a)
{
    uint64_t removed = 0;
    int rc = kvtier_clear(c, a->all ? NULL : a->ns, &removed);
    if (rc == 0)
        printf("removed %llu\n", (unsigned long long)removed);
    return rc;
}

/* Checks a command's arguments before any connection is made, so that a usage error is exit 2
 * whether or not a daemon is running. */
static int s_check_args(const char *cmd, int argc, char **argv, s_args_t *a)
{
    unsigned allowed = 0;
    int min = 0, max = 0;
    if (!strcmp(cmd, "ping") || !strcmp(cmd, "stats")) {
        allowed = 0;
    } else if (!strcmp(cmd, "put")) {
        allowed = S_OPT_NS | S_OPT_SALT | S_OPT_KEY | S_OPT_LABEL;
        min = max = 1;
    } else if (!strcmp(cmd, "get")) {
        allowed = S_OPT_NS | S_OPT_SALT | S_OPT_OUT;
        min = max = 1;
    } else if (!strcmp(cmd, "lookup")) {
        allowed = S_OPT_NS | S_OPT_SALT;
        min = 1;
        max = INT32_MAX;
    } else if (!strcmp(cmd, "clear")) {
        allowed = S_OPT_NS | S_OPT_ALL;
    } else {
        return s_usage_msg("unknown command", cmd);
    }
    int rc = s_parse(argc, argv, allowed, a);
    if (rc)
        return rc;
    if (a->npos < min || a->npos > max)
        return s_usage_msg(cmd, a->npos < min ? "missing arguments" : "too many arguments");
    uint8_t key[KVTIER_KEY_LEN];
    if (a->key && s_parse_key(a->key, key))
        return s_usage_msg("a key is 32 hex digits, not", a->key);
    for (int i = 0; strcmp(cmd, "put") && i < a->npos; i++)
        if (s_parse_key(a->pos[i], key))
            return s_usage_msg("a key is 32 hex digits, not", a->pos[i]);
    if (a->label && strlen(a->label) > KVTIER_MAX_LABEL)
        return s_usage_msg("--label", "at most 255 bytes");
    if (a->label && !kvt_utf8_valid((const uint8_t *)a->label, strlen(a->label)))
        return s_usage_msg("--label", "not UTF-8");
    if (!strcmp(cmd, "clear") && a->all && a->ns_given)
        return s_usage_msg(cmd, "--ns and --all exclude each other");
    if (a->ns[0] == '\0')
        return s_usage_msg(cmd, "--ns must not be empty");
    return 0;
}

/* keygen PATH: what an operator needs for CURVE, from what we ship (no czmq tools needed). */
static int s_cmd_keygen(int argc, char **argv)
{
    if (argc != 1 || argv[0][0] == '-')
        return s_usage_msg("keygen", argc == 1 ? "PATH must not start with '-'" : "wants PATH");
    char err[256], pub[41];
    if (kvtier_curve_keygen(argv[0], pub, err, sizeof err) != 0) {
        fprintf(stderr, "kvtier: keygen: %s\n", err);
        return 1;
    }
    printf("public key %s\nwrote %s (public) and %s_secret (secret, mode 0600)\n", pub, argv[0],
           argv[0]);
    return 0;
}

int main(int argc, char **argv)
{
    const char *endpoint = getenv("KVTIER_ENDPOINT");
    kvtier_curve_t curve = {getenv("KVTIER_CURVE_SERVERKEY"), getenv("KVTIER_CURVE_CERT")};
    int timeout = 5000;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if ((!strcmp(argv[i], "-e") || !strcmp(argv[i], "--endpoint")) && i + 1 < argc) {
            endpoint = argv[++i];
        } else if (!strcmp(argv[i], "--curve-serverkey") && i + 1 < argc) {
            curve.server_key = argv[++i];
        } else if (!strcmp(argv[i], "--curve-cert") && i + 1 < argc) {
            curve.client_cert = argv[++i];
        } else if ((!strcmp(argv[i], "-t") || !strcmp(argv[i], "--timeout")) && i + 1 < argc) {
            char *end;
            long t = strtol(argv[++i], &end, 10);
            if (*end || end == argv[i] || t <= 0 || t > INT32_MAX)
                return s_usage_msg("-t wants a positive number of milliseconds, not", argv[i]);
            timeout = (int)t;
        } else {
            return s_usage();
        }
    }
    if (i >= argc)
        return s_usage();
    const char *cmd = argv[i++];
    if (!strcmp(cmd, "hash"))
        return s_cmd_hash(argc - i, argv + i);
    if (!strcmp(cmd, "keygen"))
        return s_cmd_keygen(argc - i, argv + i);
    s_args_t a;
    int rc = s_check_args(cmd, argc - i, argv + i, &a);
    if (rc)
        return rc;
    if (!endpoint || !*endpoint)
        endpoint = KVT_CLI_DEFAULT_ENDPOINT;
    char err[256];
    /* The heartbeat stays on (KVTIER_HEARTBEAT_MS as for any client): it opens its connection
     * only one interval (lease_ms / 3, 100 ms to 10 s) after connect, so a command shorter than
     * that costs a thread start and stop and nothing on the wire, and a long put or get of a
     * large object is covered like any other client's call. */
    kvtier_t *c =
        kvtier_connect_curve(endpoint, "kvtier-cli", NULL, timeout, &curve, err, sizeof err);
    if (!c) {
        fprintf(stderr, "kvtier: %s\n", err);
        return 1;
    }
    if (!strcmp(cmd, "ping")) {
        rc = kvtier_ping(c);
        if (rc == 0)
            printf("pong from %s\n", kvtier_info(c)->server);
    } else if (!strcmp(cmd, "stats")) {
        char *json = NULL;
        rc = kvtier_stats(c, &json);
        if (rc == 0)
            printf("%s\n", json);
        free(json);
    } else if (!strcmp(cmd, "put")) {
        rc = s_cmd_put(c, &a);
    } else if (!strcmp(cmd, "get")) {
        rc = s_cmd_get(c, &a);
    } else if (!strcmp(cmd, "lookup")) {
        rc = s_cmd_lookup(c, &a);
    } else {
        rc = s_cmd_clear(c, &a);
    }
    /* rc < 0: the library failed and kept a message; rc 1: the command already said why */
    if (rc < 0)
        fprintf(stderr, "kvtier: %s: %s (%s)\n", cmd, kvtier_last_error(c), kvt_err_wire(rc));
    kvtier_close(&c);
    return rc ? 1 : 0;
}
