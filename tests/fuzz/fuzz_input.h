/* The fuzzers' input reader: little-endian integers taken from the front of the input (0 once it
 * is used up), so every input is a program and none is rejected. Included by the harnesses
 * that build what they test from their input (fuzz_journal, fuzz_seglog). */
#ifndef KVT_FUZZ_INPUT_H
#define KVT_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const uint8_t *p;
    size_t n;
} s_in_t;

static inline uint64_t s_take(s_in_t *in, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes && in->n; i++, in->p++, in->n--)
        v |= (uint64_t)in->p[0] << (8 * i);
    return v;
}

#endif
