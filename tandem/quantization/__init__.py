"""Quantized checkpoints: which formats load (``config.py``), the FP8 number format
(``fp8.py``), reading a checkpoint's tensors (``checkpoint.py``) and turning a model's linear
layers into FP8 ones (``convert.py``, ``linear_method.py``).

Layering: below ``models`` (the loader calls it), above ``layers`` (it knows the linear classes)
and ``kernels`` (the FP8 matrix products)."""
from tandem.quantization.config import (QUANTIZATION_CHOICES, QuantizationConfig,
                                        quantization_config_of)

__all__ = ["QUANTIZATION_CHOICES", "QuantizationConfig", "quantization_config_of"]
