/* Size strings of the config and of adapter arguments: decimal digits with an optional binary
 * multiple (k, M, G, T, each optionally followed by B or iB) or a bare B. */
#include "kvt_size.h"

#include "kvt_error.h"

#include <ctype.h>
#include <stdbool.h>

int kvt_size_parse(const char *s, uint64_t *out)
{
    const char *p = s;
    if (!s || !out)
        return KVT_EINVAL;
    uint64_t v = 0;
    unsigned shift = 0;
    if (!isdigit((unsigned char)*p))
        return KVT_EINVAL; /* rejects "", "-1", "+1", " 1" */
    bool overflow = false;
    for (; isdigit((unsigned char)*p); p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            overflow = true;
        else
            v = v * 10 + d;
    }
    switch (tolower((unsigned char)*p)) {
    case 'k':
        shift = 10;
        break;
    case 'm':
        shift = 20;
        break;
    case 'g':
        shift = 30;
        break;
    case 't':
        shift = 40;
        break;
    default:
        break;
    }
    if (shift) {
        p++;
        if (tolower((unsigned char)p[0]) == 'i' && tolower((unsigned char)p[1]) == 'b')
            p += 2;
        else if (tolower((unsigned char)*p) == 'b')
            p++;
    } else if (tolower((unsigned char)*p) == 'b') {
        p++; /* "512B" */
    }
    if (*p != '\0')
        return KVT_EINVAL;
    if (overflow || (shift && v > (UINT64_MAX >> shift)))
        return KVT_ETOOBIG;
    *out = v << shift;
    return 0;
}
