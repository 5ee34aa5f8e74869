/* Unit tests of the GPU module (storage/kvt_gpu.c) that need no GPU: layout validation, block
 * id checks and run coalescing (pure functions), and the module itself on a machine without a
 * CUDA device — every request refused KVT_EUNAVAIL with "no CUDA device: ...", nothing
 * registered, owner_gone and destroy clean. */
#include "kvt_error.h"
#include "kvt_gpu.h"
#include "kvt_log.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define L 4

static uint8_t s_handles[L][KVT_IPC_HANDLE_LEN];
static uint64_t s_offsets[L];

/* A valid REGISTER_GPU as the handler passes it on. */
static kvt_gpu_reg_args_t s_layout_req(void)
{
    for (int i = 0; i < L; i++) {
        memset(s_handles[i], i + 1, KVT_IPC_HANDLE_LEN);
        s_offsets[i] = (uint64_t)i << 20;
    }
    kvt_gpu_reg_args_t r;
    memset(&r, 0, sizeof r);
    r.device = 0;
    r.layers = L;
    r.num_blocks = 100;
    r.block_tokens = 16;
    r.token_bytes = 2 * 8 * 128 * 2; /* K+V, 8 heads x 128, bf16 */
    r.dtype = (const uint8_t *)"bfloat16";
    r.dtype_len = 8;
    r.handles = s_handles[0];
    r.nhandles = L;
    r.offsets = s_offsets;
    r.noffsets = L;
    return r;
}

static void expect_bad(const kvt_gpu_reg_args_t *r, const char *mention)
{
    char err[200] = "";
    kvt_gpu_layout_t lay;
    assert_int_equal(kvt_gpu_layout_check(r, &lay, err, sizeof err), KVT_EBADREQ);
    if (!strstr(err, mention))
        fail_msg("'%s' does not mention '%s'", err, mention);
}

static void test_layout_ok(void **state)
{
    (void)state;
    kvt_gpu_reg_args_t r = s_layout_req();
    char err[200] = "";
    kvt_gpu_layout_t lay;
    assert_int_equal(kvt_gpu_layout_check(&r, &lay, err, sizeof err), 0);
    assert_int_equal(lay.layers, L);
    assert_int_equal(lay.dtype_size, 2);
    assert_int_equal(lay.block_bytes, 16 * 4096);
    assert_int_equal(lay.layer_bytes, 100ull * 16 * 4096);
    r.offsets = NULL; /* offsets are optional */
    r.noffsets = 0;
    assert_int_equal(kvt_gpu_layout_check(&r, &lay, err, sizeof err), 0);
    assert_int_equal(kvt_gpu_dtype_size((const uint8_t *)"float32", 7), 4);
    assert_int_equal(kvt_gpu_dtype_size((const uint8_t *)"float8_e4m3fn", 13), 1);
    assert_int_equal(kvt_gpu_dtype_size((const uint8_t *)"float", 5), 0);
    assert_int_equal(kvt_gpu_dtype_size((const uint8_t *)"float16x", 8), 0);
}

