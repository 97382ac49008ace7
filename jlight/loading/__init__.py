"""Loading models: HF directories (safetensors), GGUF files, the default model, hub ids."""
