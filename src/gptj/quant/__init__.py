"""Quantization as module swaps: weight-only int8 per output channel and int4 per group, W4A8 (int4's
weights, activations rounded to int8 per block of 32 inputs at each call), W8A8
(int8 weights and per-token int8 activations, with calibrated SmoothQuant factors), and FP8 (e4m3
weights per output channel; e4m3 activations per token in big calls; GPUs with FP8 units).

  ops        the tensor math: quantize / dequantize int8, int4 and fp8, the int4 layouts, W8A8's rows and factors
  format     the quantized checkpoint: its tensors, config.json's `quantization` entry, QUANT_MODES
  base       what the layers share: QuantLinear, its kernels chosen once per device and dtype (LinearMethod)
  int8, int4, w4a8, w8a8, fp8   one file per kind: Int8Linear, Int4Linear, W4A8Linear, W8A8Linear
             (+ PackedW8A8Linear), Fp8Linear
  linear     the model-level swaps (quantize_model, swap_quantized_modules, prepare_model, ...)
  cuda       Triton GEMVs and GEMMs for CUDA: int8 (and e4m3) and int4 weights, dequantized inside
  calibrate  W8A8's calibration: input |max| per channel over prompts, the smoothing factors, their file

Which kernel a quantized layer's call runs is gptj.policy's LINEAR_TABLE (KERNEL_MAX_ROWS lives there).
"""

from gptj import native
from gptj.policy import KERNEL_MAX_ROWS, native_available
from gptj.quant.format import (
    QUANT_LEAVES,
    QUANT_MODES,
    QUANT_VERSION,
    check_mode,
    check_quantization,
    fitting_group_size,
    is_quant_param,
    linear_in_features,
    make_quantization,
    quantize_state_dict,
    quantize_weight,
    quantized_specs,
    resolve_quantization,
    same_request,
)
from gptj.quant.linear import (
    KERNEL_DTYPE,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    W4A8Linear,
    W8A8Linear,
    is_quantized,
    linear_names,
    prepare_model,
    quantize_model,
    swap_quantized_modules,
)
from gptj.quant.ops import (
    DEFAULT_GROUP_SIZE,
    FP8_DTYPE,
    FP8_MAX,
    INT4_GROUP_SIZES,
    SCALE_DTYPE,
    SMOOTH_ALPHA,
    _pack_cpu_int4,
    _row_chunks,
    _unpack_cpu_int4,
    check_group_size,
    chunked_linear,
    cpu_int4_layout,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    fp8_error_bound,
    fp8_sums,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_rows_fp8,
    quantize_rows_int8,
    smoothing_factors,
    unpack_int4,
)

# tests/conftest.py resets `_NATIVE` (once quant's own cache of gptj.native) and tests/test_kernels.py
# calls `_native()`. The native check is now gptj.policy's, and gptj.native caches its own
# answer, so `_NATIVE` holds nothing and `_native()` only reports that check.
_NATIVE: list = []


def _native():  # noqa: ANN202 - the gptj.native module, or None where its kernels cannot be used
    return native if native_available() else None


__all__ = [
    "QUANT_MODES", "QUANT_LEAVES", "INT4_GROUP_SIZES", "DEFAULT_GROUP_SIZE", "KERNEL_MAX_ROWS", "Int8Linear",
    "Int4Linear", "W4A8Linear", "W8A8Linear", "Fp8Linear", "FP8_DTYPE", "FP8_MAX", "quantize_fp8", "dequantize_fp8",
    "quantize_rows_fp8",
    "fp8_error_bound", "fp8_sums", "SMOOTH_ALPHA", "quantize_rows_int8", "smoothing_factors",
    "quantize_int8", "quantize_int4", "dequantize_int8", "dequantize_int4", "pack_int4", "unpack_int4",
    "quantize_weight", "quantize_model", "quantize_state_dict", "make_quantization", "check_quantization",
    "resolve_quantization",
    "quantized_specs", "swap_quantized_modules", "prepare_model", "is_quantized", "linear_names",
    "cpu_int4_layout",
]
