# kvtier — the one build entry point. `make run` and `make test` are the two set-up commands:
# both install missing Debian packages first (deps), then build.

CC       ?= gcc
PYTHON   := /usr/bin/python3
BUILD    := build
# make Q= shows every compiler command
Q        ?= @
VERSION  := $(strip $(file < VERSION))

PKGS     := libzmq libczmq msgpack jansson libmicrohttpd libxxhash libsystemd hiredis
DEB_PKGS := build-essential pkg-config libzmq3-dev libczmq-dev libmsgpack-dev libjansson-dev \
            libmicrohttpd-dev libxxhash-dev libcmocka-dev python3-zmq python3-msgpack \
            python3-pytest python3-xxhash curl libsystemd-dev systemd libhiredis-dev \
            redis-server iproute2 valgrind fio
# What the Python package and its tests need besides (not `make run`): venv, pip and setuptools
# to install it, CPU torch for kvtier.sglang and its tests, yaml for test_contrib.py.
DEB_PY_PKGS := python3-venv python3-pip python3-setuptools python3-wheel python3-torch python3-yaml

WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Werror
# The layers and what each may include (docs/architecture.md): a folder's sources see only its
# own headers and those of the layers below it, so an upward #include does not compile.
#   daemon -> protocol, storage, config;  storage -> l2, config;  client -> protocol;
#   protocol, config, l2 -> common
# Tests, benchmarks and fuzzers see everything. `make check-layers` also compiles every header
# alone against its own layer's paths.
LAYERS       := common protocol config l2 storage daemon client
INC_common   := -Icommon
INC_protocol := -Iprotocol -Icommon
INC_config   := -Iconfig -Icommon
INC_l2       := -Il2 -Icommon
INC_storage  := -Istorage -Il2 -Iconfig -Icommon
INC_daemon   := -Idaemon -Istorage -Iprotocol -Iconfig -Icommon
INC_client   := -Iclient -Iprotocol -Icommon
INC_ALL      := -Icommon -Iprotocol -Iconfig -Istorage -Il2 -Idaemon -Iclient
# the layer of the source being compiled ($< = "storage/kvt_l1.c"); links and tests get them all
layer_of  = $(firstword $(subst /, ,$(1)))
INC       = $(or $(if $(filter $(LAYERS),$(call layer_of,$<)),$(INC_$(call layer_of,$<))),$(INC_ALL))
CFLAGS   ?= -O2 -g
# CPPFLAGS and LDFLAGS are empty here; packagers set them (dpkg-buildflags: _FORTIFY_SOURCE,
# relro, now), and the programs and libraries that `make install` ships link with LDFLAGS.
ALLCFLAGS = -std=gnu11 $(WARN) $(CPPFLAGS) $(CFLAGS) -fPIC -D_GNU_SOURCE \
            -DKVT_VERSION='"$(VERSION)"' $(INC) $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LIBS     = $(shell pkg-config --libs $(PKGS) 2>/dev/null) -ldl -lpthread -lm
SAN      := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

# ---- CUDA (optional) -----------------------------------------------------------------------
# The GPU module (storage/kvt_gpu.c) is built against the CUDA Toolkit whenever its nvcc is
# found (CUDA_HOME, default /usr/local/cuda); `make CUDA=0` forces it off. Either way every
# binary builds: without the toolkit the GPU requests validate and answer `unavailable`. The
# daemon does not link libcudart: it dlopens libcudart.so.<major> at the first GPU request,
# so start-up never touches CUDA and a CUDA build runs on machines without the toolkit. Only
# the GPU test and benchmark programs (engines, not the daemon) link -lcudart.
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(wildcard $(CUDA_HOME)/bin/nvcc)
CUDA      ?= $(if $(NVCC),1,0)
ifeq ($(CUDA),1)
CUDA_CFLAGS := -DKVT_HAVE_CUDA -DKVT_CUDA_LIBDIR='"$(CUDA_HOME)/lib64"' -isystem $(CUDA_HOME)/include
CUDA_LIBS   := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
CUDART_MAJOR := $(shell awk '/^\#define CUDART_VERSION/ {print int($$3/1000)}' \
                  $(CUDA_HOME)/include/cuda_runtime_api.h 2>/dev/null)
MOCK_CUDART  := $(BUILD)/mock-cudart/libcudart.so.$(CUDART_MAJOR)
endif