static void test_layout_refused(void **state)
{
    (void)state;
    kvt_gpu_reg_args_t r;
    r = s_layout_req(), r.layers = 0, r.nhandles = 0;
    expect_bad(&r, "'layers' is 0");
    r = s_layout_req(), r.layers = KVT_MAX_GPU_LAYERS + 1;
    expect_bad(&r, "'layers'");
    r = s_layout_req(), r.nhandles = L - 1;
    expect_bad(&r, "'handles' has 3 entries for 4 layers");
    r = s_layout_req(), r.noffsets = 2;
    expect_bad(&r, "'offsets' has 2 entries");
    r = s_layout_req(), r.device = KVT_GPU_MAX_DEVICES;
    expect_bad(&r, "'device' is 64");
    r = s_layout_req(), r.num_blocks = 0;
    expect_bad(&r, "'num_blocks' is 0");
    r = s_layout_req(), r.num_blocks = KVT_GPU_MAX_BLOCKS + 1;
    expect_bad(&r, "'num_blocks'");
    r = s_layout_req(), r.block_tokens = 0;
    expect_bad(&r, "'block_tokens' is 0");
    r = s_layout_req(), r.block_tokens = KVT_GPU_MAX_BLOCK_TOKENS + 1;
    expect_bad(&r, "'block_tokens'");
    r = s_layout_req(), r.token_bytes = 0;
    expect_bad(&r, "'token_bytes' is 0");
    r = s_layout_req(), r.token_bytes = KVT_GPU_MAX_TOKEN_BYTES + 1;
    expect_bad(&r, "'token_bytes'");
    r = s_layout_req(), r.token_bytes = 4095;
    expect_bad(&r, "not a multiple of the dtype's 2 bytes");
    r = s_layout_req(), r.dtype = (const uint8_t *)"fp16", r.dtype_len = 4;
    expect_bad(&r, "'dtype' fp16 is not one of");
    r = s_layout_req();
    memset(s_handles[2], 0, KVT_IPC_HANDLE_LEN);
    expect_bad(&r, "handle 2 is all zeros");
    r = s_layout_req(), s_offsets[3] = UINT64_MAX - 10;
    expect_bad(&r, "'offsets'[3]");
    /* 2^16 tokens x 2^24 bytes x 2^32 blocks does not fit 64 bits */
    r = s_layout_req(), r.block_tokens = KVT_GPU_MAX_BLOCK_TOKENS,
    r.token_bytes = KVT_GPU_MAX_TOKEN_BYTES, r.num_blocks = KVT_GPU_MAX_BLOCKS;
    expect_bad(&r, "overflow");
}

static void test_chunk_check(void **state)
{
    (void)state;
    kvt_gpu_reg_args_t r = s_layout_req();
    char err[200] = "";
    kvt_gpu_layout_t lay;
    assert_int_equal(kvt_gpu_layout_check(&r, &lay, err, sizeof err), 0);
    uint64_t ids[8] = {0, 1, 2, 3, 99, 98, 50, 51};
    uint32_t per = 0;
    uint64_t bytes = 0;
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 8, 2, &per, &bytes, err, sizeof err), 0);
    assert_int_equal(per, 4);
    assert_int_equal(bytes, (uint64_t)L * 4 * lay.block_bytes);
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 8, 8, &per, &bytes, err, sizeof err), 0);
    assert_int_equal(per, 1);
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 0, 0, &per, &bytes, err, sizeof err), 0);
    assert_int_equal(bytes, 0);
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 8, 3, &per, &bytes, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "multiple"));
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 2, 0, &per, &bytes, err, sizeof err),
                     KVT_EBADREQ);
    ids[5] = 100; /* == num_blocks */
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 8, 2, &per, &bytes, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "entry 5 is 100"));
    ids[5] = UINT64_MAX;
    assert_int_equal(kvt_gpu_chunk_check(&lay, ids, 8, 2, &per, &bytes, err, sizeof err),
                     KVT_EBADREQ);
}

static void test_runs(void **state)
{
    (void)state;
    uint32_t start[16], len[16];
    uint64_t a[] = {5, 6, 7, 9, 10, 3, 3, 4};
    uint32_t n = kvt_gpu_runs(a, 8, start, len);
    assert_int_equal(n, 4);
    uint32_t want_start[] = {0, 3, 5, 6}, want_len[] = {3, 2, 1, 2};
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(start[i], want_start[i]);
        assert_int_equal(len[i], want_len[i]);
    }
    uint64_t b[] = {42};
    assert_int_equal(kvt_gpu_runs(b, 1, start, len), 1);
    assert_int_equal(len[0], 1);
    assert_int_equal(kvt_gpu_runs(b, 0, start, len), 0);
    uint64_t c[] = {9, 8, 7};
    assert_int_equal(kvt_gpu_runs(c, 3, start, len), 3);
    uint64_t d[] = {UINT64_MAX - 1, UINT64_MAX, 0};
    assert_int_equal(kvt_gpu_runs(d, 3, start, len), 2); /* no wrap-around run */
}

