"""SGLang integration: the NVFP4 KV pool, the ``nvfp4_sparse`` attention backend and the plugin
that registers both with SGLang 0.5.23 (entry point group ``sglang.srt.plugins``)."""

BACKEND_NAME = "nvfp4_sparse"
