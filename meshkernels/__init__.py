"""The engine's kernels: the CPU library (cpu_*.cpp, built by cpu_ops.py), the Triton kernels, and a torch
reference beside each.  Named `meshkernels`, not `kernels`: Hugging Face's `kernels` package (a dependency
of transformers since 5.25) would otherwise be shadowed by this folder and transformers' imports fail."""
