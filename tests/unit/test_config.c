/* Unit tests of config/kvt_config: defaults, the four sources and their precedence, the size
 * syntax, every class of error message, list semantics, the loopback rule, the --print-config
 * round trip and the action flags. Built with ASan+UBSan (make build/asan/tests/test_config), so
 * every error path is also checked for leaks. Each test starts and ends with no KVTIER_*
 * variable in the environment, whatever the caller's shell has set. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kvt_config.h"
#include "kvt_size.h"
#include "kvt_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

#define ARGC(a) ((int)(sizeof(a) / sizeof((a)[0])) - 1)

static void s_clean_env(void)
{
    char *names[256];
    int n = 0;
    for (char **e = environ; e && *e && n < 256; e++)
        if (strncmp(*e, "KVTIER_", 7) == 0)
            names[n++] = strndup(*e, strcspn(*e, "="));
    for (int i = 0; i < n; i++) {
        unsetenv(names[i]);
        free(names[i]);
    }
}

static int s_setup(void **state)
{
    (void)state;
    s_clean_env();
    return 0;
}

static int s_teardown(void **state)
{
    (void)state;
    s_clean_env();
    return 0;
}

/* A temporary config file; the caller unlinks and frees the path. */
static char *s_tmp_file(const char *text)
{
    char *path = strdup("/tmp/kvt_test_config_XXXXXX.json");
    assert_non_null(path);
    int fd = mkstemps(path, 5);
    assert_true(fd >= 0);
    size_t len = strlen(text);
    assert_int_equal(write(fd, text, len), (ssize_t)len);
    close(fd);
    return path;
}

static void s_rm_tmp(char **path)
{
    unlink(*path);
    free(*path);
    *path = NULL;
}

/* Applies JSON text and expects an error containing `want`. */
static void s_json_fails(const char *text, const char *want)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *c = kvt_config_new();
    int rc = kvt_config_apply_json(c, text, strlen(text), "config.json", err, sizeof err);
    if (rc != KVT_EINVAL || !strstr(err, want))
        fail_msg("json %s: rc %d, err '%s', wanted '%s'", text, rc, err, want);
    assert_null(strchr(err, '\n'));
    kvt_config_destroy(&c);
}

static void s_json_ok(kvt_config_t *c, const char *text)
{
    char err[KVT_ERR_LEN] = "";
    int rc = kvt_config_apply_json(c, text, strlen(text), "config.json", err, sizeof err);
    if (rc != 0)
        fail_msg("json %s: %s", text, err);
}

/* kvt_config_set on a fresh config must fail with exactly `want`. */
static void s_set_fails(const char *name, const char *value, const char *want)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *c = kvt_config_new();
    int rc = kvt_config_set(c, name, value, false, err, sizeof err);
    if (rc != KVT_EINVAL || strcmp(err, want) != 0)
        fail_msg("set %s=%s: rc %d, err '%s', wanted '%s'", name, value, rc, err, want);
    kvt_config_destroy(&c);
}

static void s_set_ok(kvt_config_t *c, const char *name, const char *value)
{
    char err[KVT_ERR_LEN] = "";
    if (kvt_config_set(c, name, value, false, err, sizeof err) != 0)
        fail_msg("set %s=%s: %s", name, value, err);
}

/* kvt_config_load on a fresh config; returns rc and leaves the message in err. */
static int s_load(kvt_config_t **out, int argc, char *argv[], kvt_config_action_t *action,
                  char *err, size_t errlen)
{
    *out = kvt_config_new();
    return kvt_config_load(*out, argc, argv, action, err, errlen);
}

static void s_finish_fails(kvt_config_t *c, const char *want)
{
    char err[KVT_ERR_LEN] = "";
    int rc = kvt_config_finish(c, err, sizeof err);
    if (rc != KVT_EINVAL || strcmp(err, want) != 0)
        fail_msg("finish: rc %d, err '%s', wanted '%s'", rc, err, want);
}

static void s_finish_ok(kvt_config_t *c)
{
    char err[KVT_ERR_LEN] = "";
    if (kvt_config_finish(c, err, sizeof err) != 0)
        fail_msg("finish: %s", err);
}

/* ------------------------------------------------------------------------------------ tests */

static void test_defaults(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    assert_int_equal(c->n_listen, 0); /* derived by finish */
    assert_int_equal(c->n_l2, 0);
    assert_string_equal(c->http, "127.0.0.1:8080");
    assert_string_equal(c->events, "");
    assert_int_equal(c->event_log_size, 32768);
    assert_string_equal(c->run_dir, "./var/run");
    assert_string_equal(c->data_dir, "./var/data");
    assert_true(c->l1_size == (1ull << 30));
    assert_int_equal(c->chunk_tokens, 256);
    assert_int_equal(c->lease_ms, 30000);
    assert_true(c->high_watermark == 0.90);
    assert_true(c->low_watermark == 0.80);
    assert_string_equal(c->log_level, "info");
    assert_true(c->max_message == 256ull << 20);
    assert_int_equal(c->max_keys, 65536);
    assert_false(c->allow_unpinned);
    assert_false(c->allow_insecure_remote);
    assert_string_equal(c->debug_fault_thread, "");
    assert_string_equal(c->debug_fault_mode, "stall");
    assert_string_equal(c->l1_hugepages, "auto");
    assert_string_equal(c->l1_hugepages_dir, "");
    assert_int_equal(c->debug_fault_after_ms, 0);
    assert_int_equal(c->debug_fault_for_ms, 0);
    s_finish_ok(c);
    assert_int_equal(c->n_listen, 1);
    assert_string_equal(c->listen[0], "ipc://./var/run/kvtier.sock");
    assert_int_equal(c->n_l2, 1);
    assert_string_equal(c->l2[0], "fs:./var/data/l2");
    /* finish is idempotent: derived entries are not added twice */
    s_finish_ok(c);
    assert_int_equal(c->n_listen, 1);
    assert_int_equal(c->n_l2, 1);
    kvt_config_destroy(&c);
    assert_null(c);
    kvt_config_destroy(&c); /* NULL is fine */
    kvt_config_destroy(NULL);
}

static void test_derived_from_dirs(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_set_ok(c, "run_dir", "/run/kvtier/");
    s_set_ok(c, "data_dir", "/srv/kv");
    s_finish_ok(c);
    assert_string_equal(c->listen[0], "ipc:///run/kvtier/kvtier.sock");
    assert_string_equal(c->l2[0], "fs:/srv/kv/l2");
    kvt_config_destroy(&c);

    /* the derived ipc path is checked against sun_path like any other */
    c = kvt_config_new();
    char dir[200];
    memset(dir, 'd', sizeof dir - 1);
    dir[0] = '/';
    dir[sizeof dir - 1] = '\0';
    s_set_ok(c, "run_dir", dir);
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_config_finish(c, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, "listen: "));
    assert_non_null(strstr(err, "ipc path is longer than 107 bytes"));
    kvt_config_destroy(&c);
}

