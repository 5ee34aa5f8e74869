/* Unit tests of l2/kvt_l2_trailer: a trailer made for (name, length, checksum) checks OK and
 * gives the checksum back; each way an object can be wrong gets its verdict — too short, no
 * magic (an object of the previous format, or a truncated one), a newer version, any damaged
 * trailer byte, a length that differs, another object's trailer; and every verdict has a
 * sentence. The layout is pinned (little-endian fields at fixed offsets): objects outlive
 * daemons, so it must not change by accident. */
#include "kvt_l2_trailer.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <xxhash.h>

#include <cmocka.h>

static const char *const s_name =
    "00112233445566778899aabbccddeeff-0123456789abcdef0123456789abcdef";

static void test_round_trip_and_layout(void **state)
{
    (void)state;
    uint8_t t[KVT_L2_TRAILER_LEN];
    kvt_l2_trailer_make(t, s_name, 5000, 0x1122334455667788ull);
    uint64_t sum = 0;
    assert_int_equal(kvt_l2_trailer_check(t, s_name, 5000 + KVT_L2_TRAILER_LEN, &sum), KVT_L2_V_OK);
    assert_true(sum == 0x1122334455667788ull);
    assert_memory_equal(t, "KVTL", 4);
    assert_int_equal(t[4] | t[5] << 8, KVT_L2_TRAILER_VERSION);
    assert_int_equal(t[6] | t[7] << 8, KVT_L2_TRAILER_LEN);
    assert_int_equal(t[8] | t[9] << 8, 5000); /* payload length, little-endian */
    assert_int_equal(t[16], 0x88);            /* checksum, little-endian */
    uint64_t ns = XXH3_64bits(s_name, strlen(s_name)), got = 0;
    for (int i = 7; i >= 0; i--)
        got = got << 8 | t[24 + i];
    assert_true(got == ns);
}

static void test_verdicts(void **state)
{
    (void)state;
    uint8_t t[KVT_L2_TRAILER_LEN], bad[KVT_L2_TRAILER_LEN];
    uint64_t sum = 0, len = 100 + KVT_L2_TRAILER_LEN;
    kvt_l2_trailer_make(t, s_name, 100, 42);
    assert_int_equal(kvt_l2_trailer_check(t, s_name, 39, &sum), KVT_L2_V_SHORT);
    assert_int_equal(kvt_l2_trailer_check(t, s_name, len + 1, &sum), KVT_L2_V_LENGTH);
    assert_int_equal(kvt_l2_trailer_check(t, s_name, len - 1, &sum), KVT_L2_V_LENGTH);
    char other[80];
    strcpy(other, s_name);
    other[70 - 6] ^= 1;
    assert_int_equal(kvt_l2_trailer_check(t, other, len, &sum), KVT_L2_V_NAME);
    /* payload bytes where a trailer should be: an object of the previous format */
    memset(bad, 0x5a, sizeof bad);
    assert_int_equal(kvt_l2_trailer_check(bad, s_name, len, &sum), KVT_L2_V_NO_TRAILER);
    /* a newer version is not judged (its layout may differ) */
    memcpy(bad, t, sizeof bad);
    bad[4] = KVT_L2_TRAILER_VERSION + 1;
    assert_int_equal(kvt_l2_trailer_check(bad, s_name, len, &sum), KVT_L2_V_NEWER);
    /* any other byte flipped */
    for (size_t i = 0; i < sizeof t; i++) {
        if (i == 4 || i == 5)
            continue;
        memcpy(bad, t, sizeof bad);
        bad[i] ^= 0x20;
        kvt_l2_verdict_t v = kvt_l2_trailer_check(bad, s_name, len, &sum);
        if (i < 4)
            assert_int_equal(v, KVT_L2_V_NO_TRAILER);
        else
            assert_int_equal(v, KVT_L2_V_TRAILER);
    }
    for (int v = KVT_L2_V_OK; v <= KVT_L2_V_CHECKSUM; v++)
        assert_true(strlen(kvt_l2_verdict_str((kvt_l2_verdict_t)v)) > 5);
    assert_string_equal(kvt_l2_verdict_str((kvt_l2_verdict_t)99), "unknown verdict");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_and_layout),
        cmocka_unit_test(test_verdicts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
