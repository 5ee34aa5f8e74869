/* kvt_l2_plugin: loads a third-party L2 adapter from a shared object (spec "plugin:PATH.so").
 *
 * The object exports `const kvt_l2_ops_t *kvt_l2_plugin_v1(void)` (KVT_L2_PLUGIN_SYMBOL in
 * kvt_l2.h) returning a table that lives as long as the object is loaded. The loader checks the
 * ABI version, the kind and every required operation before the daemon calls any of them, and
 * hands out its own copy of the table (an ABI 1 one with the ABI 2 fields NULL). Not
 * thread-safe with respect to one handle: load and unload at start-up and shutdown. */
#ifndef KVT_L2_PLUGIN_H
#define KVT_L2_PLUGIN_H

#include "kvt_l2.h"

#include <stddef.h>

/* Loads PATH with dlopen(RTLD_NOW | RTLD_LOCAL) (a name without '/' is searched like dlopen
 * does), finds KVT_L2_PLUGIN_SYMBOL and checks its table. Returns 0 with *ops (the handle's copy
 * of the table) and *handle, or KVT_EINVAL with one line in err (the dlerror text where there
 * is one); nothing stays loaded on failure. *ops is valid until kvt_l2_plugin_unload(*handle). */
int kvt_l2_plugin_load(const char *path, const kvt_l2_ops_t **ops, void **handle, char *err,
                       size_t errlen);

/* Unloads a handle of kvt_l2_plugin_load (NULL is fine). Every state opened through its ops
 * must be closed first: the code of the plugin goes away. */
void kvt_l2_plugin_unload(void *handle);

/* Checks a table as the loader does: KVT_L2_ABI_MIN <= abi <= KVT_L2_ABI, a kind of 1..32
 * characters among [A-Za-z0-9_.-] (it names metrics and log lines), max_threads >= 1, and every
 * operation of its ABI set: ABI 1 all but usage; ABI 2 also storev and loadv, while store and
 * load become optional. Fields past an ABI 1 table are never read. 0, or KVT_EINVAL with one
 * line in err. */
int kvt_l2_plugin_check(const kvt_l2_ops_t *ops, char *err, size_t errlen);

#endif