static void test_parse_size(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        uint64_t v;
    } good[] = {
        {"0", 0},
        {"1", 1},
        {"1073741824", 1073741824ull},
        {"512B", 512},
        {"64k", 64ull << 10},
        {"64K", 64ull << 10},
        {"64KB", 64ull << 10},
        {"64KiB", 64ull << 10},
        {"64kib", 64ull << 10},
        {"512M", 512ull << 20},
        {"512mb", 512ull << 20},
        {"4G", 4ull << 30},
        {"4GiB", 4ull << 30},
        {"1T", 1ull << 40},
        {"16777215T", 16777215ull << 40},
        {"18446744073709551615", UINT64_MAX},
    };
    static const char *const bad[] = {
        "",
        "G",
        "-1",
        "+1",
        " 1",
        "1 ",
        "1.5G",
        "12Q",
        "1GG",
        "1Gi",
        "1iB",
        "0x10",
        "1e3",
        "4GBx",
        "1P",
        "16777216T",
        "18446744073709551616",
        "99999999999999999999999G",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        uint64_t v = 12345;
        if (kvt_size_parse(good[i].s, &v) != 0 || v != good[i].v)
            fail_msg("size '%s' -> %llu, wanted %llu", good[i].s, (unsigned long long)v,
                     (unsigned long long)good[i].v);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v = 12345;
        if (kvt_size_parse(bad[i], &v) == 0 || v != 12345)
            fail_msg("size '%s' accepted (%llu)", bad[i], (unsigned long long)v);
    }
    uint64_t v;
    assert_int_equal(kvt_size_parse(NULL, &v), KVT_EINVAL);
    assert_int_equal(kvt_size_parse("1P", &v), KVT_EINVAL);
    assert_int_equal(kvt_size_parse("16777216T", &v), KVT_ETOOBIG); /* a size, too big */
    assert_int_equal(kvt_size_parse("18446744073709551616", &v), KVT_ETOOBIG);
}

static void test_set_values(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_set_ok(c, "l1_size", "2G");
    assert_true(c->l1_size == 2ull << 30);
    s_set_ok(c, "l1_size", "1048576");
    assert_true(c->l1_size == 1ull << 20);
    s_set_ok(c, "max_message", "4G");
    assert_true(c->max_message == 4ull << 30);
    s_set_ok(c, "chunk_tokens", "1048576");
    assert_int_equal(c->chunk_tokens, 1048576);
    s_set_ok(c, "high_watermark", "1");
    assert_true(c->high_watermark == 1.0);
    s_set_ok(c, "low_watermark", "0.5");
    assert_true(c->low_watermark == 0.5);
    s_set_ok(c, "allow_unpinned", "yes");
    assert_true(c->allow_unpinned);
    s_set_ok(c, "allow_unpinned", "FALSE");
    assert_false(c->allow_unpinned);
    s_set_ok(c, "log_level", "debug");
    assert_string_equal(c->log_level, "debug");
    s_set_ok(c, "http", "");
    assert_string_equal(c->http, "");
    s_set_ok(c, "http", "[::1]:9090");
    s_set_ok(c, "events", "tcp://127.0.0.1:5556");
    s_set_ok(c, "l1.hugepages", "off");
    assert_string_equal(c->l1_hugepages, "off");
    s_set_ok(c, "l1.hugepages_dir", "/dev/hugepages");
    assert_string_equal(c->l1_hugepages_dir, "/dev/hugepages");
    s_set_ok(c, "debug.fault_mode", "exit");
    assert_string_equal(c->debug_fault_mode, "exit");
    s_set_ok(c, "debug.fault_after_ms", "4294967295");
    assert_true(c->debug_fault_after_ms == UINT32_MAX);
    kvt_config_destroy(&c);
}

