"""Custom kernels the XLA programs call where XLA's own code is too slow (see cpu_gemm.py)."""
