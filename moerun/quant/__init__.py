"""Expert weight formats: the format table and QTensor (`formats`), torch dequantisation
(`dequant`), ggml's reference quantisers (`quantize`) and the dequantised-expert cache (`cache`)."""
