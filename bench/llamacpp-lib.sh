# Sourced by bench/llamacpp-compare and bench/synth-model: llama.cpp (llama-cpp-python,
# compiled from source into "$venv") built for this CPU. Expects $venv and $target; sets
# $cmake_args and $amx_note, and defines build_llamacpp and rebuild_without_amx_if_crashing.
#
# llama.cpp is built natively for this CPU, except AMX where it cannot run: some Xeons
# report AMX, but tile instructions fault unless the process first asks the kernel for tile
# state (arch_prctl ARCH_REQ_XCOMP_PERM), and a native llama.cpp build then dies with a
# general-protection fault in ggml_backend_amx_mul_mat on its first matrix product.
# bench/probe/amx.c checks the OS side; a short smoke run checks the build itself; if
# either fails, llama.cpp is rebuilt with AMX off and the AVX-512 features the CPU has
# turned on explicitly.
has() { grep -qw "$1" /proc/cpuinfo; }
no_amx_args() {
  local a="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  a="$a -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  has avx512f && a="$a -DGGML_AVX512=ON"
  has avx512_vnni && a="$a -DGGML_AVX512_VNNI=ON"
  has avx512_bf16 && a="$a -DGGML_AVX512_BF16=ON"
  has avx512vbmi && a="$a -DGGML_AVX512_VBMI=ON"
  has avx_vnni && a="$a -DGGML_AVX_VNNI=ON"
  echo "$a"
}
build_llamacpp() {
  if ! "$venv/bin/python" -c 'import llama_cpp, gguf' 2>/dev/null || [ "$(cat "$venv/.cmake-args" 2>/dev/null)" != "$1" ]; then
    echo "== building llama.cpp (llama-cpp-python) into $venv with CMAKE_ARGS=$1"
    python3 -m venv "$venv"
    CMAKE_ARGS="$1" "$venv/bin/pip" install --quiet --disable-pip-version-check \
      --force-reinstall --no-cache-dir llama-cpp-python 'gguf==0.19.0'
    echo "$1" > "$venv/.cmake-args"
  fi
}
cmake_args="-DGGML_NATIVE=ON"
amx_note="no AMX reported"
if [ -e "$venv/.native-build-crashed" ]; then
  # An earlier run found the native (AMX) build crashing on this machine.
  amx_note="AMX reported, but a native llama.cpp build crashed here before: built without AMX"
  cmake_args=$(no_amx_args)
elif has amx_tile; then
  probe="$target/amx-probe"
  if gcc -O1 -mamx-tile -mamx-int8 -o "$probe" bench/probe/amx.c 2>/dev/null && "$probe" >/dev/null 2>&1; then
    amx_note="AMX reported and usable by a process that requests tile state"
  else
    amx_note="AMX reported but unusable here: llama.cpp built without AMX"
    cmake_args=$(no_amx_args)
  fi
fi
echo "== llama.cpp: $amx_note"
build_llamacpp "$cmake_args"
# A native build that crashes on its first matrix product (its AMX path) is rebuilt with
# AMX off; $1 is a model file to try it on. Only a crash (a signal) counts: a script error
# says nothing about AMX.
rebuild_without_amx_if_crashing() {
  local rc=0
  "$venv/bin/python" "$(dirname "${BASH_SOURCE[0]}")/llamacpp_bench.py" "$1" --threads 2 --smoke > /dev/null 2>&1 || rc=$?
  if [ "$rc" -ge 128 ]; then
    if [ "$cmake_args" = "-DGGML_NATIVE=ON" ] && has amx_tile; then
      echo "== the native llama.cpp build crashed (its AMX path); rebuilding it with AMX off"
      touch "$venv/.native-build-crashed"
      cmake_args=$(no_amx_args)
      build_llamacpp "$cmake_args"
    fi
  fi
}