static void test_set_errors(void **state)
{
    (void)state;
    s_set_fails("l1_size", "12Q", "l1_size: '12Q' is not a size (use e.g. 512M, 4G)");
    s_set_fails("l1_size", "", "l1_size: '' is not a size (use e.g. 512M, 4G)");
    s_set_fails("l1_size", "-1G", "l1_size: '-1G' is not a size (use e.g. 512M, 4G)");
    s_set_fails("l1_size", "512K", "l1_size: 512K is out of range [1M, 1T]");
    s_set_fails("l1_size", "2T", "l1_size: 2T is out of range [1M, 1T]");
    s_set_fails("l1_size", "99999999999999999999",
                "l1_size: 99999999999999999999 is out of range [1M, 1T]");
    s_set_fails("max_message", "8G", "max_message: 8G is out of range [4K, 4G]");
    s_set_fails("max_message", "4095", "max_message: 4095 is out of range [4K, 4G]");
    s_set_fails("chunk_tokens", "0", "chunk_tokens: 0 is out of range [1, 1048576]");
    /* an integer past 64 bits is out of range, not taken as 0 (an option whose minimum is 0) */
    s_set_fails("debug.fault_after_ms", "99999999999999999999",
                "debug.fault_after_ms: 99999999999999999999 is out of range [0, 4294967295]");
    s_set_fails("chunk_tokens", "1048577", "chunk_tokens: 1048577 is out of range [1, 1048576]");
    s_set_fails("chunk_tokens", "abc", "chunk_tokens: 'abc' is not an integer");
    s_set_fails("chunk_tokens", "-1", "chunk_tokens: '-1' is not an integer");
    s_set_fails("chunk_tokens", "12 ", "chunk_tokens: '12 ' is not an integer");
    s_set_fails("lease_ms", "99", "lease_ms: 99 is out of range [100, 86400000]");
    s_set_fails("max_keys", "0", "max_keys: 0 is out of range [1, 1048576]");
    s_set_fails("debug.fault_for_ms", "4294967296",
                "debug.fault_for_ms: 4294967296 is out of range [0, 4294967295]");
    s_set_fails("high_watermark", "0", "high_watermark: 0 is out of range (0, 1]");
    s_set_fails("high_watermark", "1.5", "high_watermark: 1.5 is out of range (0, 1]");
    s_set_fails("low_watermark", "-0.1", "low_watermark: -0.1 is out of range (0, 1]");
    s_set_fails("low_watermark", "nan", "low_watermark: 'nan' is not a number");
    s_set_fails("low_watermark", "0.8x", "low_watermark: '0.8x' is not a number");
    s_set_fails("low_watermark", "", "low_watermark: '' is not a number");
    s_set_fails("allow_unpinned", "maybe",
                "allow_unpinned: 'maybe' is not a boolean (use true or false)");
    s_set_fails("log_level", "verbose",
                "log_level: 'verbose' is not one of error, warn, info, debug");
    s_set_fails("l1.hugepages", "yes", "l1.hugepages: 'yes' is not one of auto, on, off");
    s_set_fails("debug.fault_mode", "crash", "debug.fault_mode: 'crash' is not one of stall, exit");
    s_set_fails("http", "localhost",
                "http: 'localhost' is not ADDR:PORT with a port in 1-65535 (use \"\" to disable "
                "HTTP)");
    s_set_fails("http", "127.0.0.1:0",
                "http: '127.0.0.1:0' is not ADDR:PORT with a port in 1-65535 (use \"\" to "
                "disable HTTP)");
    s_set_fails("http", "127.0.0.1:65536",
                "http: '127.0.0.1:65536' is not ADDR:PORT with a port in 1-65535 (use \"\" to "
                "disable HTTP)");
    s_set_fails("http", ":8080",
                "http: ':8080' is not ADDR:PORT with a port in 1-65535 (use \"\" to disable "
                "HTTP)");
    s_set_fails("events", "udp://x:1",
                "events: 'udp://x:1' is not an endpoint (use ipc://PATH or tcp://HOST:PORT)");
    s_set_fails("run_dir", "", "run_dir: must not be empty");
    s_set_fails("listen", "http://x",
                "listen: 'http://x' is not an endpoint (use ipc://PATH or tcp://HOST:PORT)");
    s_set_fails("listen", "ipc://",
                "listen: 'ipc://' is not an endpoint (use ipc://PATH or tcp://HOST:PORT)");
    s_set_fails("listen", "tcp://127.0.0.1",
                "listen: 'tcp://127.0.0.1' is not an endpoint (use ipc://PATH or "
                "tcp://HOST:PORT)");
    s_set_fails("l2", "s3:bucket",
                "l2: 's3:bucket' is not an L2 spec (use fs:DIR, redis:HOST:PORT, mock:OPTS, "
                "plugin:PATH or none)");
    s_set_fails("l2", "fs:",
                "l2: 'fs:' is not an L2 spec (use fs:DIR, redis:HOST:PORT, mock:OPTS, "
                "plugin:PATH or none)");
    s_set_fails("l2", "nonex",
                "l2: 'nonex' is not an L2 spec (use fs:DIR, redis:HOST:PORT, mock:OPTS, "
                "plugin:PATH or none)");
    s_set_fails("l1_sise", "1G", "unknown option 'l1_sise'");
    s_set_fails("debug", "1", "unknown option 'debug'");
    s_set_fails("run_dir", "\xff\xfe", "run_dir: value is not valid UTF-8");

    /* a failed set leaves the old value */
    kvt_config_t *c = kvt_config_new();
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_config_set(c, "l1_size", "12Q", false, err, sizeof err), KVT_EINVAL);
    assert_true(c->l1_size == 1ull << 30);
    assert_int_equal(kvt_config_set(c, "l1_size", NULL, false, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "l1_size: needs a value");
    /* a long hostile value is cut and kept on one line */
    char big[600];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    big[3] = '\n';
    assert_int_equal(kvt_config_set(c, "l1_size", big, false, err, sizeof err), KVT_EINVAL);
    assert_null(strchr(err, '\n'));
    assert_non_null(strstr(err, "...' is not a size"));
    /* err may be NULL or tiny */
    assert_int_equal(kvt_config_set(c, "l1_size", "12Q", false, NULL, 0), KVT_EINVAL);
    char tiny[4];
    assert_int_equal(kvt_config_set(c, "l1_size", "12Q", false, tiny, sizeof tiny), KVT_EINVAL);
    assert_string_equal(tiny, "l1_");
    kvt_config_destroy(&c);
}

static void test_json_values(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_json_ok(c, "{\"l1_size\": 2147483648, \"max_message\": \"64M\", \"chunk_tokens\": 128,"
                 " \"high_watermark\": 1, \"low_watermark\": 0.5, \"allow_unpinned\": true,"
                 " \"listen\": \"tcp://127.0.0.1:5555\", \"l2\": [\"none\"], \"http\": \"\","
                 " \"debug\": {\"fault_thread\": \"worker-0\", \"fault_after_ms\": 10}}");
    assert_true(c->l1_size == 2ull << 30);
    assert_true(c->max_message == 64ull << 20);
    assert_int_equal(c->chunk_tokens, 128);
    assert_true(c->high_watermark == 1.0);
    assert_true(c->low_watermark == 0.5);
    assert_true(c->allow_unpinned);
    assert_int_equal(c->n_listen, 1);
    assert_string_equal(c->listen[0], "tcp://127.0.0.1:5555");
    assert_int_equal(c->n_l2, 1);
    assert_string_equal(c->l2[0], "none");
    assert_string_equal(c->http, "");
    assert_string_equal(c->debug_fault_thread, "worker-0");
    assert_int_equal(c->debug_fault_after_ms, 10);
    s_finish_ok(c);
    /* a JSON list replaces, it does not append */
    s_json_ok(c, "{\"l2\": [\"fs:/a\", \"redis:127.0.0.1:6379\"], \"listen\": []}");
    assert_int_equal(c->n_l2, 2);
    assert_string_equal(c->l2[1], "redis:127.0.0.1:6379");
    assert_int_equal(c->n_listen, 0);
    s_json_ok(c, "{}");
    s_json_ok(c, "{\"debug\": {}}");
    kvt_config_destroy(&c);
}