CORE_SRC   := $(wildcard common/*.c protocol/*.c config/*.c storage/*.c l2/*.c)
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLIENT_SRC := $(filter-out client/kvtier_cli.c,$(wildcard client/*.c))
UNIT_SRC   := $(wildcard tests/unit/test_*.c)

obj = $(patsubst %.c,$(1)/obj/%.o,$(2))

CORE_OBJ   := $(call obj,$(BUILD),$(CORE_SRC) $(DAEMON_SRC))
CLIENT_OBJ := $(call obj,$(BUILD),$(CLIENT_SRC) common/kvt_error.c common/kvt_ring.c common/kvt_fdpass.c \
                common/kvt_resident.c common/kvt_utf8.c \
                protocol/kvt_msg.c protocol/kvt_proto.c protocol/kvt_hash.c)
CLIENT_LIBS = $(shell pkg-config --libs libzmq msgpack jansson libxxhash 2>/dev/null)
ASAN_OBJ   := $(call obj,$(BUILD)/asan,$(CORE_SRC) $(DAEMON_SRC))
UNIT_BIN   := $(patsubst tests/unit/%.c,$(BUILD)/asan/tests/%,$(UNIT_SRC))
PLUGIN_EXAMPLE := $(BUILD)/kvtier-l2-example.so
PLUGIN_EXAMPLE_ABI1 := $(BUILD)/kvtier-l2-example-abi1.so
PLUGIN_ENV = KVT_L2_EXAMPLE_PLUGIN=$(abspath $(PLUGIN_EXAMPLE)) \
             KVT_L2_EXAMPLE_PLUGIN_ABI1=$(abspath $(PLUGIN_EXAMPLE_ABI1))

.PHONY: all deps run test unit integration asan clean check-asan tsan soak-adopt soak-l2-burst bench-l1 bench-l2 bench-huge \
        bench-ring bench-smoke test-gpu bench-gpu check-nocuda FORCE valgrind check check-layers \
        pyclient bench-sglang deps-py check-contrib deps-ops
.DEFAULT_GOAL := all

all: $(BUILD)/kvtierd $(BUILD)/kvtier $(BUILD)/libkvtier.a $(BUILD)/libkvtier.so $(PLUGIN_EXAMPLE) \
     $(PLUGIN_EXAMPLE_ABI1)

# Installs what is missing, once; nothing when every package is present. Waits up to 5 min for a
# dpkg that another apt or dpkg holds (apt-get, unlike apt, does not wait by default).
install_missing = @missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "$@: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    -o DPkg::Lock::Timeout=300 $$missing; \
	fi
deps:
	$(call install_missing,$(DEB_PKGS))
deps-py: deps
	$(call install_missing,$(DEB_PY_PKGS))

# The Python client as users get it: `pip install ./client/python` into a throw-away venv
# (--system-site-packages: it sees Debian's zmq, msgpack, xxhash, torch, pytest; --no-index:
# no network). The Python tests run on this interpreter, against the installed copy.
PY_SRC   := VERSION $(wildcard client/python/*.toml client/python/*.py client/python/kvtier/*.py) \
            client/python/MANIFEST.in client/kvtier_ring.c client/kvtier.h common/kvt_ring.c \
            common/kvt_ring.h common/kvt_error.c common/kvt_error.h common/kvt_resident.c \
            common/kvt_resident.h common/kvt_key.h
PYVENV   := $(BUILD)/pyvenv
PYTEST   := $(abspath $(PYVENV))/bin/python
pyclient: deps-py $(PYVENV)/.installed
$(PYVENV)/.installed: $(PY_SRC) | deps-py
	@rm -rf $(PYVENV) client/python/build client/python/kvtier.egg-info client/python/csrc
	$(PYTHON) -m venv --system-site-packages $(PYVENV)
	$(PYVENV)/bin/python -m pip install -q --no-build-isolation --no-index --no-cache-dir \
	  ./client/python
	@cd / && $(abspath $(PYVENV))/bin/python -c 'import kvtier, kvtier.sglang, sys; \
	  sys.exit(0 if kvtier.__file__.startswith("$(abspath $(PYVENV))/") else \
	  "kvtier imported from " + kvtier.__file__)'
	@touch $@

$(BUILD)/obj/%.o: %.c VERSION
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(ALLCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/asan/obj/%.o: %.c VERSION
	@mkdir -p $(dir $@)
	@echo "  CC asan $<"
	$(Q)$(CC) $(ALLCFLAGS) -O1 $(SAN) -MMD -MP -c $< -o $@

# kvt_gpu.o is rebuilt when CUDA is switched on or off (the stamp changes only then).
GPU_OBJS := $(BUILD)/obj/storage/kvt_gpu.o $(BUILD)/asan/obj/storage/kvt_gpu.o \
            $(BUILD)/tsan/obj/storage/kvt_gpu.o
$(GPU_OBJS): ALLCFLAGS += $(CUDA_CFLAGS)
$(GPU_OBJS): $(BUILD)/cuda.stamp

# `$<` as a C byte list in `$@` (od: coreutils), for an #include inside an array initialiser.
define embed_bytes
@mkdir -p $(dir $@)
od -An -v -tx1 $< > $@.od && sed -e 's/\([0-9a-f][0-9a-f]\)/0x\1,/g' $@.od > $@.tmp \
  && test -s $@.tmp && mv $@.tmp $@ && rm -f $@.od || { rm -f $@.od $@.tmp; exit 1; }
endef

# The staged GPU copies' kernel (storage/kvt_gpu_kernels.cu): nvcc builds a fatbin (machine code
# for sm_80 / sm_90 / sm_100 / sm_120, PTX for sm_75 and anything newer to JIT), which kvt_gpu.c
# embeds and loads with cudaLibraryLoadData. The daemon still links no CUDA library.
ifeq ($(CUDA),1)
GPU_FATBIN  := $(BUILD)/gen/kvt_gpu_kernels.fatbin
GPU_KERNELS := $(BUILD)/gen/kvt_gpu_kernels.inc
NVCC_ARCHS  ?= -gencode arch=compute_75,code=compute_75 -gencode arch=compute_80,code=sm_80 \
               -gencode arch=compute_90,code=sm_90 -gencode arch=compute_100,code=sm_100 \
               -gencode arch=compute_120,code=sm_120
$(GPU_FATBIN): storage/kvt_gpu_kernels.cu storage/kvt_gpu_kernels.h
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) --fatbin -O3 -Istorage $(NVCC_ARCHS) -o $@.tmp $< && mv $@.tmp $@
$(GPU_KERNELS): $(GPU_FATBIN)
	$(embed_bytes)
$(GPU_OBJS): $(GPU_KERNELS)
$(GPU_OBJS): ALLCFLAGS += -DKVT_HAVE_GPU_KERNELS -I$(BUILD)/gen
endif
$(BUILD)/cuda.stamp: FORCE
	@mkdir -p $(BUILD); echo "CUDA=$(CUDA) $(CUDA_HOME)" | cmp -s - $@ || \
	  echo "CUDA=$(CUDA) $(CUDA_HOME)" > $@
FORCE:

$(BUILD)/kvtierd: $(BUILD)/obj/daemon/main.o $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/asan/kvtierd: $(BUILD)/asan/obj/daemon/main.o $(ASAN_OBJ)
	$(CC) $(ALLCFLAGS) $(SAN) -o $@ $^ $(LIBS)

$(BUILD)/libkvtier.a: $(sort $(CLIENT_OBJ))
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libkvtier.so: $(sort $(CLIENT_OBJ)) client/libkvtier.map
	$(CC) $(ALLCFLAGS) $(LDFLAGS) -shared -Wl,-soname,libkvtier.so.0 \
	  -Wl,--version-script=client/libkvtier.map -o $@ $(filter %.o,$^) $(CLIENT_LIBS)

# An example L2 plugin (plugin:build/kvtier-l2-example.so): self-contained, no daemon symbols.
# The same source built as an ABI 1 plugin (what plugins written before ABI 2 look like), for
# the tests of the compatibility path.
$(PLUGIN_EXAMPLE): l2/plugins/example_mem.c l2/kvt_l2.h common/kvt_error.h
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(LDFLAGS) -shared -o $@ $< -lpthread

$(PLUGIN_EXAMPLE_ABI1): l2/plugins/example_mem.c l2/kvt_l2.h common/kvt_error.h
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(LDFLAGS) -DKVT_EXAMPLE_ABI=1 -shared -o $@ $< -lpthread

$(BUILD)/kvtier: $(BUILD)/obj/client/kvtier_cli.o $(BUILD)/libkvtier.a
	$(CC) $(ALLCFLAGS) $(LDFLAGS) -o $@ $^ $(CLIENT_LIBS)

# The CLI's endpoint when neither -e nor $$KVTIER_ENDPOINT names one: make run's (relative)
# socket here; debian/rules builds the package with the service's ipc:///run/kvtier/kvtier.sock.
# kvtier_cli.o is rebuilt when it changes (the stamp changes only then).
KVT_CLI_ENDPOINT ?= ipc://var/run/kvtier.sock
$(BUILD)/obj/client/kvtier_cli.o: ALLCFLAGS += -DKVT_CLI_DEFAULT_ENDPOINT='"$(KVT_CLI_ENDPOINT)"'
$(BUILD)/obj/client/kvtier_cli.o: $(BUILD)/cli-endpoint.stamp
$(BUILD)/cli-endpoint.stamp: FORCE
	@mkdir -p $(BUILD); echo "$(KVT_CLI_ENDPOINT)" | cmp -s - $@ || echo "$(KVT_CLI_ENDPOINT)" > $@

$(BUILD)/asan/tests/%: tests/unit/%.c $(ASAN_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -O1 $(SAN) -o $@ $^ $(LIBS) -lcmocka

# test_client_codes checks libkvtier's codes against the daemon's tables: it links libkvtier too
$(BUILD)/asan/tests/test_client_codes: $(call obj,$(BUILD)/asan,$(CLIENT_SRC))
$(BUILD)/vg/tests/test_client_codes: $(call obj,$(BUILD)/vg,$(CLIENT_SRC))

asan: $(BUILD)/asan/kvtierd

run: deps all
	@mkdir -p var/run var/data
	exec $(BUILD)/kvtierd

unit: deps $(UNIT_BIN) $(PLUGIN_EXAMPLE) $(PLUGIN_EXAMPLE_ABI1)
	@set -e; for t in $(UNIT_BIN); do echo "== $$t"; \
	  $(PLUGIN_ENV) timeout 120 $$t; done

# Every header compiles on its own with only its layer's include paths: a header that leans on
# one of a higher layer (or on being included after another) fails here.
check-layers: deps
	@set -e; $(foreach l,$(LAYERS),for h in $(l)/*.h; do \
	  echo "#include \"$$(basename $$h)\"" | $(CC) -std=gnu11 $(WARN) -D_GNU_SOURCE \
	    -fsyntax-only -x c - $(INC_$(l)) $(shell pkg-config --cflags $(PKGS) 2>/dev/null) \
	    || { echo "check-layers: $$h does not compile within $(l)/"; exit 1; }; done;) \
	echo "check-layers: every header compiles within its layer"

# Integration tests run against the ASan+UBSan daemon; a sanitizer report fails the test.
# The whole suite with the clients on the fast path (KVT_TRANSPORT=fastpath: the run stops if
# the Python client cannot load libkvtier's ring code), then the suites of the two clients again
# over the socket (KVTIER_FASTPATH=0), the path every client had before issue 17 and still takes
# when no ring pair is offered. The raw-socket suites (protocol, connections, ...) speak ZMQ
# themselves either way.
INTEGRATION_ZMQ := tests/integration/test_py_client.py tests/integration/test_c_client.py \
    tests/integration/test_client_liveness.py
INTEGRATION_ENV = KVT_DAEMON=$(abspath $(BUILD)/asan/kvtierd) KVT_CLI=$(abspath $(BUILD)/kvtier) \
	  KVT_MOCK_CUDART=$(if $(MOCK_CUDART),$(abspath $(MOCK_CUDART))) \
	  KVT_CLIENT_TEST=$(abspath $(BUILD)/kvtier-client-test) \
	  KVTIER_LIBRARY=$(abspath $(BUILD)/libkvtier.so) $(PLUGIN_ENV)

integration: deps all asan $(BUILD)/kvtier-client-test $(MOCK_CUDART) pyclient
	$(INTEGRATION_ENV) KVT_TRANSPORT=fastpath \
	  timeout 900 $(PYTEST) -m pytest -q -p no:cacheprovider tests/integration
	$(INTEGRATION_ENV) KVT_TRANSPORT=zmq \
	  timeout 300 $(PYTEST) -m pytest -q -p no:cacheprovider $(INTEGRATION_ZMQ)

check-asan: unit integration

# CI's entry point (.ci/run): about 7 min from a fresh clone on 2 cores (its budget is 15).
test: deps check-layers check-contrib all check-nocuda unit tsan valgrind bench-smoke fuzz-smoke integration \
      test-gpu deb-test

# Everything, longer: each fuzzer for CHECK_FUZZ_SECONDS instead of CI's 30 s.
CHECK_FUZZ_SECONDS ?= 600
check: deps check-layers all check-nocuda unit tsan valgrind bench-smoke integration test-gpu \
       soak-adopt soak-l2-burst
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=$(CHECK_FUZZ_SECONDS)

# The restart loop of test_adopt.py (20 kills in `make test`) with SOAK_KILLS kills.
SOAK_KILLS ?= 200
soak-adopt: deps all asan pyclient
	$(INTEGRATION_ENV) KVT_ADOPT_KILLS=$(SOAK_KILLS) timeout 3600 $(PYTEST) -m pytest -q \
	  -p no:cacheprovider "tests/integration/test_adopt.py::test_restarts_under_mixed_load"

# The L2-slower-than-the-writers burst of test_l2.py (12 s in `make test`) for BURST_S seconds.
BURST_S ?= 60
soak-l2-burst: deps all asan pyclient
	$(INTEGRATION_ENV) KVT_BURST_S=$(BURST_S) timeout 1800 $(PYTEST) -m pytest -q \
	  -p no:cacheprovider tests/integration/test_l2.py -k test_store_burst_faster_than_l2

# The build without the CUDA toolkit still compiles and links (CI has nvcc, so this is the only
# place that path is built): the GPU module without KVT_HAVE_CUDA, linked into a daemon in
# build/nocuda/ from the other objects of build/obj.
NOCUDA_GPU := $(BUILD)/nocuda/kvt_gpu.o
$(NOCUDA_GPU): storage/kvt_gpu.c storage/kvt_gpu.h
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -c $< -o $@

$(BUILD)/nocuda/kvtierd: $(BUILD)/obj/daemon/main.o $(filter-out %/kvt_gpu.o,$(CORE_OBJ)) \
                         $(NOCUDA_GPU)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

check-nocuda: deps $(BUILD)/nocuda/kvtierd
	@! grep -q cudaGetDeviceCount $(NOCUDA_GPU)
	@$(BUILD)/nocuda/kvtierd --version > /dev/null && echo "check-nocuda: ok (build/nocuda/kvtierd)"

# ---- GPU test and benchmark ---------------------------------------------------------------
# Engines in miniature: they link libkvtier and libcudart, start their own kvtierd, allocate a
# paged KV cache in a child process and drive REGISTER/STORE/RETRIEVE_GPU. Without a CUDA
# device (or without the toolkit) they print one "skipped" line and exit 0.
GPU_TEST  := $(BUILD)/kvt-test-gpu
GPU_BENCH := $(BUILD)/kvt-bench-gpu
GPU_BENCH_ARGS ?= --json $(BUILD)/bench-gpu.json

ifeq ($(CUDA),1)
$(BUILD)/kvt-%-gpu: tests/gpu/kvt_%_gpu.c tests/gpu/gpu_harness.h $(BUILD)/libkvtier.a
	$(CC) $(ALLCFLAGS) $(CUDA_CFLAGS) -Itests/gpu -o $@ $< $(BUILD)/libkvtier.a $(CLIENT_LIBS) \
	  $(CUDA_LIBS) -lpthread

test-gpu: deps $(BUILD)/kvtierd $(GPU_TEST)
	timeout 300 $(GPU_TEST) --daemon $(BUILD)/kvtierd

bench-gpu: deps $(BUILD)/kvtierd $(GPU_BENCH)
	timeout 600 $(GPU_BENCH) --daemon $(BUILD)/kvtierd $(GPU_BENCH_ARGS)
else
test-gpu bench-gpu:
	@echo "$@: skipped: no CUDA toolkit (no nvcc under $(CUDA_HOME), or CUDA=0)"
endif

# A stand-in libcudart (tests/gpu/mock_cudart.c: "device memory" is a file, copies are memcpy)
# that the integration tests put on the daemon's LD_LIBRARY_PATH, so the GPU path runs end to
# end without a GPU. Test-only: never installed. Needs the toolkit's headers for the types.
ifeq ($(CUDA),1)
$(MOCK_CUDART): tests/gpu/mock_cudart.c storage/kvt_gpu_kernels.h
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 $(WARN) -O1 -g -fPIC -D_GNU_SOURCE -Istorage -isystem $(CUDA_HOME)/include \
	  -shared \
	  -Wl,-soname,libcudart.so.$(CUDART_MAJOR) -o $@ $< -lpthread
endif

# ThreadSanitizer: the L1 concurrency test, built with its own objects in build/tsan/ (a TSan
# report fails the target: halt_on_error, and TSan's non-zero exit code). The objects are
# named as prerequisites of `tsan` so make keeps them (not intermediates).
TSAN      := -fsanitize=thread -fno-omit-frame-pointer
TSAN_OBJ  := $(call obj,$(BUILD)/tsan,$(CORE_SRC) $(DAEMON_SRC))

$(BUILD)/tsan/obj/%.o: %.c VERSION
	@mkdir -p $(dir $@)
	@echo "  CC tsan $<"
	$(Q)$(CC) $(ALLCFLAGS) -O1 -g $(TSAN) -MMD -MP -c $< -o $@

$(BUILD)/tsan/tests/%: tests/unit/%.c $(TSAN_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -O1 -g $(TSAN) -o $@ $^ $(LIBS) -lcmocka

TSAN_UNIT := test_l1_concurrent test_lease test_l2_conformance test_l2_fs test_l2mgr test_reqstats \
             test_queue test_workers test_ring test_fastpath test_cache test_evlog test_resident
TSAN_BIN  := $(addprefix $(BUILD)/tsan/tests/,$(TSAN_UNIT))

$(BUILD)/tsan/kvtierd: $(BUILD)/tsan/obj/daemon/main.o $(TSAN_OBJ)
	$(CC) $(ALLCFLAGS) -O1 -g $(TSAN) -o $@ $^ $(LIBS)

# The unit tests with threads (L1 under 4 threads, lease add/expire races, every L2 adapter's
# contract under max_threads callers, the L2 manager's threads, request counters from 4
# threads), then the concurrent integration tests against a TSan daemon: 32 clients at once,
# SIGTERM under 8 writers with L2 write-behind, clients pinging while the daemon stops, replies
# completed on libzmq's I/O threads while the server loop counts and cuts connections; the fast
# path: 32 ring clients, hostile and SIGKILLed ones, an instance dropped and re-established;
# the event log written by L1 and L2 threads while the events socket and poll_kv_events read it;
# the residency map read by a thread while another writes and rebuilds it.
TSAN_INTEGRATION := tests/integration/test_reliability.py \
    tests/integration/test_adopt.py \
    "tests/integration/test_l2.py::test_sigterm_under_load_keeps_what_l2_acknowledged[SIGTERM-None]" \
    tests/integration/test_lifecycle.py::test_sigterm_while_clients_ping \
    tests/integration/test_l1.py::test_killed_client_loses_its_leases \
    tests/integration/test_connections.py::test_unread_get_replies_pin_a_bounded_amount_then_the_connection_is_cut \
    tests/integration/test_connections.py::test_999_lookups_in_flight_with_l2_every_reply_arrives \
    tests/integration/test_connections.py::test_more_connections_than_descriptors \
    tests/integration/test_lmcache.py::test_doors_serve_together \
    tests/integration/test_lmcache.py::test_killed_worker_reservations_come_back \
    tests/integration/test_lmcache.py::test_lookup_loads_what_only_l2_has \
    tests/integration/test_lmcache.py::test_status_lists_contexts \
    tests/integration/test_lmcache_events.py::test_l2_writes_loads_and_evictions \
    tests/integration/test_events.py \
    tests/integration/test_fastpath.py::test_32_concurrent_clients \
    tests/integration/test_fastpath.py::test_hostile_request_ring \
    tests/integration/test_fastpath.py::test_sigkilled_clients_leave_no_ring_behind \
    tests/integration/test_fastpath.py::test_instance_dropped_then_rehello_gets_a_new_pair

tsan: deps all $(TSAN_OBJ) $(TSAN_BIN) $(BUILD)/tsan/kvtierd pyclient
	@set -e; for t in $(TSAN_BIN); do echo "== $$t"; \
	  TSAN_OPTIONS="halt_on_error=1 exitcode=66 $$TSAN_OPTIONS" timeout 300 $$t; done
	KVT_DAEMON=$(abspath $(BUILD)/tsan/kvtierd) KVT_CLI=$(abspath $(BUILD)/kvtier) \
	  TSAN_OPTIONS="halt_on_error=1 exitcode=66 suppressions=$(abspath tests/tsan.supp) \
	  $$TSAN_OPTIONS" timeout 600 $(PYTEST) -m pytest -q -p no:cacheprovider $(TSAN_INTEGRATION)

# valgrind memcheck: every unit test, built without sanitizers (ASan and valgrind exclude each
# other) from its own objects in build/vg/. Any memcheck error, and any definite or indirect
# leak, fails the target. tests/valgrind.supp holds only library-internal false positives, each
# with its reason. VALGRIND_TESTS narrows the run (VALGRIND_TESTS="test_msg test_l1").
VG_OBJ   := $(call obj,$(BUILD)/vg,$(CORE_SRC) $(DAEMON_SRC))
VG_BIN   := $(patsubst tests/unit/%.c,$(BUILD)/vg/tests/%,$(UNIT_SRC))
# test_accept is left out: valgrind keeps descriptors of its own at the top of the open-files
# limit and refuses setrlimit(RLIMIT_NOFILE) changes, which are what that test exercises.
VALGRIND_TESTS ?= $(filter-out test_accept,$(patsubst tests/unit/%.c,%,$(UNIT_SRC)))
# --fair-sched=yes: valgrind runs one thread at a time, and by default a thread spinning on a
# lock or a flag may be rescheduled forever (test_l1_concurrent's limit test then never ends).
VALGRIND_ARGS  := --tool=memcheck --fair-sched=yes --leak-check=full \
                  --show-leak-kinds=definite,indirect \
                  --errors-for-leak-kinds=definite,indirect --error-exitcode=99 \
                  --track-origins=yes --num-callers=30 --suppressions=tests/valgrind.supp \
                  --gen-suppressions=all

$(BUILD)/vg/obj/%.o: %.c VERSION
	@mkdir -p $(dir $@)
	@echo "  CC vg   $<"
	$(Q)$(CC) $(ALLCFLAGS) -O1 -g -MMD -MP -c $< -o $@

$(BUILD)/vg/tests/%: tests/unit/%.c $(VG_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -O1 -g -o $@ $^ $(LIBS) -lcmocka

valgrind: deps $(VG_OBJ) $(VG_BIN) $(PLUGIN_EXAMPLE) $(PLUGIN_EXAMPLE_ABI1)
	@set -e; mkdir -p $(BUILD)/vg/logs; for t in $(VALGRIND_TESTS); do echo "== valgrind $$t"; \
	  $(PLUGIN_ENV) timeout 900 \
	    valgrind $(VALGRIND_ARGS) --log-file=$(BUILD)/vg/logs/$$t.log $(BUILD)/vg/tests/$$t \
	    || { tail -n 80 $(BUILD)/vg/logs/$$t.log; echo "valgrind $$t: FAILED (log: \
	    $(BUILD)/vg/logs/$$t.log)"; exit 1; }; \
	  grep -E "ERROR SUMMARY|definitely lost|indirectly lost|All heap blocks" \
	    $(BUILD)/vg/logs/$$t.log \
	    | sed 's/^==[0-9]*== */   /'; \
	done

# L1 allocator / index microbenchmark: -O2, no sanitizers, the objects of build/obj.
# `make bench-l1` runs it in full (< 60 s); BENCH_L1_ARGS=--quick for a smoke run.
BENCH_L1      := $(BUILD)/kvt-bench-l1
BENCH_L1_ARGS ?= --json $(BUILD)/bench-l1.json

$(BENCH_L1): bench/kvt_bench_l1.c $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

bench-l1: deps $(BENCH_L1)
	$(BENCH_L1) $(BENCH_L1_ARGS)

# L2 data path microbenchmark (write-behind and prefetch loads through kvt_l2mgr, hashing, the
# COMMIT checksum), -O2 without sanitizers, then on the disk BENCH_L2_DISK (a directory on the
# disk L2 would use; not tmpfs): the fs adapter against fio's sequential write and read of the
# same sizes, the open of a directory of 100,000 objects, and the redis adapter against
# redis-benchmark, each as ratios measured in the same run (about 5 min). BENCH_L2_ARGS=--quick
# for a smoke run.
BENCH_L2      := $(BUILD)/kvt-bench-l2
BENCH_L2_DISK ?= /var/tmp
BENCH_L2_ARGS ?= --json $(BUILD)/bench-l2.json --disk $(BENCH_L2_DISK)

$(BENCH_L2): bench/kvt_bench_l2.c $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

bench-l2: deps $(BENCH_L2)
	$(BENCH_L2) $(BENCH_L2_ARGS)

# First touch of a client mapping of the arena on 2 MiB pages (hugetlbfs) against 4 KiB pages
# (/dev/shm), same run (bench/kvt_bench_huge.c; < 10 s). Needs root to reserve the pages and
# mount hugetlbfs (both put back afterwards); otherwise it says so in one line and passes.
BENCH_HUGE      := $(BUILD)/kvt-bench-huge
BENCH_HUGE_ARGS ?= --json $(BUILD)/bench-huge.json

$(BENCH_HUGE): bench/kvt_bench_huge.c $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

bench-huge: deps $(BENCH_HUGE)
	$(BENCH_HUGE) $(BENCH_HUGE_ARGS)

# Request/reply round trips between two processes over a pair of shared-memory rings
# (common/kvt_ring.c, issue 17's fast path, not yet wired) against a bare ZMQ ipc echo of the
# same 64-key LOOKUP frames, same run (bench/kvt_bench_ring.c; < 30 s). `--quick`: smoke run.
BENCH_RING      := $(BUILD)/kvt-bench-ring
BENCH_RING_ARGS ?= --json $(BUILD)/bench-ring.json

$(BENCH_RING): bench/kvt_bench_ring.c $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

bench-ring: deps $(BENCH_RING)
	timeout 300 $(BENCH_RING) $(BENCH_RING_ARGS)

# A benchmark is not a test: CI runs it only in its short smoke mode, never judging timings.
bench-smoke: deps $(BENCH_L1) $(BENCH_L2) $(BENCH_HUGE) $(BENCH_RING) $(BUILD)/kvtierd \
             $(BUILD)/kvtier-bench pyclient
	$(BENCH_L1) --quick > /dev/null
	$(BENCH_L2) --quick --disk $(BENCH_L2_DISK) > /dev/null
	$(BENCH_HUGE) --quick > /dev/null
	timeout 120 $(BENCH_RING) --quick > /dev/null
	timeout 120 $(BUILD)/kvtier-bench --quick --daemon $(BUILD)/kvtierd > /dev/null
	timeout 120 $(PYTEST) bench/sglang_bench.py --quick --daemon $(BUILD)/kvtierd > /dev/null
	timeout 120 $(PYTEST) bench/media_bench.py --quick --daemon $(BUILD)/kvtierd > /dev/null

# The SGLang HiCache backend (kvtier.sglang) against memcpy of the same pages, in one process
# (bench/sglang_bench.py; < 1 min). BENCH_SGLANG_ARGS="--rounds 100 --json FILE".
bench-sglang: deps $(BUILD)/kvtierd pyclient
	timeout 600 $(PYTEST) bench/sglang_bench.py --daemon $(BUILD)/kvtierd $(BENCH_SGLANG_ARGS)

clean:
	rm -rf $(BUILD) client/python/build client/python/kvtier.egg-info client/python/kvtier/_version.py \
	  client/python/csrc

# not build/deb/: `make deb`'s copy of the tree has its own build/ (and kvtier.service.d/)
-include $(shell find $(BUILD) -path $(BUILD)/deb -prune -o -name '*.d' -type f -print 2>/dev/null)

# libkvtier's integration client: scenarios that tests/integration/test_c_client.py runs as
# separate processes. Linked against libkvtier.a alone, as an engine would link it.
$(BUILD)/kvtier-client-test: tests/integration/c_client_test.c $(BUILD)/libkvtier.a
	$(CC) $(ALLCFLAGS) -o $@ $^ $(CLIENT_LIBS)

# ---- install ------------------------------------------------------------------------------
# make install [PREFIX=/usr/local] [DESTDIR=/staging]: the daemon, the CLI, libkvtier (the .so
# under its soname with the usual links, and the .a), kvtier.h, kvtier.pc, the systemd unit
# with its sysusers.d entry, the GPU drop-in (as an example, not active), the default config and
# the man pages (kvtierd.8, kvtier.1). The config goes to SYSCONFDIR/kvtier/ (/etc when PREFIX
# is /usr, else PREFIX/etc) and never overwrites one that is there: a changed one stays and the
# new default is put beside it as kvtier.json.new. The unit names /usr/bin and /etc; for another
# PREFIX the installed copy names BINDIR and SYSCONFDIR instead. `make uninstall` removes what
# install put there, except a config file the operator changed. See docs/operations.md.
PREFIX       ?= /usr/local
DESTDIR      ?=
BINDIR       ?= $(PREFIX)/bin
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
DATADIR      ?= $(PREFIX)/share
MANDIR       ?= $(DATADIR)/man
DOCDIR       ?= $(DATADIR)/doc/kvtier
SYSCONFDIR   ?= $(if $(filter /usr,$(PREFIX)),/etc,$(PREFIX)/etc)
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
UNITDIR      ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR  ?= $(PREFIX)/lib/sysusers.d
INSTALL      ?= install
SO_NAME      := libkvtier.so.0
SO_FILE      := libkvtier.so.$(VERSION)
# paths under PREFIX are written ${prefix}/... in kvtier.pc, so that it can be relocated
pc_path       = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))

