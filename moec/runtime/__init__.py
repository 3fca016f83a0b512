"""The runtime: canonical MoE transformer, checkpoint loading, KV caches, perplexity.

Needs only torch and safetensors (triton for kernels); never transformers or datasets.
"""
