/* libkvtier's request types and error codes against the daemon's tables, every row both ways:
 * each row of KVT_ERRNO_MAP has its KVTIER_E* code in client/kvtier.h with the same number
 * (compiled from the table: a row without one does not compile), kvtier_error_code gives the
 * row's wire code and kvtier_strerror its sentence, and kvt_err_from_wire takes the wire code
 * back to the first row of that code; back the other way, every KVTIER_E* that kvtier.h
 * defines (read from the header's text, with the wire code its comment names) is a row with
 * that number and code, and numbers past the table are unknown ("internal"). Every
 * KVT_REQ_MAP row is what kvt_proto_info/kvt_proto_name answer for its id (the numbers
 * libkvtier sends), the ids are 1..KVT_REQ_SLOTS-1 without a gap, and every KVT_REQ_* that
 * libkvtier's files (client/kvtier*.c) name is a row. The Python client's side: tests/integration/
 * test_client_tables.py. Run from the repository root (make unit does). */
#include "kvt_error.h"
#include "kvt_proto.h"
#include "kvtier.h"

#include <ctype.h>
#include <regex.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

typedef struct {
    const char *name; /* "NOSPC" */
    int kvt, kvtier;
    const char *wire, *msg;
} s_err_row_t;

static const s_err_row_t s_errs[] = {
#define XX(name, num, wire, msg) {#name, num, KVTIER_E##name, wire, msg},
    KVT_ERRNO_MAP(XX)
#undef XX
};
#define S_NERR (sizeof s_errs / sizeof s_errs[0])

typedef struct {
    uint64_t id;
    const char *name; /* "PREFETCH_STATUS" */
    const char *wire; /* "prefetch_status" */
} s_req_row_t;

static const s_req_row_t s_reqs[] = {
#define XX(id, NAME, name, cls, req, opt, max) {id, #NAME, name},
    KVT_REQ_MAP(XX)
#undef XX
};
#define S_NREQ (sizeof s_reqs / sizeof s_reqs[0])

static char *s_slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        fail_msg("cannot open %s (run from the repository root)", path);
    char *buf = calloc(1, 1 << 20);
    assert_non_null(buf);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    fclose(f);
    assert_true(n > 0);
    return buf;
}

static const s_err_row_t *s_err_row(const char *name)
{
    for (size_t i = 0; i < S_NERR; i++)
        if (strcmp(s_errs[i].name, name) == 0)
            return &s_errs[i];
    return NULL;
}

static void test_error_rows_to_libkvtier(void **state)
{
    (void)state;
    assert_true(S_NERR >= 16);
    for (size_t i = 0; i < S_NERR; i++) {
        const s_err_row_t *r = &s_errs[i];
        if (r->kvtier != r->kvt)
            fail_msg("KVTIER_E%s = %d, KVT_ERRNO_MAP says %d", r->name, r->kvtier, r->kvt);
        assert_string_equal(kvtier_error_code(r->kvtier), r->wire);
        assert_string_equal(kvtier_strerror(r->kvtier), r->msg);
        assert_string_equal(kvt_err_name(r->kvt), r->name);
        /* the wire code back: the first row that has it, whose wire code it is */
        int back = kvt_err_from_wire(r->wire, strlen(r->wire));
        size_t first = 0;
        while (strcmp(s_errs[first].wire, r->wire) != 0)
            first++;
        assert_int_equal(back, s_errs[first].kvt);
        assert_string_equal(kvtier_error_code(back), r->wire);
    }
    /* numbers are -1..-N without a gap or a repeat */
    for (size_t i = 0; i < S_NERR; i++)
        assert_int_equal(s_errs[i].kvt, -(int)(i + 1));
    assert_string_equal(kvtier_error_code(0), "ok");
    assert_string_equal(kvtier_error_code(-(int)S_NERR - 1), "internal");
    assert_int_equal(kvt_err_from_wire("no_such_code", 12), KVT_EINTERNAL);
}

/* Every `#define KVTIER_E<NAME> (<num>)` of kvtier.h, with the "wire" code its comment names
 * when it names one, is the row NAME. */
