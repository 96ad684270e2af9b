"""What the controller builds and ships: the patched vLLM wheel and its wheelhouse, checkpoints, the
hub cache and the safetensors reader, and the CUDA code a wheel carries."""
