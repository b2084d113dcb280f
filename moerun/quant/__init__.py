"""Expert weight formats: the format table and QTensor (`formats`), torch dequantisation bit-exact
against gguf (`dequant`), ggml's reference quantisers (`quantize`, `kquants`), q8_1 activations and
integer dot products (`q8_1`, the reference for GPU decode kernels) and the dequantised-expert cache
(`cache`). The fast CPU products of these formats are moerun.cpu's native kernels."""