static void test_json_errors(void **state)
{
    (void)state;
    s_json_fails("{\"l1_sise\": \"1G\"}",
                 "config.json: unknown option 'l1_sise' (did you mean 'l1_size'?)");
    s_json_fails("{\"bogus_thing_here\": 1}", "config.json: unknown option 'bogus_thing_here'");
    s_json_fails("{\"debug\": {\"fault_mod\": \"exit\"}}",
                 "config.json: unknown option 'debug.fault_mod'");
    s_json_fails("{\"debug\": 1}", "config.json: debug: expected an object, got 1");
    s_json_fails("{\"debug.fault_mode\": \"exit\"}",
                 "config.json: unknown option 'debug.fault_mode' (write it nested: \"debug\": "
                 "{\"fault_mode\": ...})");
    s_json_fails("{\"l1_size\": {\"a\": 1}}", "config.json: l1_size: expected a size");
    /* duplicates, also nested, with the position */
    s_json_fails("{\"l1_size\": \"1G\",\n \"l1_size\": \"2G\"}", "config.json:2:");
    s_json_fails("{\"l1_size\": \"1G\",\n \"l1_size\": \"2G\"}", "duplicate object key");
    s_json_fails("{\"debug\": {\"fault_mode\": \"exit\", \"fault_mode\": \"stall\"}}",
                 "duplicate object key");
    /* syntax error: FILE:LINE:COLUMN */
    s_json_fails("{\n  \"l1_size\": 1G\n}", "config.json:2:");
    s_json_fails("{\n  \"l1_size\": 1G\n}", "config.json:2:15: ");
    s_json_fails("", "config.json:");
    s_json_fails("[1, 2]", "config.json: top level must be a JSON object, got [1,2]");
    s_json_fails("42", "config.json:");
    /* wrong types */
    s_json_fails("{\"l1_size\": true}",
                 "config.json: l1_size: expected a size (e.g. 512M, 4G), got true");
    s_json_fails("{\"l1_size\": 1.5}",
                 "config.json: l1_size: expected a size (e.g. 512M, 4G), got 1.5");
    s_json_fails("{\"chunk_tokens\": \"256\"}",
                 "config.json: chunk_tokens: expected an integer, got \"256\"");
    s_json_fails("{\"chunk_tokens\": null}", "chunk_tokens: expected an integer, got null");
    s_json_fails("{\"high_watermark\": \"0.9\"}", "high_watermark: expected a number, got \"0.9\"");
    s_json_fails("{\"allow_unpinned\": 1}", "allow_unpinned: expected true or false, got 1");
    s_json_fails("{\"http\": 8080}", "http: expected a string, got 8080");
    s_json_fails("{\"listen\": [\"ipc:///tmp/a\", 1]}",
                 "listen: expected a string or an array of strings, got [\"ipc:///tmp/a\",1]");
    s_json_fails("{\"run_dir\": \"a\\u0000b\"}", "config.json:1:");
    /* values */
    s_json_fails("{\"l1_size\": -1}", "config.json: l1_size: -1 is out of range [1M, 1T]");
    s_json_fails("{\"l1_size\": 1024}", "config.json: l1_size: 1024 is out of range [1M, 1T]");
    s_json_fails("{\"l1_size\": \"12Q\"}",
                 "config.json: l1_size: '12Q' is not a size (use e.g. 512M, 4G)");
    s_json_fails("{\"chunk_tokens\": 0}",
                 "config.json: chunk_tokens: 0 is out of range [1, 1048576]");
    s_json_fails("{\"chunk_tokens\": 4294967296}", "chunk_tokens: 4294967296 is out of range");
    s_json_fails("{\"high_watermark\": 0}", "high_watermark: 0 is out of range (0, 1]");
    s_json_fails("{\"low_watermark\": 1.25}", "low_watermark: 1.25 is out of range (0, 1]");
    s_json_fails("{\"log_level\": \"loud\"}", "log_level: 'loud' is not one of");
    s_json_fails("{\"l2\": [\"fs:/a\", \"ftp:x\"]}", "l2: 'ftp:x' is not an L2 spec");
    s_json_fails("{\"listen\": [\"ipc:///1\", \"ipc:///2\", \"ipc:///3\", \"ipc:///4\","
                 " \"ipc:///5\", \"ipc:///6\", \"ipc:///7\", \"ipc:///8\", \"ipc:///9\"]}",
                 "config.json: listen: at most 8 endpoints");
    s_json_fails("{\"l2\": [\"none\", \"none\", \"none\", \"none\", \"none\", \"none\","
                 " \"none\", \"none\", \"none\"]}",
                 "config.json: l2: at most 8 adapters");

    /* a NULL origin still names the source */
    char err[KVT_ERR_LEN];
    kvt_config_t *c = kvt_config_new();
    assert_int_equal(kvt_config_apply_json(c, "{\"x_y_z\": 1}", 12, NULL, err, sizeof err),
                     KVT_EINVAL);
    assert_string_equal(err, "config: unknown option 'x_y_z'");
    /* the length is honoured: trailing junk beyond len is not parsed */
    assert_int_equal(kvt_config_apply_json(c, "{}garbage", 2, "x", err, sizeof err), 0);
    kvt_config_destroy(&c);
}

static void test_watermarks(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_set_ok(c, "low_watermark", "0.95");
    s_finish_fails(c, "low_watermark: must be below high_watermark (0.95 >= 0.90)");
    s_set_ok(c, "low_watermark", "0.9");
    s_finish_fails(c, "low_watermark: must be below high_watermark (0.90 >= 0.90)");
    s_set_ok(c, "low_watermark", "0.125");
    s_set_ok(c, "high_watermark", "0.1");
    s_finish_fails(c, "low_watermark: must be below high_watermark (0.125 >= 0.10)");
    s_set_ok(c, "high_watermark", "0.95");
    s_finish_ok(c);
    kvt_config_destroy(&c);
}

static void test_events_need_the_log(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_set_ok(c, "event_log_size", "0");
    s_finish_ok(c); /* no log, no events socket: fine */
    s_set_ok(c, "events", "ipc:///tmp/kvt-events.sock");
    s_finish_fails(c, "events: needs the event log (event_log_size > 0)");
    s_set_ok(c, "event_log_size", "1");
    s_finish_ok(c);
    kvt_config_destroy(&c);
    s_set_fails("event_log_size", "1048577",
                "event_log_size: 1048577 is out of range [0, 1048576]");
}

static void test_loopback_rule(void **state)
{
    (void)state;
    static const char *const ok[] = {"tcp://127.0.0.1:5555", "tcp://[::1]:5555",
                                     "tcp://::1:5555", "tcp://127.0.0.1:*", "ipc:///tmp/x.sock"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        kvt_config_t *c = kvt_config_new();
        s_set_ok(c, "listen", ok[i]);
        s_finish_ok(c);
        kvt_config_destroy(&c);
    }
    /* libzmq cannot bind a host name: refused with a hint, even with allow_insecure_remote */
    kvt_config_t *c = kvt_config_new();
    s_set_ok(c, "listen", "tcp://localhost:5555");
    s_set_ok(c, "allow_insecure_remote", "true");
    s_finish_fails(c, "listen: tcp://localhost:5555: ZeroMQ binds IP addresses, not host names "
                      "(use 127.0.0.1)");
    kvt_config_destroy(&c);

    c = kvt_config_new();
    s_set_ok(c, "listen", "tcp://0.0.0.0:5555");
    s_finish_fails(c, "listen: tcp://0.0.0.0:5555 is not loopback; set allow_insecure_remote "
                      "to allow it, or configure curve.server_cert and curve.clients");
    s_set_ok(c, "listen", "ipc:///tmp/a,tcp://*:5555");
    s_finish_fails(c, "listen: tcp://*:5555 is not loopback; set allow_insecure_remote to "
                      "allow it, or configure curve.server_cert and curve.clients");
    s_set_ok(c, "allow_insecure_remote", "true");
    s_finish_ok(c);
    kvt_config_destroy(&c);

    /* CURVE keys make a non-loopback listen acceptable (not events or HTTP); the two options
     * only come together */
    c = kvt_config_new();
    s_set_ok(c, "listen", "tcp://0.0.0.0:5555");
    s_set_ok(c, "curve.server_cert", "/etc/kvtier/server.cert");
    s_finish_fails(c, "curve.server_cert: must be set together with curve.clients");
    s_set_ok(c, "curve.clients", "/etc/kvtier/clients");
    s_finish_ok(c);
    s_set_ok(c, "events", "tcp://0.0.0.0:5557");
    s_finish_fails(c, "events: tcp://0.0.0.0:5557 is not loopback; set allow_insecure_remote "
                      "to allow it");
    kvt_config_destroy(&c);
    c = kvt_config_new();
    s_set_ok(c, "curve.clients", "/etc/kvtier/clients");
    s_finish_fails(c, "curve.clients: must be set together with curve.server_cert");
    kvt_config_destroy(&c);

    /* curve.require: no plain tcp, loopback included; ipc stays fine */
    c = kvt_config_new();
    s_set_ok(c, "curve.require", "true");
    s_set_ok(c, "listen", "ipc:///tmp/a.sock");
    s_finish_ok(c);
    s_set_ok(c, "listen", "ipc:///tmp/a.sock,tcp://127.0.0.1:5555");
    s_finish_fails(c, "listen: tcp://127.0.0.1:5555 has no CURVE and curve.require is set: "
                      "configure curve.server_cert and curve.clients, or listen on ipc:// only");
    s_set_ok(c, "curve.server_cert", "/etc/kvtier/server.cert");
    s_set_ok(c, "curve.clients", "/etc/kvtier/clients");
    s_finish_ok(c);
    kvt_config_destroy(&c);

    c = kvt_config_new();
    s_set_ok(c, "http", "0.0.0.0:8080");
    s_finish_fails(c, "http: 0.0.0.0:8080 is not loopback; set allow_insecure_remote to allow "
                      "it");
    s_set_ok(c, "http", "127.0.0.1:8080");
    s_set_ok(c, "events", "tcp://10.0.0.1:5557");
    s_finish_fails(c, "events: tcp://10.0.0.1:5557 is not loopback; set allow_insecure_remote "
                      "to allow it");
    s_set_ok(c, "allow_insecure_remote", "1");
    s_finish_ok(c);
    kvt_config_destroy(&c);
}

