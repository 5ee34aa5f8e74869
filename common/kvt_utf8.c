/* DESIGN: one pass, each sequence's length from its lead byte, its code point rebuilt from
 * the continuation bytes and checked against the smallest one that length may encode (an
 * overlong form is a second spelling of an ASCII character, such as '/'). */
#include "kvt_utf8.h"

bool kvt_utf8_valid(const uint8_t *p, size_t n)
{
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    for (size_t i = 0; i < n;) {
        uint8_t c = p[i];
        size_t len = c < 0x80             ? 1
                     : (c & 0xE0) == 0xC0 ? 2
                     : (c & 0xF0) == 0xE0 ? 3
                     : (c & 0xF8) == 0xF0 ? 4
                                          : 0;
        if (len == 0 || len > n - i)
            return false;
        uint32_t cp = len == 1 ? c : c & (0x7Fu >> len);
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80)
                return false;
            cp = cp << 6 | (p[i + k] & 0x3F);
        }
        if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += len;
    }
    return true;
}
