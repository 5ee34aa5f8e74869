/* DESIGN: static tables generated from KVT_REQ_MAP / KVT_FIELD_MAP; no state, any thread. */
#include "kvt_proto.h"

static const kvt_req_info_t s_info[KVT_REQ_SLOTS] = {
#define KVT_XX(id, NAME, name, cls, req, opt, max)                                             \
    [id] = {KVT_REQ_##NAME, name, KVT_RUN_##cls, req, opt, max},
    KVT_REQ_MAP(KVT_XX)
#undef KVT_XX
};

static const char *const s_field_names[KVT_FIELD_COUNT] = {
#define KVT_XX(f, name, kind) [KVT_FI_##f] = name,
    KVT_FIELD_MAP(KVT_XX)
#undef KVT_XX
};

const kvt_req_info_t *kvt_proto_info(uint64_t type)
{
    if (type >= KVT_REQ_SLOTS || s_info[type].name == NULL)
        return NULL;
    return &s_info[type];
}

const char *kvt_proto_name(uint64_t type)
{
    const kvt_req_info_t *info = kvt_proto_info(type);
    return info ? info->name : "unknown";
}

const char *kvt_proto_field_name(int i)
{
    return (i >= 0 && i < KVT_FIELD_COUNT) ? s_field_names[i] : "?";
}
