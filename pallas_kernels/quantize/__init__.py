from pallas_kernels.quantize.api import dequantize, quantize, quantize_both, quantize_pair

__all__ = ["quantize", "quantize_both", "quantize_pair", "dequantize"]
