/* DESIGN: static tables generated from KVT_ERRNO_MAP; no state, callable from any thread. */
#include "kvt_error.h"

#include <stdbool.h>
#include <string.h>

typedef struct {
    int num;
    const char *name;
    const char *wire;
    const char *msg;
} s_err_row_t;

static const s_err_row_t s_rows[] = {
#define KVT_XX(name, num, wire, msg) {num, #name, wire, msg},
    KVT_ERRNO_MAP(KVT_XX)
#undef KVT_XX
};

#define S_NROWS (int)(sizeof s_rows / sizeof s_rows[0])

static const s_err_row_t *s_find(int code)
{
    if (code < 0 && -code <= S_NROWS)
        return &s_rows[-code - 1];
    return NULL;
}

const char *kvt_strerror(int code)
{
    const s_err_row_t *r = s_find(code);
    return code == 0 ? "success" : r ? r->msg : "unknown error";
}

const char *kvt_err_name(int code)
{
    const s_err_row_t *r = s_find(code);
    return code == 0 ? "OK" : r ? r->name : "UNKNOWN";
}

const char *kvt_err_wire(int code)
{
    const s_err_row_t *r = s_find(code);
    return r ? r->wire : "internal";
}

/* Index of the first row whose wire string is `wire` among the rows that introduce a wire
 * string (so "internal" of NOMEM counts as the INTERNAL row's); -1 when none. */
static int s_wire_first(const char *wire, size_t len, int *row)
{
    int distinct = 0;
    for (int i = 0; i < S_NROWS; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = strcmp(s_rows[j].wire, s_rows[i].wire) == 0;
        if (seen)
            continue;
        if (strlen(s_rows[i].wire) == len && memcmp(s_rows[i].wire, wire, len) == 0) {
            *row = i;
            return distinct;
        }
        distinct++;
    }
    return -1;
}

int kvt_err_wire_index(int code)
{
    const char *w = kvt_err_wire(code);
    int row;
    int i = s_wire_first(w, strlen(w), &row);
    return i >= 0 ? i : kvt_err_wire_index(KVT_EINTERNAL);
}

const char *kvt_err_wire_name(int i)
{
    int distinct = 0;
    for (int r = 0; r < S_NROWS; r++) {
        int row;
        if (s_wire_first(s_rows[r].wire, strlen(s_rows[r].wire), &row) != distinct || row != r)
            continue;
        if (distinct++ == i)
            return s_rows[r].wire;
    }
    return "internal";
}

int kvt_err_from_wire(const char *wire, size_t len)
{
    int row;
    return s_wire_first(wire, len, &row) >= 0 ? s_rows[row].num : KVT_EINTERNAL;
}
