"""Turning a path into a model: `load` (moerun.load), the HF and GGUF name mappings into canonical
tensors (`hf`, `gguf`), and `describe` (what `moerun inspect` prints)."""