.PHONY: install uninstall

install: all
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) \
	  $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) \
	  $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 \
	  $(DESTDIR)$(DOCDIR)/examples/kvtier.service.d \
	  $(DESTDIR)$(SYSCONFDIR)/kvtier
	$(INSTALL) -m 0755 $(BUILD)/kvtierd $(BUILD)/kvtier $(DESTDIR)$(BINDIR)/
	$(INSTALL) -m 0755 $(BUILD)/libkvtier.so $(DESTDIR)$(LIBDIR)/$(SO_FILE)
	ln -sf $(SO_FILE) $(DESTDIR)$(LIBDIR)/$(SO_NAME)
	ln -sf $(SO_NAME) $(DESTDIR)$(LIBDIR)/libkvtier.so
	$(INSTALL) -m 0644 $(BUILD)/libkvtier.a $(DESTDIR)$(LIBDIR)/
	$(INSTALL) -m 0644 client/kvtier.h $(DESTDIR)$(INCLUDEDIR)/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(call pc_path,$(LIBDIR))|' \
	  -e 's|@INCLUDEDIR@|$(call pc_path,$(INCLUDEDIR))|' -e 's|@VERSION@|$(VERSION)|' \
	  client/kvtier.pc.in > $(BUILD)/kvtier.pc
	$(INSTALL) -m 0644 $(BUILD)/kvtier.pc $(DESTDIR)$(PKGCONFIGDIR)/
	sed -e 's|/usr/bin/kvtierd|$(BINDIR)/kvtierd|' -e 's|/etc/kvtier/|$(SYSCONFDIR)/kvtier/|' \
	  systemd/kvtier.service > $(BUILD)/kvtier.service
	$(INSTALL) -m 0644 $(BUILD)/kvtier.service $(DESTDIR)$(UNITDIR)/
	$(INSTALL) -m 0644 systemd/kvtier.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvtier.conf
	$(INSTALL) -m 0644 systemd/kvtier-gpu.conf $(DESTDIR)$(DOCDIR)/examples/kvtier.service.d/gpu.conf
	$(INSTALL) -m 0644 docs/kvtierd.8 $(DESTDIR)$(MANDIR)/man8/
	$(INSTALL) -m 0644 docs/kvtier.1 $(DESTDIR)$(MANDIR)/man1/
	@cfg=$(DESTDIR)$(SYSCONFDIR)/kvtier/kvtier.json; \
	if [ -e "$$cfg" ] && ! cmp -s config/kvtier.json "$$cfg"; then \
	  echo "install: keeping $$cfg (changed locally); the new default is $$cfg.new"; \
	  $(INSTALL) -m 0644 config/kvtier.json "$$cfg.new"; \
	else \
	  echo "$(INSTALL) -m 0644 config/kvtier.json $$cfg"; \
	  $(INSTALL) -m 0644 config/kvtier.json "$$cfg"; \
	fi
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ]; then echo ldconfig; ldconfig; fi

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/kvtierd $(DESTDIR)$(BINDIR)/kvtier \
	  $(DESTDIR)$(LIBDIR)/$(SO_FILE) $(DESTDIR)$(LIBDIR)/$(SO_NAME) \
	  $(DESTDIR)$(LIBDIR)/libkvtier.so $(DESTDIR)$(LIBDIR)/libkvtier.a \
	  $(DESTDIR)$(INCLUDEDIR)/kvtier.h $(DESTDIR)$(PKGCONFIGDIR)/kvtier.pc \
	  $(DESTDIR)$(UNITDIR)/kvtier.service $(DESTDIR)$(SYSUSERSDIR)/kvtier.conf \
	  $(DESTDIR)$(MANDIR)/man8/kvtierd.8 $(DESTDIR)$(MANDIR)/man1/kvtier.1 \
	  $(DESTDIR)$(DOCDIR)/examples/kvtier.service.d/gpu.conf \
	  $(DESTDIR)$(SYSCONFDIR)/kvtier/kvtier.json.new
	rmdir $(DESTDIR)$(DOCDIR)/examples/kvtier.service.d $(DESTDIR)$(DOCDIR)/examples \
	  $(DESTDIR)$(DOCDIR) 2>/dev/null || true
	@cfg=$(DESTDIR)$(SYSCONFDIR)/kvtier/kvtier.json; \
	if [ -e "$$cfg" ] && ! cmp -s config/kvtier.json "$$cfg"; then \
	  echo "uninstall: keeping $$cfg (changed locally)"; \
	else \
	  echo "rm -f $$cfg"; rm -f "$$cfg"; rmdir "$(DESTDIR)$(SYSCONFDIR)/kvtier" 2>/dev/null || true; \
	fi