typedef struct {
    int n;
    double loaded, regs, to_l1, to_gpu;
} s_samples_t;

static void s_collect(void *ctx, const kvt_sample_t *smp)
{
    s_samples_t *c = ctx;
    c->n++;
    if (!strcmp(smp->name, "gpu_runtime_loaded"))
        c->loaded = smp->value;
    else if (!strcmp(smp->name, "gpu_registrations"))
        c->regs = smp->value;
    else if (!strcmp(smp->name, "gpu_copied_bytes_total")) {
        assert_string_equal(smp->label, "direction");
        if (!strcmp(smp->label_value, "to_l1"))
            c->to_l1 = smp->value;
        else
            c->to_gpu = smp->value;
    }
}

/* Without a CUDA device (this test runs in CI without one; skipped where /dev/nvidia0 is). */
static void test_module_without_gpu(void **state)
{
    (void)state;
    FILE *dev = fopen("/dev/nvidia0", "r");
    if (dev) {
        fclose(dev);
        skip();
    }
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    assert_int_equal(kvt_config_set(cfg, "l1_size", "8M", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    kvt_l1_t *l1 = kvt_l1_new(cfg, err, sizeof err);
    assert_non_null(l1);
    kvt_gpu_t *gpu = kvt_gpu_new(l1);
    assert_non_null(gpu);
    kvt_gpu_reg_args_t r = s_layout_req();
    kvt_gpu_layout_t lay;
    char msg[200] = "";
    /* an invalid layout is bad_request before CUDA is asked anything */
    r.num_blocks = 0;
    assert_int_equal(kvt_gpu_register(gpu, 7, &r, &lay, msg, sizeof msg), KVT_EBADREQ);
    r = s_layout_req();
    for (int i = 0; i < 2; i++) {
        msg[0] = '\0';
        assert_int_equal(kvt_gpu_register(gpu, 7, &r, &lay, msg, sizeof msg), KVT_EUNAVAIL);
        assert_true(strncmp(msg, "no CUDA device: ", 16) == 0);
        assert_true(strlen(msg) > 20);
    }
    assert_int_equal(kvt_gpu_registrations(gpu), 0);
    kvt_key_t keys[2] = {{{1}}, {{2}}};
    uint64_t ids[2] = {0, 1};
    kvt_gpu_copy_args_t c;
    memset(&c, 0, sizeof c);
    c.ns = (kvt_ns_t){(const uint8_t *)"m", 1, NULL, 0};
    c.keys = keys;
    c.nkeys = 2;
    c.block_ids = ids;
    c.nblock_ids = 2;
    uint32_t count = 99;
    assert_int_equal(kvt_gpu_store(gpu, 7, &c, &count, msg, sizeof msg), KVT_EUNAVAIL);
    assert_int_equal(count, 0);
    assert_int_equal(kvt_gpu_retrieve(gpu, 7, &c, &count, msg, sizeof msg), KVT_EUNAVAIL);
    assert_true(strncmp(msg, "no CUDA device: ", 16) == 0);
    assert_int_equal(kvt_gpu_unregister(gpu, 7, 0, msg, sizeof msg), KVT_ENOTFOUND);
    assert_int_equal(kvt_gpu_owner_gone(gpu, 7), 0);
    s_samples_t smp = {.loaded = -1, .regs = -1, .to_l1 = -1, .to_gpu = -1};
    kvt_gpu_metrics_source(gpu, s_collect, &smp);
    assert_int_equal(smp.n, 6);
    assert_true(smp.loaded == 0 && smp.regs == 0 && smp.to_l1 == 0 && smp.to_gpu == 0);
    kvt_gpu_destroy(&gpu);
    assert_null(gpu);
    kvt_gpu_destroy(&gpu); /* NULL is fine */
    kvt_l1_destroy(&l1);
    kvt_config_destroy(&cfg);
}

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_ok),
        cmocka_unit_test(test_layout_refused),
        cmocka_unit_test(test_chunk_check),
        cmocka_unit_test(test_runs),
        cmocka_unit_test(test_module_without_gpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
