/* libFuzzer harness for the protocol v1 request decoder (protocol/kvt_msg.c).
 *
 * Input: byte 0 picks the request type (mod KVT_REQ_SLOTS + 1: 0..20, so 0 and 20 — unknown types — are
 * covered too; bit 7 picks the body limit, 64 KiB or 1 MiB); the rest is the body. The body
 * goes through kvt_msg_decode (then always kvt_req_release), kvt_msg_prescan and
 * kvt_msg_read_uint. Any crash, sanitizer report or leak is a finding.
 * Build and run: make fuzz (see the Makefile's fuzz section). */
#include "kvt_error.h"
#include "kvt_msg.h"
#include "kvt_proto.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t sel = data[0];
    kvt_req_type_t type = (kvt_req_type_t)((sel & 0x7f) % (KVT_REQ_SLOTS + 1));
    uint64_t max_message = (sel & 0x80) ? (1u << 20) : (64u << 10);
    const uint8_t *body = data + 1;
    size_t len = size - 1;

    kvt_limits_t lim;
    kvt_limits_init(&lim, max_message, 1024);

    kvt_req_t req;
    memset(&req, 0, sizeof req);
    int rc = kvt_msg_decode(body, len, type, &lim, &req);
    if (rc == 0) {
        /* touch what a handler would read, so ASan sees any pointer that escapes the body */
        volatile uint8_t sink = 0;
        for (uint32_t i = 0; i < req.nkeys; i++)
            sink ^= req.keys[i].b[0] ^ req.keys[i].b[KVT_KEY_LEN - 1];
        for (uint32_t i = 0; i < req.nsizes; i++)
            sink ^= (uint8_t)req.sizes[i];
        for (uint32_t i = 0; i < req.nfailed; i++)
            sink ^= (uint8_t)req.failed[i];
        for (uint32_t i = 0; i < req.nhandles; i++)
            sink ^= req.handles[i][0] ^ req.handles[i][KVT_IPC_HANDLE_LEN - 1];
        for (uint32_t i = 0; i < req.noffsets; i++)
            sink ^= (uint8_t)req.offsets[i];
        for (uint32_t i = 0; i < req.nblock_ids; i++)
            sink ^= (uint8_t)req.block_ids[i];
        const kvt_bytes_t ns = {req.ns.name, req.ns.name_len};
        const kvt_bytes_t salt = {req.ns.salt, req.ns.salt_len};
        const kvt_bytes_t *bs[] = {&req.client, &req.instance, &ns,   &salt,
                                   &req.tokens, &req.dtype,    &req.event};
        for (size_t b = 0; b < sizeof bs / sizeof bs[0]; b++)
            if (bs[b]->len)
                sink ^= bs[b]->ptr[0] ^ bs[b]->ptr[bs[b]->len - 1];
        (void)sink;
    }
    kvt_req_release(&req);

    char err[160];
    (void)kvt_msg_prescan(body, len, &lim, err, sizeof err);
    (void)kvt_msg_prescan(data, size, &lim, err, sizeof err);

    uint64_t u;
    (void)kvt_msg_read_uint(data, size, &u);
    (void)kvt_msg_read_uint(body, len, &u);
    return 0;
}