# ---- Debian package -----------------------------------------------------------------------
# make deb: the .debs of debian/ (kvtier, libkvtier0, libkvtier-dev) for this machine's Debian
# (12, bookworm; debhelper 13), built by dpkg-buildpackage from a copy of the files the package
# is made of (DEB_PATHS: tracked and untracked, uncommitted changes included, ignored ones not)
# in build/deb/kvtier-VERSION/, so that the .debs, the .changes and the logs land in build/deb/.
# lintian then checks them and fails on any error (build/deb/lintian.txt). Rebuilt when one of
# those files changes (not for tests/, docs/*.md, contrib/, client/python/ ...). `make deb-test`
# installs them on this machine and checks them (tests/deb/test_deb.sh). The build runs no tests
# (nocheck: `make test` is the test suite) and no apt: deps-deb installs the tools first.
# The build's environment is env -i (a fixed PATH, C.UTF-8, the DEB_BUILD_* below): the
# caller's CC, CFLAGS, CPPFLAGS, LDFLAGS, DEB_*FLAGS_*, CUDA, CUDA_HOME, PKG_CONFIG_PATH ... do
# not reach the package. CUDA: debian/rules leaves it to the Makefile's detection, i.e. to
# whether /usr/local/cuda/bin/nvcc exists on the building machine; `make deb CUDA=0` (or
# DEB_BUILD_PROFILES=pkg.kvtier.nocuda) builds without it. Switching rebuilds.
# man-db: deb-test's `man -w`.
DEB_TOOL_PKGS := debhelper dpkg-dev lintian man-db
DEB_DIR       := $(BUILD)/deb
DEB_STAMP     := $(DEB_DIR)/.built
DEB_PATHS     := debian common protocol config l2 storage daemon client ':(exclude)client/python' \
                 systemd 'docs/*.1' 'docs/*.8' Makefile VERSION
