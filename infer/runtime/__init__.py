"""The engine's mechanics beside the loop: the run's models on this rank, each with its attention
backend and `ModelRunner`, and the decoder over them (`runners`); what runs a step on a device
besides the model: the KV cache's tensors (sized to the memory budget, allocated, copied block by
block for copy-on-write and swaps: `kv_cache`, `block_mover`), and the faster paths for decode-only
steps that change no token: CUDA graphs replayed per batch bucket (`cuda_graphs`) and the next
forward queued before this step's tokens reach the host (`pipeline`); and host lists copied to the
device without waiting for the GPU (`transfer`).

The core knows the decode paths only as `DecodeGraphs` and `DecodePipeline`
(`infer.api.decode_paths`); the builder attaches them (`decode_paths`) where the config
and the strategies' capabilities allow.
"""
