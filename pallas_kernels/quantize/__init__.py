from pallas_kernels.quantize.api import dequantize, quantize, quantize_pair

__all__ = ["quantize", "quantize_pair", "dequantize"]