DEB_INPUTS    := $(wildcard $(shell git ls-files -co --exclude-standard -- $(DEB_PATHS) 2>/dev/null))
DEB_PROFILES  := $(strip $(DEB_BUILD_PROFILES) \
                   $(if $(filter-out file,$(origin CUDA)),$(if $(filter 0,$(CUDA)),pkg.kvtier.nocuda)))
DEB_CONFIG    := $(BUILD)/deb-config.stamp
# initial-upload-closes-no-bugs is for uploads to the Debian archive (an ITP bug): not ours
DEB_LINTIAN_ARGS := --suppress-tags initial-upload-closes-no-bugs
DEB_ENV       := env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
                 DEB_BUILD_OPTIONS="nocheck noautodbgsym parallel=$(shell nproc)" \
                 DEB_BUILD_PROFILES="$(DEB_PROFILES)"

.PHONY: deb deb-test deps-deb

deps-deb: deps
	$(call install_missing,$(DEB_TOOL_PKGS))

deb: $(DEB_STAMP)

$(DEB_CONFIG): FORCE
	@mkdir -p $(BUILD); echo "profiles=$(DEB_PROFILES)" | cmp -s - $@ || \
	  echo "profiles=$(DEB_PROFILES)" > $@

$(DEB_STAMP): $(DEB_INPUTS) $(DEB_CONFIG) | deps-deb
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || \
	  { echo "deb: needs a git work tree (the package is built from its files)"; exit 1; }
	@v=$$(dpkg-parsechangelog -l debian/changelog -SVersion); [ "$${v%-*}" = "$(VERSION)" ] || \
	  { echo "deb: debian/changelog is at $$v but VERSION is $(VERSION):" \
	         "add an entry (dch -v $(VERSION)-1)"; exit 1; }
	rm -rf $(DEB_DIR)
	mkdir -p $(DEB_DIR)/kvtier-$(VERSION)
	git ls-files -z -co --exclude-standard -- $(DEB_PATHS) | \
	  tar --null --ignore-failed-read -T - -cf - | tar -xf - -C $(DEB_DIR)/kvtier-$(VERSION)
	@echo "deb: dpkg-buildpackage -b -us -uc$(if $(DEB_PROFILES), (profiles: $(DEB_PROFILES))) (log: $(DEB_DIR)/build.log)"
	@cd $(DEB_DIR)/kvtier-$(VERSION) && $(DEB_ENV) dpkg-buildpackage -b -us -uc \
	  > ../build.log 2>&1 || { tail -n 40 ../build.log; echo "deb: dpkg-buildpackage failed"; exit 1; }
	@echo "deb: lintian (log: $(DEB_DIR)/lintian.txt)"
	@lintian --fail-on error $(DEB_LINTIAN_ARGS) $(DEB_DIR)/kvtier_*.changes \
	  > $(DEB_DIR)/lintian.txt 2>&1; rc=$$?; \
	  cat $(DEB_DIR)/lintian.txt; [ $$rc = 0 ] || { echo "deb: lintian found errors"; exit 1; }
	@ls $(DEB_DIR)/*.deb
	@touch $@

# --foreground: a timeout signals the script alone, never a dpkg it is running (the script's
# trap purges after dpkg returns); -k: KILL 60 s later if it still has not ended.
deb-test: $(DEB_STAMP)
	timeout --foreground -k 60 300 tests/deb/test_deb.sh $(DEB_DIR)

# ---- end-to-end benchmark -----------------------------------------------------------------
# kvtier-bench drives a kvtierd it starts itself (private run dir, ipc) through libkvtier, with
# its baselines (ZMQ echo, memcpy, redis-server) measured in the same run; see
# docs/performance.md. `make bench` runs it in full (< 5 min): table to stdout, JSON to
# build/bench.json. `make bench-smoke` runs its --quick mode, which judges no timing.
BENCH      := $(BUILD)/kvtier-bench
BENCH_ARGS ?= --json $(BUILD)/bench.json
# bench/media_bench.py: one 9 MiB item written once, read by 4 worker processes, against a
# shared-memory ring buffer and a ZMQ socket (issue 33; < 1 min)
BENCH_MEDIA_ARGS ?= --json $(BUILD)/bench-media.json

.PHONY: bench

$(BENCH): bench/kvtier_bench.c $(BUILD)/libkvtier.a
	$(CC) $(ALLCFLAGS) -O2 -o $@ $^ $(CLIENT_LIBS) \
	  $(shell pkg-config --libs libczmq hiredis 2>/dev/null) -lpthread

bench: deps $(BUILD)/kvtierd $(BENCH) $(BENCH_HUGE) $(BENCH_RING) pyclient
	timeout 600 $(BENCH) --daemon $(BUILD)/kvtierd $(BENCH_ARGS)
	timeout 120 $(BENCH_HUGE) $(BENCH_HUGE_ARGS)
	timeout 300 $(BENCH_RING) $(BENCH_RING_ARGS)
	timeout 300 $(PYTEST) bench/media_bench.py --daemon $(BUILD)/kvtierd $(BENCH_MEDIA_ARGS)

# ---- fuzzing ------------------------------------------------------------------------------
# libFuzzer harnesses (tests/fuzz/), built with clang and ASan+UBSan from the sources they
# need (not the gcc objects): fuzz_decode drives the request decoder (kvt_msg_decode,
# kvt_msg_prescan, kvt_msg_read_uint), fuzz_config the JSON config loader and its
# --print-config round trip, fuzz_lmc the LMCache MP wire's decoders and error encoder
# (kvt_lmc_*), fuzz_ring the shared-memory ring's consumer and producer against a hostile
# peer (kvt_ring_*). `make fuzz` runs each for FUZZ_SECONDS on a fresh copy of its seed corpus in
# build/fuzz/ (the repo's corpus is never written); any crash, leak, timeout or sanitizer
# report fails it, the input left in build/fuzz/artifacts/. `make fuzz-smoke` is the CI run
# (30 s each, fuzz_ring 20 s: its input space is small; `make check` runs each for 600 s). Seeds: tests/fuzz/corpus/; decode, lmc
# and ring seeds come from tests/fuzz/gen_corpus.py.
FUZZ_CC       ?= clang
FUZZ_SECONDS  ?= 60
FUZZ_DEB_PKGS := clang libclang-rt-14-dev
FUZZ_DIR      := $(BUILD)/fuzz
FUZZ_SAN      := -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
                 -fno-omit-frame-pointer -g -O1
FUZZ_CFLAGS    = -std=gnu11 $(WARN) -D_GNU_SOURCE -DKVT_VERSION='"$(VERSION)"' $(INC) $(FUZZ_SAN)
FUZZ_RUN_ARGS  = -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
                 -print_final_stats=1
FUZZ_DECODE_SRC := tests/fuzz/fuzz_decode.c protocol/kvt_msg.c protocol/kvt_proto.c \
                   common/kvt_error.c common/kvt_log.c common/kvt_utf8.c
FUZZ_CONFIG_SRC := tests/fuzz/fuzz_config.c config/kvt_config.c common/kvt_error.c common/kvt_log.c \
                   common/kvt_size.c
FUZZ_LMC_SRC    := tests/fuzz/fuzz_lmc.c protocol/kvt_lmc.c protocol/kvt_msg.c protocol/kvt_proto.c \
                   common/kvt_error.c common/kvt_log.c daemon/kvt_lmc_registry.c common/kvt_u64map.c \
                   common/kvt_utf8.c
FUZZ_RING_SRC   := tests/fuzz/fuzz_ring.c common/kvt_ring.c common/kvt_error.c
FUZZ_JOURNAL_SRC := tests/fuzz/fuzz_journal.c storage/kvt_journal.c common/kvt_error.c
FUZZ_SEGLOG_SRC := tests/fuzz/fuzz_seglog.c l2/kvt_seglog.c common/kvt_error.c common/kvt_log.c
FUZZ_TARGETS  := decode config lmc ring journal seglog
FUZZ_BINS     := $(addprefix $(FUZZ_DIR)/fuzz_,$(FUZZ_TARGETS))
# Seconds per target: FUZZ_SECONDS, except where FUZZ_SECONDS_<target> says otherwise.
FUZZ_SECONDS_ring ?= $(FUZZ_SECONDS)

.PHONY: fuzz fuzz-smoke fuzz-build fuzz-deps

# Like deps: installs clang and libFuzzer's runtime when missing, nothing otherwise.
fuzz-deps: deps
	@missing=""; for p in $(FUZZ_DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "fuzz-deps: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(FUZZ_DIR)/fuzz_decode: $(FUZZ_DECODE_SRC) $(wildcard common/*.h protocol/*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(shell pkg-config --cflags msgpack 2>/dev/null) -o $@ \
	  $(FUZZ_DECODE_SRC) $(shell pkg-config --libs msgpack 2>/dev/null)

$(FUZZ_DIR)/fuzz_lmc: $(FUZZ_LMC_SRC) $(wildcard common/*.h protocol/*.h) daemon/kvt_lmc_registry.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(shell pkg-config --cflags msgpack 2>/dev/null) -o $@ \
	  $(FUZZ_LMC_SRC) $(shell pkg-config --libs msgpack libxxhash libczmq 2>/dev/null)

$(FUZZ_DIR)/fuzz_ring: $(FUZZ_RING_SRC) common/kvt_ring.h common/kvt_error.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $(FUZZ_RING_SRC)

$(FUZZ_DIR)/fuzz_journal: $(FUZZ_JOURNAL_SRC) tests/fuzz/fuzz_input.h storage/kvt_journal.h common/kvt_key.h common/kvt_le.h common/kvt_error.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $(FUZZ_JOURNAL_SRC) -lxxhash

$(FUZZ_DIR)/fuzz_seglog: $(FUZZ_SEGLOG_SRC) tests/fuzz/fuzz_input.h l2/kvt_seglog.h common/kvt_error.h common/kvt_log.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $(FUZZ_SEGLOG_SRC) -lxxhash

$(FUZZ_DIR)/fuzz_config: $(FUZZ_CONFIG_SRC) $(wildcard common/*.h config/*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(shell pkg-config --cflags jansson 2>/dev/null) -o $@ \
	  $(FUZZ_CONFIG_SRC) $(shell pkg-config --libs jansson 2>/dev/null) -lm

fuzz-build: fuzz-deps
	@$(MAKE) --no-print-directory $(FUZZ_BINS)

# Each run starts from a fresh copy of the seeds; libFuzzer exits non-zero on any finding. The
# fuzzers run FUZZ_JOBS at a time (each is one process on one core).
FUZZ_JOBS ?= 2
fuzz: fuzz-build
	@mkdir -p $(FUZZ_DIR)/artifacts
	@$(MAKE) --no-print-directory -j$(FUZZ_JOBS) $(addprefix fuzz-run-,$(FUZZ_TARGETS))

fuzz-run-%: FORCE
	@rm -rf $(FUZZ_DIR)/corpus-$*; mkdir -p $(FUZZ_DIR)/corpus-$*
	@cp tests/fuzz/corpus/$*/* $(FUZZ_DIR)/corpus-$*/
	@secs=$(FUZZ_SECONDS); [ $* != ring ] || secs=$(FUZZ_SECONDS_ring); \
	echo "== fuzz_$* ($$secs s)"; \
	$(FUZZ_DIR)/fuzz_$* $(FUZZ_RUN_ARGS) -max_total_time=$$secs -dict=tests/fuzz/$*.dict \
	  -artifact_prefix=$(abspath $(FUZZ_DIR))/artifacts/$*- $(FUZZ_DIR)/corpus-$* \
	  > $(FUZZ_DIR)/fuzz_$*.log 2>&1 || { tail -n 60 $(FUZZ_DIR)/fuzz_$*.log; \
	  echo "fuzz_$*: FAILED (log: $(FUZZ_DIR)/fuzz_$*.log, input: $(FUZZ_DIR)/artifacts/)"; \
	  exit 1; }; \
	echo "fuzz_$*: $$(grep -E '^(Done|stat::)' $(FUZZ_DIR)/fuzz_$*.log | tr '\n' ' ')"

fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=30 FUZZ_SECONDS_ring=20

# ---- contrib: Prometheus rules and Grafana dashboard --------------------------------------
# `make check-contrib`: promtool checks contrib/prometheus/kvtier-rules.yml and runs its unit
# tests (tests/prometheus/kvtier-rules.test.yml); tests/integration/test_contrib.py (in `make
# integration`) checks the rules and contrib/grafana/kvtier.json against a live daemon.
# promtool comes from Debian's prometheus package (DEB_OPS_PKGS), which is NOT installed here:
# its postinst enables and starts prometheus.service on a systemd host (a server on *:9090
# with its own user and TSDB), too much to leave behind for one checker. The promtool on PATH
# is used when there is one (/usr/bin/promtool where prometheus is installed); otherwise
# deps-ops downloads the package (apt-get download, nothing installed, no service) and takes
# only usr/bin/promtool out of it into build/ops/.
DEB_OPS_PKGS := prometheus
PROMTOOL     ?= $(or $(shell command -v promtool 2>/dev/null),$(BUILD)/ops/promtool)

deps-ops: $(filter $(BUILD)/%,$(PROMTOOL))

$(BUILD)/ops/promtool:
	@rm -rf $(BUILD)/ops/deb && mkdir -p $(BUILD)/ops/deb
	@echo "deps-ops: extracting promtool from Debian's $(DEB_OPS_PKGS) (not installed)"
	@cd $(BUILD)/ops/deb && { apt-get download -q $(DEB_OPS_PKGS) 2>/dev/null || { \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get update -q && \
	  apt-get download -q $(DEB_OPS_PKGS); }; }
	dpkg-deb --fsys-tarfile $(BUILD)/ops/deb/$(DEB_OPS_PKGS)_*.deb | \
	  tar -x -O ./usr/bin/promtool > $@.tmp
	@chmod 0755 $@.tmp && mv $@.tmp $@ && rm -rf $(BUILD)/ops/deb
	@$@ --version 2>&1 | head -n 1

