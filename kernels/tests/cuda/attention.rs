//! (placeholder: the attention kernels' GPU tests land here)
