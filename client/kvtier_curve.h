/* kvtier_curve (internal to libkvtier): CURVE client set-up and zcert-format certificate files.
 * Shared by kvtier.c (connect) and kvtier_curve.c; any thread, no state. */
#ifndef KVTIER_CURVE_INTERNAL_H
#define KVTIER_CURVE_INTERNAL_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>

/* Makes `sock` a CURVE client before it connects to `endpoint` (tcp:// only; other endpoints
 * are left alone). `curve` NULL means "from the environment": KVTIER_CURVE_SERVERKEY and
 * KVTIER_CURVE_CERT. Sets *used when CURVE was applied. 0, or KVTIER_EINVAL with a sentence in
 * err (a key or certificate that cannot be read). */
int kvt__curve_setup(void *sock, const char *endpoint, const kvtier_curve_t *curve, bool *used,
                     char *err, size_t errlen);

#endif
