#!/bin/bash
# Packs the GPU test and benchmark for a GPU machine that has the NVIDIA driver and CUDA but not
# Debian's libraries (libzmq, czmq, msgpack-c, ...) and no package mirror — the lent machines
# of this project (Ubuntu 24.04 images, glibc 2.39): builds here (make, with the CUDA toolkit),
# copies kvtierd, kvt-test-gpu, kvt-bench-gpu and every shared library they load except glibc's
# own into DIR (default .devbundle, which .git/info/exclude should list), and writes DIR/run.sh,
# which runs test-gpu then bench-gpu there with LD_LIBRARY_PATH on the bundle and leaves the
# daemons' logs and the benchmark's JSON in $OUT (or /tmp/kvt-gpu-out).
#
#   tests/gpu/device-bundle.sh [DIR]       # here
#   bash DIR/run.sh                        # there; BENCH_ARGS="--modes auto" to narrow
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.devbundle}
make -s all build/kvt-test-gpu build/kvt-bench-gpu
rm -rf "$dir"
mkdir -p "$dir/lib"
cp build/kvtierd build/kvt-test-gpu build/kvt-bench-gpu "$dir/"
ldd build/kvtierd build/kvt-test-gpu build/kvt-bench-gpu | awk '/=>/ && $3 ~ /^\// {print $3}' |
    sort -u | while read -r lib; do
    case "$(basename "$lib")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libresolv.so* | ld-linux*) ;;
    *) cp -L "$lib" "$dir/lib/" ;;
    esac
done
cat > "$dir/run.sh" << 'EOF'
#!/bin/bash
# test-gpu and bench-gpu from binaries built on Debian 12 (tests/gpu/device-bundle.sh)
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
OUT=${OUT:-/tmp/kvt-gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader
ldd ./kvtierd ./kvt-test-gpu ./kvt-bench-gpu | grep "not found"
echo "== test-gpu"; timeout 240 ./kvt-test-gpu --daemon ./kvtierd; echo "test-gpu rc=$?"
for d in /tmp/kvt-gpu-*; do echo "## $d"; cat "$d/kvtierd.log"; done > "$OUT/test.log" 2>&1
rm -rf /tmp/kvt-gpu-*
echo "== bench-gpu $BENCH_ARGS"
timeout 400 ./kvt-bench-gpu --daemon ./kvtierd --json "$OUT/bench-gpu.json" ${BENCH_ARGS:-}
echo "bench-gpu rc=$?"
for d in /tmp/kvt-gpu-*; do echo "## $d"; cat "$d/kvtierd.log"; done > "$OUT/bench.log" 2>&1
grep -h "warn\|err" "$OUT"/*.log | sort | uniq -c | sort -rn | head -20
EOF
chmod +x "$dir/run.sh"
echo "$dir: $(du -sh "$dir" | cut -f1); run: bash $dir/run.sh"
