from pallas_kernels.gemm.api import scaled_dot_general

__all__ = ["scaled_dot_general"]