static void test_l2_none(void **state)
{
    (void)state;
    kvt_config_t *c = kvt_config_new();
    s_json_ok(c, "{\"l2\": [\"none\", \"fs:/x\"]}");
    s_finish_fails(c, "l2: none cannot be combined with other adapters");
    kvt_config_destroy(&c);
    c = kvt_config_new();
    s_json_ok(c, "{\"l2\": \"none\"}");
    s_finish_ok(c);
    assert_int_equal(c->n_l2, 1);
    kvt_config_destroy(&c);
}

static void test_list_flags(void **state)
{
    (void)state;
    char *path = s_tmp_file("{\"l2\": [\"fs:/a\", \"fs:/b\"],"
                            " \"listen\": [\"ipc:///tmp/f.sock\"]}");
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *c;

    /* no flag: the file's lists stand */
    char *argv0[] = {"kvtierd", "--config", path, NULL};
    assert_int_equal(s_load(&c, ARGC(argv0), argv0, &action, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 2);
    assert_string_equal(c->l2[1], "fs:/b");
    kvt_config_destroy(&c);

    /* the first --l2 replaces the file's list */
    char *argv1[] = {"kvtierd", "--config", path, "--l2", "none", NULL};
    assert_int_equal(s_load(&c, ARGC(argv1), argv1, &action, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 1);
    assert_string_equal(c->l2[0], "none");
    assert_int_equal(c->n_listen, 1);
    assert_string_equal(c->listen[0], "ipc:///tmp/f.sock");
    kvt_config_destroy(&c);

    /* later occurrences append; a flag value is one item even with commas */
    char *argv2[] = {"kvtierd",
                     "--listen",
                     "ipc:///tmp/x.sock",
                     "--l2",
                     "mock:latency_ms=5,fail_rate=0.1",
                     "--config",
                     path,
                     "--listen=tcp://127.0.0.1:5555",
                     "--l2",
                     "fs:/c,fs:/d",
                     NULL};
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), 0);
    assert_int_equal(c->n_listen, 2);
    assert_string_equal(c->listen[0], "ipc:///tmp/x.sock");
    assert_string_equal(c->listen[1], "tcp://127.0.0.1:5555");
    assert_int_equal(c->n_l2, 2);
    assert_string_equal(c->l2[0], "mock:latency_ms=5,fail_rate=0.1");
    assert_string_equal(c->l2[1], "fs:/c,fs:/d");
    kvt_config_destroy(&c);

    /* "--l2 none" plus another adapter is refused by finish */
    char *argv3[] = {"kvtierd", "--l2", "none", "--l2", "fs:/x", NULL};
    assert_int_equal(s_load(&c, ARGC(argv3), argv3, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "l2: none cannot be combined with other adapters");
    kvt_config_destroy(&c);

    /* too many */
    char *argv4[20] = {"kvtierd"};
    int n = 1;
    for (int i = 0; i < 9; i++) {
        argv4[n++] = "--listen";
        argv4[n++] = "ipc:///tmp/s";
    }
    argv4[n] = NULL;
    assert_int_equal(s_load(&c, n, argv4, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "listen: at most 8 endpoints");
    kvt_config_destroy(&c);

    /* the environment replaces a list set by flags */
    setenv("KVTIER_L2", "redis:127.0.0.1:6379", 1);
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 1);
    assert_string_equal(c->l2[0], "redis:127.0.0.1:6379");
    kvt_config_destroy(&c);
    s_rm_tmp(&path);
}

static void test_env_lists(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *c = kvt_config_new();
    setenv("KVTIER_LISTEN", " ipc:///tmp/a.sock , tcp://127.0.0.1:5555", 1);
    setenv("KVTIER_L2", "mock:latency_ms=5, fail_rate=0.1,fs:/x,plugin:/lib/p.so", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), 0);
    assert_int_equal(c->n_listen, 2);
    assert_string_equal(c->listen[0], "ipc:///tmp/a.sock");
    assert_string_equal(c->listen[1], "tcp://127.0.0.1:5555");
    assert_int_equal(c->n_l2, 3);
    assert_string_equal(c->l2[0], "mock:latency_ms=5,fail_rate=0.1");
    assert_string_equal(c->l2[1], "fs:/x");
    assert_string_equal(c->l2[2], "plugin:/lib/p.so");
    /* replace, not append */
    setenv("KVTIER_L2", "none", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 1);
    /* empty: back to the derived default */
    setenv("KVTIER_L2", "", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 0);
    s_finish_ok(c);
    assert_string_equal(c->l2[0], "fs:./var/data/l2");
    kvt_config_destroy(&c);

    c = kvt_config_new();
    setenv("KVTIER_L2", "fs:/a,,fs:/b", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "KVTIER_L2: l2: empty item in 'fs:/a,,fs:/b'");
    kvt_config_destroy(&c);

    c = kvt_config_new();
    setenv("KVTIER_L2", "fs:/a,s3:b", 1); /* "s3:b" does not start an item: glued, then valid */
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), 0);
    assert_int_equal(c->n_l2, 1);
    assert_string_equal(c->l2[0], "fs:/a,s3:b");
    setenv("KVTIER_LISTEN",
           "ipc:///1,ipc:///2,ipc:///3,ipc:///4,ipc:///5,ipc:///6,ipc:///7,"
           "ipc:///8,ipc:///9",
           1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "KVTIER_LISTEN: listen: at most 8 endpoints");
    kvt_config_destroy(&c);

    c = kvt_config_new();
    unsetenv("KVTIER_LISTEN");
    setenv("KVTIER_L2", "s3:b,fs:/a", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, "KVTIER_L2: l2: 's3:b' is not an L2 spec"));
    kvt_config_destroy(&c);
}

