/* kvt_l2_name: the object name every L2 adapter stores (ns, salt, key) under — the daemon's
 * side of the naming scheme that l2/kvt_l2.h documents for adapters. Not part of the plugin
 * ABI (plugins are handed names, they never make them). Pure function; any thread. */
#ifndef KVT_L2_NAME_H
#define KVT_L2_NAME_H

#include "kvt_key.h"
#include "kvt_l2.h"

/* The name of (ns, key): hex(XXH3_128(le32(name_len) || name || salt)) '-' hex(key). */
void kvt_l2_name(const kvt_ns_t *ns, const kvt_key_t *key, char out[KVT_L2_NAME_LEN]);

#endif
