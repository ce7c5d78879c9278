// The CPU executor's stand-in for CUDA's header: wmma is in cuda_emu_wmma.h.
#pragma once
#include "cuda_emu.h"
