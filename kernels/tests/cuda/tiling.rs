//! (placeholder: the tiling kernels' GPU tests land here)
