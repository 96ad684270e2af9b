"""sparkfleet: provision and operate DGX Spark (GB10) hosts serving Qwen3.5-122B-A10B with vLLM 0.23."""

__version__ = "0.1.0"
