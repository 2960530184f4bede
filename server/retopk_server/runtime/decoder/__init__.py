"""The model's forward without transformers' modules: Llama-family decoder math over weights held in the
format the server chose (linear.py: float, int8, int4), built from a checkpoint or a GGUF file (load.py)."""
