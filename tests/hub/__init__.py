"""A local Hugging Face Hub endpoint for tests (see server.py)."""
