/* DESIGN: static tables generated from KVT_ERRNO_MAP; no state, callable from any thread. */
#include "kvt_error.h"

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

int kvt_err_wire_index(int code)
{
    const char *w = kvt_err_wire(code);
    for (int i = 0; i < KVT_WIRE_ERRORS; i++)
        if (strcmp(s_rows[i].wire, w) == 0)
            return i;
    return -KVT_EINTERNAL - 1;
}

const char *kvt_err_wire_name(int i)
{
    return (i >= 0 && i < KVT_WIRE_ERRORS) ? s_rows[i].wire : "internal";
}

int kvt_err_from_wire(const char *wire, size_t len)
{
    for (int i = 0; i < KVT_WIRE_ERRORS; i++)
        if (strlen(s_rows[i].wire) == len && memcmp(s_rows[i].wire, wire, len) == 0)
            return s_rows[i].num;
    return KVT_EINTERNAL;
}
