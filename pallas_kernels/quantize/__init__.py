from pallas_kernels.quantize.api import dequantize, quantize

__all__ = ["quantize", "dequantize"]
