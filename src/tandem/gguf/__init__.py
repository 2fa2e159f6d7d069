"""llama.cpp's GGUF checkpoints, read through the `gguf` package (llama.cpp's own reader and
dequantizer): the file's metadata becomes a Hugging Face config and tokenizer, its tensors are
dequantized into our parameters at load (no conversion on disk)."""

from tandem.gguf.reader import is_gguf_path

__all__ = ["is_gguf_path"]
