"""The quantization algorithms that turn a model's weights into jlight.core's quantized types:
round-to-nearest (rtn.py), GPTQ (gptq.py) and SmoothQuant (smoothquant.py). They run on the host,
at load time or in `jlight convert`; the kernels only read their results."""
