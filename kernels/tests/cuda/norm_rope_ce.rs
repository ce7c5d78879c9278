//! (placeholder: the norm_rope_ce kernels' GPU tests land here)