static void test_env_scalars(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *c = kvt_config_new();
    setenv("KVTIER_CHUNK_TOKENS", "abc", 1);
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "KVTIER_CHUNK_TOKENS: chunk_tokens: 'abc' is not an integer");
    setenv("KVTIER_CHUNK_TOKENS", "64", 1);
    setenv("KVTIER_HTTP", "", 1); /* an empty variable is a value: "" disables HTTP */
    setenv("KVTIER_ALLOW_UNPINNED", "on", 1);
    setenv("KVTIER_DEBUG_FAULT_MODE", "exit", 1);
    setenv("KVTIER_HIGH_WATERMARK", "0.99", 1);
    setenv("kvtier_l1_size", "12Q", 1); /* not ours: only the table's names are read */
    assert_int_equal(kvt_config_apply_env(c, err, sizeof err), 0);
    unsetenv("kvtier_l1_size");
    assert_int_equal(c->chunk_tokens, 64);
    assert_string_equal(c->http, "");
    assert_true(c->allow_unpinned);
    assert_string_equal(c->debug_fault_mode, "exit");
    assert_true(c->high_watermark == 0.99);
    kvt_config_destroy(&c);
}

static void test_precedence(void **state)
{
    (void)state;
    char *path = s_tmp_file("{\"l1_size\": \"2G\", \"chunk_tokens\": 512, \"lease_ms\": 1000}");
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *c;

    char *argv0[] = {"kvtierd", "--config", path, NULL};
    assert_int_equal(s_load(&c, ARGC(argv0), argv0, &action, err, sizeof err), 0);
    assert_string_equal(c->config_file, path); /* what SIGHUP reads again */
    assert_true(c->l1_size == 2ull << 30);
    assert_int_equal(c->chunk_tokens, 512);
    assert_int_equal(c->lease_ms, 1000);
    assert_int_equal(action, KVT_CONFIG_RUN);
    kvt_config_destroy(&c);

    /* flags over the file, wherever --config stands */
    char *argv1[] = {"kvtierd", "--l1-size", "3G", "--config", path, "--chunk-tokens=1024", NULL};
    assert_int_equal(s_load(&c, ARGC(argv1), argv1, &action, err, sizeof err), 0);
    assert_true(c->l1_size == 3ull << 30);
    assert_int_equal(c->chunk_tokens, 1024);
    assert_int_equal(c->lease_ms, 1000);
    kvt_config_destroy(&c);

    char *argv2[] = {"kvtierd", "--chunk-tokens=1024", "--l1-size", "3G", "--config=", NULL};
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "--config needs a value");
    kvt_config_destroy(&c);

    char *argv3[] = {"kvtierd", "--chunk-tokens=1024", "--l1-size", "3G", NULL, NULL};
    char cfg_eq[300];
    snprintf(cfg_eq, sizeof cfg_eq, "--config=%s", path);
    argv3[4] = cfg_eq;
    assert_int_equal(s_load(&c, ARGC(argv3), argv3, &action, err, sizeof err), 0);
    assert_true(c->l1_size == 3ull << 30);
    assert_int_equal(c->chunk_tokens, 1024);
    assert_int_equal(c->lease_ms, 1000);
    kvt_config_destroy(&c);

    /* environment over flags */
    setenv("KVTIER_L1_SIZE", "4G", 1);
    assert_int_equal(s_load(&c, ARGC(argv1), argv1, &action, err, sizeof err), 0);
    assert_true(c->l1_size == 4ull << 30);
    assert_int_equal(c->chunk_tokens, 1024);
    kvt_config_destroy(&c);
    unsetenv("KVTIER_L1_SIZE");

    /* KVTIER_CONFIG names the file when --config is absent, and only then */
    setenv("KVTIER_CONFIG", path, 1);
    char *argv4[] = {"kvtierd", NULL};
    assert_int_equal(s_load(&c, ARGC(argv4), argv4, &action, err, sizeof err), 0);
    assert_true(c->l1_size == 2ull << 30);
    assert_string_equal(c->config_file, path);
    kvt_config_destroy(&c);
    setenv("KVTIER_CONFIG", "/nonexistent/kvtier.json", 1);
    assert_int_equal(s_load(&c, ARGC(argv4), argv4, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "/nonexistent/kvtier.json: cannot open: No such file or directory");
    kvt_config_destroy(&c);
    assert_int_equal(s_load(&c, ARGC(argv0), argv0, &action, err, sizeof err), 0);
    assert_true(c->l1_size == 2ull << 30);
    kvt_config_destroy(&c);
    unsetenv("KVTIER_CONFIG");
    assert_int_equal(s_load(&c, ARGC(argv4), argv4, &action, err, sizeof err), 0);
    assert_null(c->config_file);
    kvt_config_destroy(&c);
    s_rm_tmp(&path);
}