check-contrib: deps-ops
	$(PROMTOOL) check rules contrib/prometheus/kvtier-rules.yml
	$(PROMTOOL) test rules tests/prometheus/kvtier-rules.test.yml

# ---- status page (GET /) ------------------------------------------------------------------
# daemon/kvt_status_page.html is embedded into kvt_http.o of every build (obj, asan, tsan, vg)
# as a C byte list that od (coreutils, no extra package) writes into build/gen/; kvt_http.c
# #includes it. Its Content-Security-Policy allows the page's one inline script by its hash:
# build/gen/kvt_status_page_csp.h defines KVT_STATUS_PAGE_SCRIPT_HASH, 'sha256-' and the base64
# of the SHA-256 of the bytes between the page's <script> and </script> lines (each alone on its
# line), with coreutils only (sha256sum, printf, base64), as a package build has no python3.
# The integration test loads the page in Debian's headless Chromium and checks the hash.
DEB_UI_PKGS   := chromium
STATUS_PAGE   := $(BUILD)/gen/kvt_status_page.inc
STATUS_CSP    := $(BUILD)/gen/kvt_status_page_csp.h
KVT_HTTP_OBJS := $(filter %/daemon/kvt_http.o,$(CORE_OBJ) $(ASAN_OBJ) $(TSAN_OBJ) $(VG_OBJ))

