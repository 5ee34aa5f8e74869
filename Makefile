# kvtier — the one build entry point. `make run` and `make test` are the two set-up commands:
# both install missing Debian packages first (deps), then build.

CC       ?= gcc
PYTHON   := /usr/bin/python3
BUILD    := build
# make Q= shows every compiler command
Q        ?= @
VERSION  := 0.1.0

PKGS     := libzmq libczmq msgpack jansson libmicrohttpd libxxhash
DEB_PKGS := build-essential pkg-config libzmq3-dev libczmq-dev libmsgpack-dev libjansson-dev \
            libmicrohttpd-dev libxxhash-dev libcmocka-dev python3-zmq python3-msgpack \
            python3-pytest python3-xxhash curl

WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Werror
INC      := -Icommon -Iprotocol -Iconfig -Istorage -Il2 -Idaemon -Iclient
CFLAGS   ?= -O2 -g
ALLCFLAGS = -std=gnu11 $(WARN) $(CFLAGS) -fPIC -D_GNU_SOURCE -DKVT_VERSION='"$(VERSION)"' $(INC) \
            $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LIBS     = $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lpthread -lm
SAN      := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

CORE_SRC   := $(wildcard common/*.c protocol/*.c config/*.c storage/*.c l2/*.c)
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLIENT_SRC := $(filter-out client/kvtier_cli.c,$(wildcard client/*.c))
UNIT_SRC   := $(wildcard tests/unit/test_*.c)

obj = $(patsubst %.c,$(1)/obj/%.o,$(2))

CORE_OBJ   := $(call obj,$(BUILD),$(CORE_SRC) $(DAEMON_SRC))
CLIENT_OBJ := $(call obj,$(BUILD),$(CLIENT_SRC) common/kvt_error.c protocol/kvt_msg.c \
                protocol/kvt_proto.c protocol/kvt_hash.c)
CLIENT_LIBS = $(shell pkg-config --libs libzmq msgpack jansson libxxhash 2>/dev/null)
ASAN_OBJ   := $(call obj,$(BUILD)/asan,$(CORE_SRC) $(DAEMON_SRC))
UNIT_BIN   := $(patsubst tests/unit/%.c,$(BUILD)/asan/tests/%,$(UNIT_SRC))

.PHONY: all deps run test unit integration asan clean check-asan tsan bench-l1 bench-smoke
.DEFAULT_GOAL := all

all: $(BUILD)/kvtierd $(BUILD)/kvtier $(BUILD)/libkvtier.a $(BUILD)/libkvtier.so

# Installs what is missing, once; nothing when every package is present.
deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(ALLCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/asan/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  CC asan $<"
	$(Q)$(CC) $(ALLCFLAGS) -O1 $(SAN) -MMD -MP -c $< -o $@

$(BUILD)/kvtierd: $(BUILD)/obj/daemon/main.o $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/asan/kvtierd: $(BUILD)/asan/obj/daemon/main.o $(ASAN_OBJ)
	$(CC) $(ALLCFLAGS) $(SAN) -o $@ $^ $(LIBS)

$(BUILD)/libkvtier.a: $(sort $(CLIENT_OBJ))
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libkvtier.so: $(sort $(CLIENT_OBJ))
	$(CC) $(ALLCFLAGS) -shared -Wl,-soname,libkvtier.so.0 -o $@ $^ $(CLIENT_LIBS)

$(BUILD)/kvtier: $(BUILD)/obj/client/kvtier_cli.o $(BUILD)/libkvtier.a
	$(CC) $(ALLCFLAGS) -o $@ $^ $(CLIENT_LIBS)

$(BUILD)/asan/tests/%: tests/unit/%.c $(ASAN_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -O1 $(SAN) -o $@ $^ $(LIBS) -lcmocka

asan: $(BUILD)/asan/kvtierd

run: deps all
	@mkdir -p var/run var/data
	exec $(BUILD)/kvtierd

unit: deps $(UNIT_BIN)
	@set -e; for t in $(UNIT_BIN); do echo "== $$t"; timeout 120 $$t; done

# Integration tests run against the ASan+UBSan daemon; a sanitizer report fails the test.
integration: deps all asan
	KVT_DAEMON=$(abspath $(BUILD)/asan/kvtierd) KVT_CLI=$(abspath $(BUILD)/kvtier) \
	  timeout 900 $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

check-asan: unit integration

test: deps all unit tsan integration bench-smoke

# ThreadSanitizer: the L1 concurrency test, built with its own objects in build/tsan/ (a TSan
# report fails the target: halt_on_error, and TSan's non-zero exit code). The objects are
# named as prerequisites of `tsan` so make keeps them (not intermediates).
TSAN      := -fsanitize=thread -fno-omit-frame-pointer
TSAN_OBJ  := $(call obj,$(BUILD)/tsan,$(CORE_SRC) $(DAEMON_SRC))
TSAN_BIN  := $(BUILD)/tsan/tests/test_l1_concurrent

$(BUILD)/tsan/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  CC tsan $<"
	$(Q)$(CC) $(ALLCFLAGS) -O1 -g $(TSAN) -MMD -MP -c $< -o $@

$(BUILD)/tsan/tests/%: tests/unit/%.c $(TSAN_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -O1 -g $(TSAN) -o $@ $^ $(LIBS) -lcmocka

tsan: deps $(TSAN_OBJ) $(TSAN_BIN)
	@set -e; for t in $(TSAN_BIN); do echo "== $$t"; \
	  TSAN_OPTIONS="halt_on_error=1 exitcode=66 $$TSAN_OPTIONS" timeout 300 $$t; done

# L1 allocator / index microbenchmark: -O2, no sanitizers, the objects of build/obj.
# `make bench-l1` runs it in full (< 60 s); BENCH_L1_ARGS=--quick for a smoke run.
BENCH_L1      := $(BUILD)/kvt-bench-l1
BENCH_L1_ARGS ?= --json $(BUILD)/bench-l1.json

$(BENCH_L1): bench/kvt_bench_l1.c $(CORE_OBJ)
	$(CC) $(ALLCFLAGS) -o $@ $^ $(LIBS)

bench-l1: deps $(BENCH_L1)
	$(BENCH_L1) $(BENCH_L1_ARGS)

# A benchmark is not a test: CI runs it only in its short smoke mode, never judging timings.
bench-smoke: deps $(BENCH_L1)
	$(BENCH_L1) --quick > /dev/null

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