static void test_flag_errors(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *c;
    static const struct {
        char *args[4];
        const char *want;
    } cases[] = {
        {{"--foo"}, "unknown option --foo (see --help)"},
        {{"--foo=1"}, "unknown option --foo (see --help)"},
        {{"--l1-sise", "1G"}, "unknown option --l1-sise (did you mean --l1-size? see --help)"},
        {{"--l1-size"}, "--l1-size needs a value"},
        {{"--l1-size", "--check-config"}, "--l1-size needs a value"},
        {{"--config"}, "--config needs a value"},
        {{"--l1-size", "12Q"}, "l1_size: '12Q' is not a size (use e.g. 512M, 4G)"},
        {{"--l1-size=12Q"}, "l1_size: '12Q' is not a size (use e.g. 512M, 4G)"},
        {{"--chunk-tokens", "0"}, "chunk_tokens: 0 is out of range [1, 1048576]"},
        {{"extra"}, "unexpected argument 'extra' (see --help)"},
        {{"-"}, "unexpected argument '-' (see --help)"},
        {{"--allow-unpinned", "false"}, "unexpected argument 'false' (see --help)"},
        {{"--allow-unpinned=maybe"},
         "allow_unpinned: 'maybe' is not a boolean (use true or false)"},
        {{"--check-config=yes"}, "--check-config takes no value"},
        {{"--config", "a", "--config", "b"}, "--config given twice"},
        {{"--listen", "tcp://0.0.0.0:1"},
         "listen: tcp://0.0.0.0:1 is not loopback; set allow_insecure_remote to allow it, or "
         "configure curve.server_cert and curve.clients"},
        {{"--low-watermark", "0.95"}, "low_watermark: must be below high_watermark (0.95 >= 0.90)"},
        {{"--debug-fault-mode", "boom"}, "debug.fault_mode: 'boom' is not one of stall, exit"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[6] = {"kvtierd"};
        int argc = 1;
        for (int k = 0; k < 4 && cases[i].args[k]; k++)
            argv[argc++] = cases[i].args[k];
        argv[argc] = NULL;
        int rc = s_load(&c, argc, argv, &action, err, sizeof err);
        if (rc != KVT_EINVAL || strcmp(err, cases[i].want) != 0)
            fail_msg("case %zu (%s): rc %d, err '%s', wanted '%s'", i, argv[1], rc, err,
                     cases[i].want);
        kvt_config_destroy(&c);
    }
    /* the config file's errors come through load too, naming the file */
    char *path = s_tmp_file("{\n  \"lease_ms\": 5,\n}");
    char *argv[] = {"kvtierd", "--config", path, NULL};
    assert_int_equal(s_load(&c, ARGC(argv), argv, &action, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, ":3:"));
    kvt_config_destroy(&c);
    s_rm_tmp(&path);
    char *argv2[] = {"kvtierd", "--config", "/", NULL};
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "/: not a regular file (a config file is one)");
    kvt_config_destroy(&c);
}

static void test_flags_ok(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *c;
    char *argv[] = {"kvtierd",
                    "--allow-unpinned",
                    "--http",
                    "",
                    "--events",
                    "ipc:///tmp/ev.sock",
                    "--run-dir",
                    "/tmp/r",
                    "--data-dir=/tmp/d",
                    "--lease-ms",
                    "250",
                    "--high-watermark",
                    "0.7",
                    "--low-watermark=0.6",
                    "--log-level",
                    "warn",
                    "--max-message",
                    "1M",
                    "--max-keys",
                    "10",
                    "--allow-insecure-remote=false",
                    "--debug-fault-thread",
                    "store",
                    "--debug-fault-for-ms",
                    "100",
                    NULL};
    assert_int_equal(s_load(&c, ARGC(argv), argv, &action, err, sizeof err), 0);
    assert_int_equal(action, KVT_CONFIG_RUN);
    assert_true(c->allow_unpinned);
    assert_string_equal(c->http, "");
    assert_string_equal(c->events, "ipc:///tmp/ev.sock");
    assert_string_equal(c->listen[0], "ipc:///tmp/r/kvtier.sock");
    assert_string_equal(c->l2[0], "fs:/tmp/d/l2");
    assert_int_equal(c->lease_ms, 250);
    assert_true(c->high_watermark == 0.7);
    assert_true(c->low_watermark == 0.6);
    assert_string_equal(c->log_level, "warn");
    assert_true(c->max_message == 1ull << 20);
    assert_int_equal(c->max_keys, 10);
    assert_false(c->allow_insecure_remote);
    assert_string_equal(c->debug_fault_thread, "store");
    assert_int_equal(c->debug_fault_for_ms, 100);
    kvt_config_destroy(&c);

    char *argv2[] = {"kvtierd", "--allow-unpinned", "--allow-unpinned=no", NULL};
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), 0);
    assert_false(c->allow_unpinned);
    kvt_config_destroy(&c);

    char *argv3[] = {"kvtierd", NULL};
    assert_int_equal(s_load(&c, 1, argv3, &action, err, sizeof err), 0);
    assert_string_equal(err, "");
    assert_int_equal(c->n_listen, 1);
    kvt_config_destroy(&c);
}

static void test_actions(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *c;
    static const struct {
        char *args[3];
        kvt_config_action_t want;
    } cases[] = {
        {{"--check-config"}, KVT_CONFIG_CHECK},
        {{"--print-config"}, KVT_CONFIG_PRINT},
        {{"--check-config", "--print-config"}, KVT_CONFIG_PRINT},
        {{"--print-config", "--check-config"}, KVT_CONFIG_PRINT},
        {{"--version"}, KVT_CONFIG_VERSION},
        {{"--help"}, KVT_CONFIG_HELP},
        {{"-h"}, KVT_CONFIG_HELP},
        {{"--version", "--help"}, KVT_CONFIG_VERSION},
        /* help and version need no valid config, and win over command-line errors */
        {{"--config", "/nonexistent.json", "--help"}, KVT_CONFIG_HELP},
        {{"--bogus", "--version"}, KVT_CONFIG_VERSION},
        {{"--l1-size", "12Q", "-h"}, KVT_CONFIG_HELP},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[5] = {"kvtierd"};
        int argc = 1;
        for (int k = 0; k < 3 && cases[i].args[k]; k++)
            argv[argc++] = cases[i].args[k];
        argv[argc] = NULL;
        action = (kvt_config_action_t)-1;
        int rc = s_load(&c, argc, argv, &action, err, sizeof err);
        if (rc != 0 || action != cases[i].want)
            fail_msg("case %zu (%s): rc %d action %d err '%s'", i, argv[1], rc, (int)action, err);
        assert_string_equal(err, "");
        kvt_config_destroy(&c);
    }
    /* --check-config still validates */
    char *argv[] = {"kvtierd", "--check-config", "--chunk-tokens", "0", NULL};
    assert_int_equal(s_load(&c, ARGC(argv), argv, &action, err, sizeof err), KVT_EINVAL);
    assert_string_equal(err, "chunk_tokens: 0 is out of range [1, 1048576]");
    kvt_config_destroy(&c);
    char *argv2[] = {"kvtierd", "--print-config", "--config", "/nonexistent.json", NULL};
    assert_int_equal(s_load(&c, ARGC(argv2), argv2, &action, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, "/nonexistent.json: cannot open"));
    kvt_config_destroy(&c);
}