.PHONY: deps-ui

$(STATUS_PAGE): daemon/kvt_status_page.html
	$(embed_bytes)

$(STATUS_CSP): daemon/kvt_status_page.html
	@mkdir -p $(dir $@)
	test "$$(grep -c '<script' $<)" = 1 && test "$$(grep -cx '<script>' $<)" = 1 \
	  && test "$$(grep -cx '</script>' $<)" = 1 \
	  || { echo "$<: needs one <script> and one </script> line" >&2; exit 1; }
	{ echo; sed -n '/^<script>$$/,/^<\/script>$$/{/^<\/\{0,1\}script>$$/!p;}' $<; } > $@.js \
	  && sum=$$(sha256sum $@.js | cut -c1-64) && test $${#sum} = 64 \
	  && b64=$$(/usr/bin/printf "$$(echo $$sum | sed 's/../\\x&/g')" | base64 -w0) \
	  && test $${#b64} = 44 \
	  && printf '#define KVT_STATUS_PAGE_SCRIPT_HASH "sha256-%s"\n' "$$b64" > $@.tmp \
	  && mv $@.tmp $@ && rm -f $@.js || { rm -f $@.js $@.tmp; exit 1; }

$(KVT_HTTP_OBJS): $(STATUS_PAGE) $(STATUS_CSP)
$(KVT_HTTP_OBJS): ALLCFLAGS += -I$(BUILD)/gen

deps-ui: deps
	$(call install_missing,$(DEB_UI_PKGS))

integration: deps-ui
