"""Values the command line offers and the engine checks, kept in one torch-free place."""

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: a GGUF's own types, bf16 for Hugging Face weights
QUANTIZE = ("int4", "int8")  # group-32 weight quantisation of Hugging Face weights on the CPU kernels
