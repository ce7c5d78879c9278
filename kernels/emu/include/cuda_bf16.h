// The CPU executor's stand-in for CUDA's header: everything is in cuda_emu.h.
#pragma once
#include "cuda_emu.h"
