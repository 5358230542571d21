"""Glue to Hugging Face Trainer and Accelerate (the only modules that import them)."""
