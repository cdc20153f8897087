"""Attention and other kernels: a torch reference beside each Triton kernel (see STYLE.md)."""
