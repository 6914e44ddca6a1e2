"""The offline tools behind `infer doctor` (`doctor`: whether a configuration runs here, slot by slot),
`infer plugins --matrix` (`plugin_matrix`) and `infer models quantize` (`quantize`, with the FP8 KV
cache's scales from `kv_calibration`): code over the whole stack that the engine never imports."""
