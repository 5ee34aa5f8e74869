/* kvt_size: parsing of byte sizes ("512M", "4G", "1073741824", "64k", "16MiB"; binary
 * multiples), shared by the config loader and the L2 adapters' arguments. Pure; any thread. */
#ifndef KVT_SIZE_H
#define KVT_SIZE_H

#include <stdint.h>

/* 0 and *out; KVT_EINVAL when s is not a size (*out untouched); KVT_ETOOBIG when it is one
 * that does not fit in 64 bits. */
int kvt_size_parse(const char *s, uint64_t *out);

#endif
