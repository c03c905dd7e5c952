"""Measuring gptj: `gptj bench latency` (latency.py, gpt-fast's figures on the engine) and the
accuracy of weight-only quantization against float32 (quant_report.py, `gptj quant-report`).

Nothing is imported here, so that `gptj --help` (which adds bench's parser) starts without torch.
"""
