"""arle's kernels (imported as `arle_kernels`): each a plain-torch reference, and later a Triton
version beside it that its tests compare against the reference."""