static void test_print_round_trip(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *a = kvt_config_new();
    s_json_ok(a, "{\"listen\": [\"ipc:///tmp/kv.sock\", \"tcp://[::1]:5555\"],"
                 " \"http\": \"127.0.0.1:9999\", \"events\": \"ipc:///tmp/ev\","
                 " \"run_dir\": \"/tmp/r \\\"q\\\"\", \"data_dir\": \"/tmp/d\u00e9\","
                 " \"l1_size\": \"3G\", \"chunk_tokens\": 17, \"lease_ms\": 123456,"
                 " \"high_watermark\": 0.7, \"low_watermark\": 0.30000000000000004,"
                 " \"l2\": [\"mock:latency_ms=1,fail_rate=0.5\", \"fs:/x\"],"
                 " \"log_level\": \"error\", \"max_message\": 12345678, \"max_keys\": 3,"
                 " \"allow_unpinned\": true, \"allow_insecure_remote\": true,"
                 " \"debug\": {\"fault_mode\": \"exit\", \"fault_for_ms\": 7}}");
    s_finish_ok(a);
    char *text = kvt_config_to_json(a);
    assert_non_null(text);
    /* sizes as integers, hidden knobs only when changed, nested */
    assert_non_null(strstr(text, "\"l1_size\": 3221225472"));
    assert_non_null(strstr(text, "\"debug\": {"));
    assert_non_null(strstr(text, "\"fault_mode\": \"exit\""));
    assert_non_null(strstr(text, "\"fault_for_ms\": 7"));
    assert_null(strstr(text, "fault_thread"));
    assert_null(strstr(text, "fault_after_ms"));
    /* table order */
    assert_true(strstr(text, "\"listen\"") < strstr(text, "\"http\""));
    assert_true(strstr(text, "\"http\"") < strstr(text, "\"l1_size\""));
    assert_true(strstr(text, "\"allow_insecure_remote\"") < strstr(text, "\"debug\""));

    kvt_config_t *b = kvt_config_new();
    if (kvt_config_apply_json(b, text, strlen(text), "printed", err, sizeof err) != 0)
        fail_msg("printed config does not load: %s\n%s", err, text);
    s_finish_ok(b);
    char *text2 = kvt_config_to_json(b);
    assert_string_equal(text, text2);

    assert_int_equal(a->n_listen, b->n_listen);
    for (int i = 0; i < a->n_listen; i++)
        assert_string_equal(a->listen[i], b->listen[i]);
    assert_int_equal(a->n_l2, b->n_l2);
    for (int i = 0; i < a->n_l2; i++)
        assert_string_equal(a->l2[i], b->l2[i]);
    assert_string_equal(a->http, b->http);
    assert_string_equal(a->events, b->events);
    assert_string_equal(a->run_dir, b->run_dir);
    assert_string_equal(a->data_dir, b->data_dir);
    assert_true(a->l1_size == b->l1_size);
    assert_int_equal(a->chunk_tokens, b->chunk_tokens);
    assert_int_equal(a->lease_ms, b->lease_ms);
    assert_true(a->high_watermark == b->high_watermark);
    assert_true(a->low_watermark == b->low_watermark); /* needed 17 digits */
    assert_string_equal(a->log_level, b->log_level);
    assert_true(a->max_message == b->max_message);
    assert_int_equal(a->max_keys, b->max_keys);
    assert_true(a->allow_unpinned == b->allow_unpinned);
    assert_true(a->allow_insecure_remote == b->allow_insecure_remote);
    assert_string_equal(a->debug_fault_thread, b->debug_fault_thread);
    assert_string_equal(a->debug_fault_mode, b->debug_fault_mode);
    assert_int_equal(a->debug_fault_after_ms, b->debug_fault_after_ms);
    assert_int_equal(a->debug_fault_for_ms, b->debug_fault_for_ms);
    free(text);
    free(text2);
    kvt_config_destroy(&a);
    kvt_config_destroy(&b);

    /* defaults: no debug group at all, and the derived lists are printed */
    a = kvt_config_new();
    s_finish_ok(a);
    text = kvt_config_to_json(a);
    assert_null(strstr(text, "debug"));
    assert_non_null(strstr(text, "\"ipc://./var/run/kvtier.sock\""));
    assert_non_null(strstr(text, "\"high_watermark\": 0.9,"));
    assert_non_null(strstr(text, "\"allow_unpinned\": false"));
    assert_int_equal(text[0], '{');
    assert_int_equal(text[1], '\n');
    assert_int_equal(text[2], ' ');
    assert_int_equal(text[3], ' ');
    assert_int_equal(text[4], '"');
    b = kvt_config_new();
    if (kvt_config_apply_json(b, text, strlen(text), "printed", err, sizeof err) != 0)
        fail_msg("printed defaults do not load: %s", err);
    s_finish_ok(b);
    text2 = kvt_config_to_json(b);
    assert_string_equal(text, text2);
    free(text);
    free(text2);
    kvt_config_destroy(&a);
    kvt_config_destroy(&b);
}

static void test_usage(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    kvt_config_usage(f);
    fclose(f);
    static const char *const want[] = {
        "--config FILE",
        "KVTIER_CONFIG",
        "--check-config",
        "--print-config",
        "--version",
        "-h, --help",
        "--listen ENDPOINT",
        "KVTIER_LISTEN",
        "ipc://RUN_DIR/kvtier.sock",
        "--l1-size SIZE",
        "KVTIER_L1_SIZE",
        "default 1G",
        "--l2 SPEC",
        "fs:DATA_DIR/l2",
        "--allow-unpinned[=BOOL]",
        "--http ADDR:PORT",
        "default 127.0.0.1:8080",
        "--max-message SIZE",
        "--low-watermark F",
        "default 0.80",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(buf, want[i]))
            fail_msg("usage lacks '%s':\n%s", want[i], buf);
    assert_null(strstr(buf, "--debug"));
    assert_null(strstr(buf, "fault-"));
    assert_null(strstr(buf, "KVTIER_DEBUG"));

    /* every flag in --help is documented in docs/configuration.md (when run from the repo) */
    FILE *doc = fopen("docs/configuration.md", "r");
    if (doc) {
        char *docs = NULL;
        size_t dlen = 0;
        FILE *m = open_memstream(&docs, &dlen);
        char chunk[4096];
        size_t n;
        while ((n = fread(chunk, 1, sizeof chunk, doc)) > 0)
            fwrite(chunk, 1, n, m);
        fclose(m);
        fclose(doc);
        for (char *line = buf; line && *line;) {
            char *nl = strchr(line, '\n');
            if (strncmp(line, "  --", 4) == 0) {
                size_t fl = strcspn(line + 2, " [=");
                char flag[64];
                snprintf(flag, sizeof flag, "%.*s", (int)fl, line + 2);
                if (!strstr(docs, flag))
                    fail_msg("docs/configuration.md does not mention %s", flag);
            }
            line = nl ? nl + 1 : NULL;
        }
        static const char *const hidden[] = {"--debug-fault-thread", "--debug-fault-mode",
                                             "--debug-fault-after-ms", "--debug-fault-for-ms",
                                             "--debug-fail-alloc-every"};
        for (size_t i = 0; i < sizeof hidden / sizeof hidden[0]; i++)
            if (!strstr(docs, hidden[i]))
                fail_msg("docs/configuration.md does not mention %s", hidden[i]);
        free(docs);
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_defaults, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_derived_from_dirs, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_parse_size, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_set_values, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_set_errors, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_json_values, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_json_errors, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_watermarks, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_events_need_the_log, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_loopback_rule, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_l2_none, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_list_flags, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_env_lists, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_env_scalars, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_precedence, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_flag_errors, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_flags_ok, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_actions, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_print_round_trip, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_usage, s_setup, s_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
