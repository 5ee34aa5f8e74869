/* DESIGN: the plugin loader — dlopen, one dlsym, and a check of the table before anything in
 * it is called. RTLD_NOW makes a plugin with unresolved symbols fail here, at start-up, rather
 * than at its first call on an adapter thread; RTLD_LOCAL keeps its symbols from satisfying
 * (or clashing with) another plugin's. No state: dlerror() is per thread in glibc, and each
 * failure path takes its text right after the failing call. */
#include "kvt_l2_plugin.h"

#include "kvt_error.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define S_KIND_MAX 32

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
    if (ops->abi != KVT_L2_ABI) {
        snprintf(err, errlen, "ABI %u, this daemon speaks ABI %u", (unsigned)ops->abi,
                 (unsigned)KVT_L2_ABI);
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
    const char *missing = !ops->open     ? "open"
                          : !ops->close  ? "close"
                          : !ops->store  ? "store"
                          : !ops->lookup ? "lookup"
                          : !ops->load   ? "load"
                          : !ops->remove ? "remove"
                          : !ops->health ? "health"
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
    *ops = t;
    *handle = h;
    return 0;
fail:
    dlclose(h);
    return KVT_EINVAL;
}

void kvt_l2_plugin_unload(void *handle)
{
    if (handle)
        dlclose(handle);
}
