"""GPU kernels shipped inside the patched vLLM wheel (the int8 lm head, patch 0003)."""