static void test_libkvtier_codes_to_rows(void **state)
{
    (void)state;
    char *text = s_slurp("client/kvtier.h");
    regex_t re;
    assert_int_equal(regcomp(&re,
                             "#define KVTIER_E([A-Z]+) \\((-?[0-9]+)\\)[ \t]*"
                             "(/\\*[ \t]*\"([a-z_]+)\")?",
                             REG_EXTENDED),
                     0);
    size_t found = 0, with_wire = 0;
    regmatch_t m[5];
    for (const char *p = text; regexec(&re, p, 5, m, 0) == 0; p += m[0].rm_eo) {
        char name[32] = "", wire[64] = "";
        snprintf(name, sizeof name, "%.*s", (int)(m[1].rm_eo - m[1].rm_so), p + m[1].rm_so);
        int num = atoi(p + m[2].rm_so);
        const s_err_row_t *r = s_err_row(name);
        if (!r)
            fail_msg("kvtier.h defines KVTIER_E%s (%d): no such row in KVT_ERRNO_MAP", name, num);
        if (num != r->kvt)
            fail_msg("kvtier.h: KVTIER_E%s is %d, KVT_ERRNO_MAP says %d", name, num, r->kvt);
        if (m[4].rm_so >= 0) {
            snprintf(wire, sizeof wire, "%.*s", (int)(m[4].rm_eo - m[4].rm_so), p + m[4].rm_so);
            if (strcmp(wire, r->wire) != 0)
                fail_msg("kvtier.h: KVTIER_E%s says \"%s\", KVT_ERRNO_MAP \"%s\"", name, wire,
                         r->wire);
            with_wire++;
        }
        found++;
    }
    regfree(&re);
    free(text);
    if (found != S_NERR)
        fail_msg("kvtier.h defines %zu KVTIER_E* codes, KVT_ERRNO_MAP has %zu rows", found, S_NERR);
    assert_true(with_wire >= 10); /* the parse of the comments works */
}

static void test_request_rows(void **state)
{
    (void)state;
    assert_true(S_NREQ >= 19);
    assert_int_equal(S_NREQ, KVT_REQ_SLOTS - 1);
    for (size_t i = 0; i < S_NREQ; i++) {
        const s_req_row_t *r = &s_reqs[i];
        assert_int_equal(r->id, i + 1); /* 1..N, in order, no gap */
        const kvt_req_info_t *info = kvt_proto_info(r->id);
        assert_non_null(info);
        assert_int_equal(info->type, r->id);
        assert_string_equal(info->name, r->wire);
        assert_string_equal(kvt_proto_name(r->id), r->wire);
        char lower[64];
        size_t k = 0;
        for (; r->name[k] && k < sizeof lower - 1; k++)
            lower[k] = (char)tolower((unsigned char)r->name[k]);
        lower[k] = '\0';
        assert_string_equal(lower, r->wire);
    }
    assert_null(kvt_proto_info(0));
    assert_null(kvt_proto_info(KVT_REQ_SLOTS));
}

/* The request types libkvtier sends are rows (it names them KVT_REQ_<NAME>, in any of its
 * files). */
static void test_libkvtier_requests_are_rows(void **state)
{
    (void)state;
    static const char *const files[] = {"client/kvtier.c", "client/kvtier_wire.c",
                                        "client/kvtier_conn.c", "client/kvtier_hb.c"};
    size_t len = 0;
    char *text = NULL;
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        char *part = s_slurp(files[f]);
        size_t n = strlen(part);
        char *grown = realloc(text, len + n + 2);
        assert_non_null(grown);
        text = grown;
        memcpy(text + len, part, n);
        text[len + n] = '\n';
        len += n + 1;
        text[len] = '\0';
        free(part);
    }
    regex_t re;
    assert_int_equal(regcomp(&re, "KVT_REQ_([A-Z_]+)", REG_EXTENDED), 0);
    regmatch_t m[2];
    size_t uses = 0;
    for (const char *p = text; regexec(&re, p, 2, m, 0) == 0; p += m[0].rm_eo) {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)(m[1].rm_eo - m[1].rm_so), p + m[1].rm_so);
        if (strcmp(name, "MAP") == 0 || strcmp(name, "SLOTS") == 0 || strcmp(name, "UNKNOWN") == 0)
            continue;
        bool row = false;
        for (size_t i = 0; i < S_NREQ && !row; i++)
            row = strcmp(s_reqs[i].name, name) == 0;
        if (!row)
            fail_msg("libkvtier sends KVT_REQ_%s: no such row in KVT_REQ_MAP", name);
        uses++;
    }
    regfree(&re);
    free(text);
    assert_true(uses >= 19);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_rows_to_libkvtier),
        cmocka_unit_test(test_libkvtier_codes_to_rows),
        cmocka_unit_test(test_request_rows),
        cmocka_unit_test(test_libkvtier_requests_are_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
