/* kvtier: a small command-line client of kvtierd, built on libkvtier.
 *   kvtier [-e ENDPOINT] [-t TIMEOUT_MS] ping | stats
 * ENDPOINT defaults to $KVTIER_ENDPOINT, else ipc://var/run/kvtier.sock (make run's default).
 * Exit status: 0 ok, 1 the daemon answered an error or could not be reached, 2 usage. */
#include "kvt_error.h"
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int s_usage(void)
{
    fprintf(stderr, "usage: kvtier [-e ENDPOINT] [-t TIMEOUT_MS] ping|stats\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *endpoint = getenv("KVTIER_ENDPOINT");
    int timeout = 5000;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if ((!strcmp(argv[i], "-e") || !strcmp(argv[i], "--endpoint")) && i + 1 < argc)
            endpoint = argv[++i];
        else if ((!strcmp(argv[i], "-t") || !strcmp(argv[i], "--timeout")) && i + 1 < argc)
            timeout = atoi(argv[++i]);
        else
            return s_usage();
    }
    if (i != argc - 1)
        return s_usage();
    const char *cmd = argv[i];
    if (strcmp(cmd, "ping") && strcmp(cmd, "stats"))
        return s_usage();
    if (!endpoint)
        endpoint = "ipc://var/run/kvtier.sock";
    char err[256];
    kvtier_t *c = kvtier_connect(endpoint, "kvtier-cli", NULL, timeout, err, sizeof err);
    if (!c) {
        fprintf(stderr, "kvtier: %s\n", err);
        return 1;
    }
    int rc;
    if (!strcmp(cmd, "ping")) {
        rc = kvtier_ping(c);
        if (rc == 0)
            printf("pong from %s\n", kvtier_info(c)->server);
    } else {
        char *json = NULL;
        rc = kvtier_stats(c, &json);
        if (rc == 0)
            printf("%s\n", json);
        free(json);
    }
    if (rc)
        fprintf(stderr, "kvtier: %s: %s (%s)\n", cmd, kvtier_last_error(c), kvt_err_wire(rc));
    kvtier_close(&c);
    return rc ? 1 : 0;
}
