#!/usr/bin/env bash
# Runs the Elixir tests on a GPU machine that has no Erlang, no Elixir, no cargo and no network
# (the project's device machine, see shared/docs/GPU.md), with a NIF built elsewhere.
#
# Prepare on the development machine (Debian 12, x86-64), from the repository root:
#
#   (cd elixir && mix compile)                  # builds elixir/priv/libflash_nif.so with cargo
#   mkdir -p elixir/.gpu_debs && (cd elixir/.gpu_debs && apt-get download elixir erlang-base \
#     erlang-crypto erlang-inets erlang-parsetools erlang-public-key erlang-tools erlang-asn1 \
#     erlang-syntax-tools erlang-runtime-tools erlang-mnesia erlang-ssl erlang-ftp erlang-tftp \
#     libssl3 libtinfo6)                        # ~22 MB; elixir/.gpu_debs is git-ignored
#
# then carry elixir/.gpu_debs and elixir/priv to the GPU machine and run, from the repository root:
#
#   bash elixir/scripts/gpu_test.sh             # mix test --only cuda, then the whole suite
#
# It unpacks the .debs with `dpkg -x` into a temporary directory (nothing is installed), points
# erl's ROOTDIR there, and runs mix with FLASH_NIF_SKIP_BUILD=1 (the prebuilt NIF in priv/, no
# cargo) and FLASH_NIF_TEST_CUDA=1 (the :cuda tests are required: they fail, not skip, without a
# usable GPU). Logs go to $OUT (or $FLASH_NIF_LOG_DIR) when set. Environment:
#   FLASH_NIF_DEBS   the .deb folder (default elixir/.gpu_debs)
#   FLASH_NIF_LIB    a prebuilt libflash_nif.so to install into priv/ first (e.g. one built from
#                    a clean checkout and carried in an ignored folder such as elixir/.gpu_nif)
#   GPU_TEST_ONLY=1  run only `mix test --only cuda`, not the whole suite afterwards
#   GPU_BENCH=1      then run bench/exphil.exs on the GPU and on the CPU (logged to exphil.log)
#   GPU_BENCH_ONLY=1 run only the benchmark (no tests)
#   BENCH_DEVICES    the benchmark's devices (default "cuda cpu"); EXPHIL_ARGS: more arguments
#                    for it (e.g. "--budget 0.5")
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # the elixir/ project
debs="${FLASH_NIF_DEBS:-$here/.gpu_debs}"
logdir="${FLASH_NIF_LOG_DIR:-${OUT:-}}"
log() { if [ -n "$logdir" ]; then tee -a "$logdir/$1"; else cat; fi; }

if [ -n "${FLASH_NIF_LIB:-}" ]; then
  mkdir -p "$here/priv" && cp "$FLASH_NIF_LIB" "$here/priv/libflash_nif.so" || exit 2
fi
[ -f "$here/priv/libflash_nif.so" ] || { echo "missing $here/priv/libflash_nif.so: run 'mix compile' where cargo is, and carry elixir/priv"; exit 2; }
ls "$debs"/*.deb >/dev/null 2>&1 || { echo "no .deb files in $debs (see the top of this script)"; exit 2; }
[ -n "$logdir" ] && mkdir -p "$logdir"

{
  echo "== machine"
  grep -E '^PRETTY_NAME=' /etc/os-release 2>/dev/null
  uname -srm
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 || true
  ldconfig -p 2>/dev/null | grep -E 'libnvrtc\.so|libcuda\.so\.1' | head -4
} 2>&1 | log gpu_test.log

# 1. Erlang/OTP and Elixir from the .debs, into a private root.
root="$(mktemp -d /tmp/flash_nif_beam.XXXXXX)"
for f in "$debs"/*.deb; do dpkg -x "$f" "$root" || { echo "dpkg -x $f failed"; exit 2; }; done
erlroot="$root/usr/lib/erlang"
# The Debian scripts hard-code ROOTDIR=/usr/lib/erlang; point them at the unpacked tree.
for s in "$erlroot"/bin/erl "$erlroot"/bin/start "$erlroot"/erts-*/bin/erl "$erlroot"/erts-*/bin/start; do
  [ -f "$s" ] && sed -i "s|/usr/lib/erlang|$erlroot|g" "$s"
done
export PATH="$root/usr/bin:$PATH"
# Shared libraries the BEAM and crypto need (libtinfo, libcrypto 3): the machine's own when it
# has them, else the bookworm copies carried in the .debs.
if ldd "$erlroot"/erts-*/bin/beam.smp "$erlroot"/lib/crypto-*/priv/lib/crypto.so 2>/dev/null | grep -q 'not found'; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
  echo "using the carried libtinfo/libcrypto from $root" | log gpu_test.log
fi
# NVRTC: the machine's libnvrtc.so.13 is found by soname; pip's copy in the torch venv is the
# fallback flash-core searches (VIRTUAL_ENV's site-packages) when the system has none.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d /opt/torch/.venv ]; then export VIRTUAL_ENV=/opt/torch/.venv; fi

export LANG=C.UTF-8 LC_ALL=C.UTF-8
export MIX_HOME="$root/mix_home" HEX_OFFLINE=1 MIX_ENV=test
export FLASH_NIF_SKIP_BUILD=1 FLASH_NIF_TEST_CUDA=1
cd "$here" || exit 2

echo "== $(elixir --version 2>&1 | tail -1) on $(erl -noshell -eval 'io:format("OTP ~s at ~s", [erlang:system_info(otp_release), code:root_dir()]), halt().')" | log gpu_test.log

status=0
if [ "${GPU_BENCH_ONLY:-0}" = "1" ]; then
  GPU_BENCH=1 GPU_TEST_ONLY=1
else
  echo "== mix test --only cuda" | log gpu_test.log
  mix test --only cuda 2>&1 | log gpu_test.log
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=$rc
  echo "== mix test --only cuda: exit $rc" | log gpu_test.log
fi

if [ "${GPU_TEST_ONLY:-0}" != "1" ]; then
  echo "== mix test (the whole suite, :cuda included)" | log gpu_test.log
  mix test 2>&1 | log gpu_test.log
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=$rc
  echo "== mix test: exit $rc" | log gpu_test.log
fi

if [ "${GPU_BENCH:-0}" = "1" ]; then
  for dev in ${BENCH_DEVICES:-cuda cpu}; do
    echo "== bench/exphil.exs --device $dev ${EXPHIL_ARGS:-}" | log exphil.log
    # shellcheck disable=SC2086  # EXPHIL_ARGS: words
    mix run ../bench/exphil.exs --device "$dev" ${EXPHIL_ARGS:-} 2>&1 | log exphil.log
  done
fi

rm -rf "$root"
exit "$status"
