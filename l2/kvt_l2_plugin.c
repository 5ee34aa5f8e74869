/* DESIGN: the plugin loader — dlopen, one dlsym, and a check of the table before anything in
 * it is called. RTLD_NOW makes a plugin with unresolved symbols fail here, at start-up, rather
 * than at its first call on an adapter thread; RTLD_LOCAL keeps its symbols from satisfying
 * (or clashing with) another plugin's. No global state: dlerror() is per thread in glibc, and
 * each failure path takes its text right after the failing call.
 *
 * The handle owns a copy of the plugin's table, made as long as this daemon's kvt_l2_ops_t:
 * an ABI 1 table ends before the ABI 2 fields and an ABI 2 table before flush (ABI 3), so only
 * the part its ABI has is copied and the rest stays NULL — the daemon then never reads past the
 * plugin's table, and tells an ABI 1 adapter by its NULL storev. */
#include "kvt_l2_plugin.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_KIND_MAX 32

/* The size of an ABI 1 table: everything before the first ABI 2 field. */
#define S_ABI1_SIZE offsetof(kvt_l2_ops_t, storev)
/* ... and of an ABI 2 table: everything before flush. */
#define S_ABI2_SIZE offsetof(kvt_l2_ops_t, flush)

typedef struct {
    void *dl;
    kvt_l2_ops_t ops;
} s_plugin_t;

static const char *s_dlerror(void)
{
    const char *e = dlerror();
    return e ? e : "unknown error";
}

int kvt_l2_plugin_check(const kvt_l2_ops_t *ops, char *err, size_t errlen)
{
    if (!ops) {
        snprintf(err, errlen, "no adapter table (the plugin function returned NULL)");
        return KVT_EINVAL;
    }
    if (ops->abi < KVT_L2_ABI_MIN || ops->abi > KVT_L2_ABI) {
        snprintf(err, errlen, "ABI %u, this daemon loads ABI %u to %u", (unsigned)ops->abi,
                 (unsigned)KVT_L2_ABI_MIN, (unsigned)KVT_L2_ABI);
        return KVT_EINVAL;
    }
    size_t n = ops->kind ? strnlen(ops->kind, S_KIND_MAX + 1) : 0;
    if (n == 0 || n > S_KIND_MAX ||
        strspn(ops->kind, "abcdefghijklmnopqrstuvwxyz"
                          "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                          "0123456789_.-") != n) {
        snprintf(err, errlen, "bad kind (want 1..%d characters of [A-Za-z0-9_.-])", S_KIND_MAX);
        return KVT_EINVAL;
    }
    if (ops->max_threads < 1) {
        snprintf(err, errlen, "%s: max_threads is 0", ops->kind);
        return KVT_EINVAL;
    }
    bool v1 = ops->abi == 1; /* ABI 2 fields must not be read: the table may end before them */
    const char *missing = !ops->open          ? "open"
                          : !ops->close       ? "close"
                          : v1 && !ops->store ? "store"
                          : !ops->lookup      ? "lookup"
                          : v1 && !ops->load  ? "load"
                          : !ops->remove      ? "remove"
                          : !ops->health      ? "health"
                          : v1                ? NULL
                          : !ops->storev      ? "storev"
                          : !ops->loadv       ? "loadv"
                                              : NULL;
    if (missing) {
        snprintf(err, errlen, "%s: no %s operation", ops->kind, missing);
        return KVT_EINVAL;
    }
    return 0;
}

int kvt_l2_plugin_load(const char *path, const kvt_l2_ops_t **ops, void **handle, char *err,
                       size_t errlen)
{
    *ops = NULL;
    *handle = NULL;
    if (!path || !*path) {
        snprintf(err, errlen, "plugin: no path");
        return KVT_EINVAL;
    }
    (void)dlerror(); /* forget an error left by someone else */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "plugin: %s", s_dlerror()); /* the text names the file */
        return KVT_EINVAL;
    }
    /* dlsym's NULL may be a legitimate value, so dlerror() decides (dlsym(3)). */
    (void)dlerror();
    void *sym = dlsym(h, KVT_L2_PLUGIN_SYMBOL);
    const char *e = dlerror();
    if (e || !sym) {
        if (e) /* names the file and the symbol */
            snprintf(err, errlen, "plugin: %s", e);
        else
            snprintf(err, errlen, "plugin %s: %s is NULL", path, KVT_L2_PLUGIN_SYMBOL);
        goto fail;
    }
    /* ISO C has no object-to-function pointer conversion; POSIX guarantees it for dlsym. */
    kvt_l2_plugin_fn fn;
    memcpy(&fn, &sym, sizeof fn);
    const kvt_l2_ops_t *t = fn();
    char why[256];
    if (kvt_l2_plugin_check(t, why, sizeof why) != 0) {
        snprintf(err, errlen, "plugin %s: %s", path, why);
        goto fail;
    }
    s_plugin_t *p = calloc(1, sizeof *p);
    kvt_assert(p);
    p->dl = h;
    memcpy(&p->ops, t, t->abi == 1 ? S_ABI1_SIZE : t->abi == 2 ? S_ABI2_SIZE : sizeof p->ops);
    *ops = &p->ops;
    *handle = p;
    return 0;
fail:
    dlclose(h);
    return KVT_EINVAL;
}

void kvt_l2_plugin_unload(void *handle)
{
    s_plugin_t *p = handle;
    if (p) {
        dlclose(p->dl);
        free(p);
    }
}
