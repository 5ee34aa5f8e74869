/* kvt_utf8: the check that bytes are UTF-8 text, for what kvtier sends on as text (object
 * labels in events: msgpack str, which a subscriber decodes as text). Pure; any thread. */
#ifndef KVT_UTF8_H
#define KVT_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF, no cut sequence. */
bool kvt_utf8_valid(const uint8_t *p, size_t n);

#endif
