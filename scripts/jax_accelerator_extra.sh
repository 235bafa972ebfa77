#!/usr/bin/env sh
# Prints the jax extra for this machine's accelerator: "cuda13" or "cuda12" when an NVIDIA
# driver answers (chosen by the CUDA version the driver supports), nothing otherwise (CPU).
# Used by the Makefile so that `make demo` on a GPU machine installs jax's CUDA wheels.
command -v nvidia-smi >/dev/null 2>&1 || exit 0
ver=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
[ -n "$ver" ] || exit 0
if [ "$ver" -ge 13 ]; then echo cuda13; elif [ "$ver" -ge 12 ]; then echo cuda12; fi
