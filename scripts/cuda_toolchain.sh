# shellcheck shell=bash
# The PyPI CUDA 13.0 toolchain in .cache/cuda, for machines with no GPU and no system CUDA. Sourced (not
# run) by .ci/cuda-check and scripts/build_cuda_artifacts.sh from the repository root.
#
# `cuda_toolchain [PIN...]` pip-installs the toolchain wheels below, plus any PINs (libraries to link
# against), into the venv .cache/cuda unless its stamp file says they are there already, so only the first
# run downloads anything (~100 MB for the compiler alone). It then points PATH, CUDA_HOME, CUDA_PATH and
# CUDA_ROOT at the toolchain (nvcc for kernels/build.rs and candle's kernels, `nvcc --version` for cudarc)
# and sets CUDA_DIR to its root (bin/nvcc, include/, lib/).
#
# Every pin stays at 13.0: PTX written by a newer nvcc needs a newer driver than the GPU machines have
# (580, CUDA 13.0). The 12.x nvcc wheels hold no nvcc.

CUDA_TOOLCHAIN_PINS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.*"
  "nvidia-cuda-crt==13.0.*"
  "nvidia-cuda-cccl<13.1"
  "nvidia-cuda-runtime==13.0.*"
)

cuda_toolchain() {
  local venv=.cache/cuda
  local stamp=$venv/askgui-pins
  local pin missing=()
  for pin in "${CUDA_TOOLCHAIN_PINS[@]}" "$@"; do
    grep -qxF -- "$pin" "$stamp" 2>/dev/null || missing+=("$pin")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "cuda toolchain: installing ${missing[*]} into $venv" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${missing[@]}"
    printf '%s\n' "${missing[@]}" >>"$stamp"
  fi
  local roots=("$venv"/lib/python3*/site-packages/nvidia/cu13)
  if [ ! -x "${roots[0]}/bin/nvcc" ]; then
    echo "cuda toolchain: no nvcc under $venv; delete $venv and run again" >&2
    return 1
  fi
  # The physical path: cargo reruns build scripts (candle's kernels take minutes) whenever the text of
  # CUDA_HOME changes, so one toolchain must always be named the same way, through a symlink or not.
  CUDA_DIR=$(cd "${roots[0]}" && pwd -P)
  export PATH="$CUDA_DIR/bin:$PATH" CUDA_HOME="$CUDA_DIR" CUDA_PATH="$CUDA_DIR" CUDA_ROOT="$CUDA_DIR"
  # kernels/build.rs prefers $NVCC to CUDA_HOME: a stray one would compile with another toolkit.
  unset NVCC
}
