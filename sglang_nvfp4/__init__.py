"""sglang-nvfp4: sparse attention over an NVFP4 KV cache, served by SGLang.

Parts (``docs/architecture.md`` has the path of one forward pass through them):

* :mod:`.format`: the cache layout and the NVFP4 number formats;
* :mod:`.reference`: the kernel contract and its torch oracle;
* :mod:`.kernels`: the dispatcher (plan per forward, run per layer) over Triton and FlyDSL kernels;
* :mod:`.indexer`: block selection (the ``BlockIndexer`` protocol, the training-free ``SummaryIndexer``);
* :mod:`.sglang`: the SGLang plugin, KV pool and ``nvfp4_sparse`` attention backend;
* :mod:`.quality`: the retrieval model and evaluation harness;
* :mod:`.local_server`, :mod:`.tiny_model`, :mod:`.demo`, :mod:`.cpu_compat`: serving helpers and the demo.
"""

__version__ = "0.1.0"
