/* Unit tests of l2/kvt_l2_plugin: the example plugin (path in KVT_L2_EXAMPLE_PLUGIN; the test is
 * skipped when it is unset) loads and refuses a bad spec (its contract, and its ABI 1 build's,
 * through the loader, is test_l2_conformance.c); a missing file, a shared object without the
 * symbol (libm) and an empty path fail with KVT_EINVAL and a reason; kvt_l2_plugin_check refuses
 * an ABI out of range, a bad kind, max_threads 0 and each missing operation of the table's ABI,
 * and accepts a table without usage, and an ABI 2 one without store and load. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_l2_plugin.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

/* The example's own spec: a capacity that is not a number is refused. (Its contract, ABI 2 and
 * ABI 1 builds alike, is tests/unit/test_l2_conformance.c.) */
static void test_example_bad_spec(void **state)
{
    (void)state;
    const char *path = getenv("KVT_L2_EXAMPLE_PLUGIN");
    if (!path || !*path) {
        print_message("KVT_L2_EXAMPLE_PLUGIN is not set: skipped\n");
        skip();
    }
    const kvt_l2_ops_t *ops = NULL;
    void *h = NULL, *st = NULL;
    char err[512] = "";
    int rc = kvt_l2_plugin_load(path, &ops, &h, err, sizeof err);
    if (rc)
        fail_msg("load %s: %s", path, err);
    assert_string_equal(ops->kind, "example-mem");
    assert_int_equal(ops->open("capacity=x", &st, err, sizeof err), KVT_EINVAL);
    assert_null(st);
    assert_true(strlen(err) > 0);
    kvt_l2_plugin_unload(h);
}

static void test_missing_file(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = (const kvt_l2_ops_t *)1;
    void *h = (void *)1;
    char err[512] = "";
    assert_int_equal(
        kvt_l2_plugin_load("/nonexistent/kvtier-l2-nothing.so", &ops, &h, err, sizeof err),
        KVT_EINVAL);
    assert_null(ops);
    assert_null(h);
    print_message("missing file: %s\n", err);
    assert_non_null(strstr(err, "/nonexistent/kvtier-l2-nothing.so"));
    assert_non_null(strstr(err, "No such file"));

    err[0] = '\0';
    assert_int_equal(kvt_l2_plugin_load("", &ops, &h, err, sizeof err), KVT_EINVAL);
    assert_true(strlen(err) > 0);
    kvt_l2_plugin_unload(NULL);
}

static void test_no_symbol(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = NULL;
    void *h = NULL;
    char err[512] = "";
    /* libm is always there and exports no kvt_l2_plugin_v1 */
    assert_int_equal(kvt_l2_plugin_load("libm.so.6", &ops, &h, err, sizeof err), KVT_EINVAL);
    assert_null(ops);
    assert_null(h);
    print_message("no symbol: %s\n", err);
    assert_non_null(strstr(err, KVT_L2_PLUGIN_SYMBOL));
}

static int s_open(const char *args, void **state, char *err, size_t errlen)
{
    (void)args;
    (void)err;
    (void)errlen;
    *state = NULL;
    return 0;
}

static void s_close(void *state)
{
    (void)state;
}

static int s_store(void *state, const char *name, const void *data, size_t len)
{
    (void)state, (void)name, (void)data, (void)len;
    return 0;
}

static int s_lookup(void *state, const char *name, size_t *len)
{
    (void)state, (void)name, (void)len;
    return KVT_ENOTFOUND;
}

static int s_load(void *state, const char *name, void *buf, size_t cap, size_t *len)
{
    (void)state, (void)name, (void)buf, (void)cap, (void)len;
    return KVT_ENOTFOUND;
}

static int s_remove(void *state, const char *name)
{
    (void)state, (void)name;
    return KVT_ENOTFOUND;
}

static int s_health(void *state, char *why, size_t whylen)
{
    (void)state, (void)why, (void)whylen;
    return 0;
}

static int s_storev(void *state, const char *name, const struct iovec *iov, int n)
{
    (void)state, (void)name, (void)iov, (void)n;
    return 0;
}

static int s_loadv(void *state, const char *name, const struct iovec *iov, int n, size_t *len)
{
    (void)state, (void)name, (void)iov, (void)n, (void)len;
    return KVT_ENOTFOUND;
}

static const kvt_l2_ops_t s_good = {
    .abi = KVT_L2_ABI,
    .kind = "test-good_1.0",
    .max_threads = 1,
    .open = s_open,
    .close = s_close,
    .store = s_store,
    .lookup = s_lookup,
    .load = s_load,
    .remove = s_remove,
    .health = s_health,
    .usage = NULL,
    .storev = s_storev,
    .loadv = s_loadv,
};

static void s_expect_bad(const kvt_l2_ops_t *t, const char *needle)
{
    char err[256] = "";
    assert_int_equal(kvt_l2_plugin_check(t, err, sizeof err), KVT_EINVAL);
    if (!strstr(err, needle))
        fail_msg("\"%s\" does not say \"%s\"", err, needle);
}

static void test_check(void **state)
{
    (void)state;
    char err[256] = "";
    assert_int_equal(kvt_l2_plugin_check(&s_good, err, sizeof err), 0);
    s_expect_bad(NULL, "NULL");

    kvt_l2_ops_t t = s_good;
    t.abi = KVT_L2_ABI + 1;
    s_expect_bad(&t, "ABI");
    t.abi = 0;
    s_expect_bad(&t, "ABI");
    /* ABI 2: store and load are optional */
    t = s_good;
    t.store = NULL;
    t.load = NULL;
    assert_int_equal(kvt_l2_plugin_check(&t, err, sizeof err), 0);
    /* ABI 1: storev and loadv are never looked at (an ABI 1 table ends before them) */
    t = s_good;
    t.abi = 1;
    t.storev = NULL;
    t.loadv = NULL;
    assert_int_equal(kvt_l2_plugin_check(&t, err, sizeof err), 0);
    t.store = NULL;
    s_expect_bad(&t, "store");
    t = s_good;
    t.abi = 1;
    t.load = NULL;
    s_expect_bad(&t, "load");

    static const char *const kinds[] = {NULL,        "",    "has space",
                                        "new\nline", "a/b", "0123456789012345678901234567890123"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        t = s_good;
        t.kind = kinds[i];
        s_expect_bad(&t, "kind");
    }
    t = s_good;
    t.max_threads = 0;
    s_expect_bad(&t, "max_threads");

    static const struct {
        size_t off;
        const char *name;
    } ops[] = {
        {offsetof(kvt_l2_ops_t, open), "open"},     {offsetof(kvt_l2_ops_t, close), "close"},
        {offsetof(kvt_l2_ops_t, lookup), "lookup"}, {offsetof(kvt_l2_ops_t, remove), "remove"},
        {offsetof(kvt_l2_ops_t, health), "health"}, {offsetof(kvt_l2_ops_t, storev), "storev"},
        {offsetof(kvt_l2_ops_t, loadv), "loadv"},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        t = s_good;
        void (*null_fn)(void) = NULL;
        memcpy((char *)&t + ops[i].off, &null_fn, sizeof null_fn);
        s_expect_bad(&t, ops[i].name);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_example_bad_spec), cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_no_symbol),        cmocka_unit_test(test_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
