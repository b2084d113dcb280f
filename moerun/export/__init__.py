"""Writing checkpoints in other formats: a Hugging Face checkpoint -> a GGUF file with quantised
experts (`to_gguf`, `moerun quantize`; each tensor's format in `convert`), its tokenizer -> GGUF
vocabulary metadata (`gguf_vocab_export`). Files are written through `moerun.export.gguf_writer`."""

from moerun.export.convert import EXPERT_FORMATS, REST_FORMATS, ExportError, QuantizeSpec
from moerun.export.to_gguf import quantize_checkpoint

__all__ = ["EXPERT_FORMATS", "REST_FORMATS", "ExportError", "QuantizeSpec", "quantize_checkpoint"]
