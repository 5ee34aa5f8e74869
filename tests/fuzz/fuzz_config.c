/* libFuzzer harness for the JSON config loader (config/kvt_config.c).
 *
 * Input: a JSON config text. It is applied to a fresh kvt_config_new() and finished; when
 * both succeed, kvt_config_to_json() of the result must itself apply to a second fresh config
 * and finish (the --print-config round trip), and print identically. Any crash, sanitizer
 * report, leak, or failed round trip (abort) is a finding.
 * Build and run: make fuzz (see the Makefile's fuzz section). */
#include "kvt_config.h"
#include "kvt_error.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[KVT_ERR_LEN];
    kvt_config_t *a = kvt_config_new();
    if (!a)
        abort();
    if (kvt_config_apply_json(a, (const char *)data, size, "fuzz", err, sizeof err) != 0 ||
        kvt_config_finish(a, err, sizeof err) != 0) {
        kvt_config_destroy(&a);
        return 0;
    }

    char *json = kvt_config_to_json(a);
    if (!json)
        abort();
    kvt_config_t *b = kvt_config_new();
    if (!b)
        abort();
    if (kvt_config_apply_json(b, json, strlen(json), "round-trip", err, sizeof err) != 0 ||
        kvt_config_finish(b, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_config: round trip failed: %s\n--- printed config:\n%s\n", err,
                json);
        abort();
    }
    char *json2 = kvt_config_to_json(b);
    if (!json2)
        abort();
    if (strcmp(json, json2) != 0) {
        fprintf(stderr, "fuzz_config: round trip not stable\n--- first:\n%s\n--- second:\n%s\n",
                json, json2);
        abort();
    }
    free(json2);
    free(json);
    kvt_config_destroy(&b);
    kvt_config_destroy(&a);
    return 0;
}
